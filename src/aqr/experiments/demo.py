"""``aqr demo``: the paper's comparison (Source, TTN, TENT, SAR, moments, AQR) end to end, on CPU, in minutes.

With no data at all it runs on scikit-learn's handwritten digits (1,797 real 8x8 images shipped
inside scikit-learn): upscaled to 32x32 RGB and split (seeded) into train / source / test, it trains
a small BatchNorm ResNet, a GroupNorm ResNet and a LayerNorm ViT, corrupts the test split with
:func:`aqr.data.cifar_c.generate_cifar_c`, and runs the grid through the real benchmark path
(:func:`aqr.harness.grid_driver.run_grid`) into a results database in the work folder, so a second run reuses
the models, the data and every finished cell. Given ``data``/``cifar_c``/``checkpoint`` it runs the
same comparison on CIFAR-10(-C) with an existing model instead (no training).

Work folder layout: ``data/`` (npz splits, ``digits-c/``), ``models/`` (aqr checkpoints,
``train.log``), ``cache/`` (source statistics), ``results.db``, ``demo.png``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from aqr.data.arrays import load_npz_arrays
from aqr.harness.cells import DataSpec, ModelSpec, eval_indices, parse_range
from aqr.harness.grid_driver import GridSummary
from aqr.harness.presets import BASELINES
from aqr.harness.results import Row
from aqr.harness.specs import GridSpec, MethodSpec
from aqr.util.files import atomic_write, sha256_file
from aqr.util.plots import colors as plot_colors
from aqr.util.plots import figure, require_matplotlib, save

# Corruptions that need no external files (frost needs overlay images), one or two per family, among
# those that shift the digits most: on 32 px digits JPEG, defocus blur and saturate barely change a
# trained ResNet's accuracy. Five corruptions x two severities keep the demo within ~3 minutes.
DEMO_CORRUPTIONS = ("gaussian_noise", "impulse_noise", "motion_blur", "fog", "contrast")
QUICK_CORRUPTIONS = ("gaussian_noise", "contrast")
DEMO_SEVERITIES = (3, 5)
QUICK_SEVERITIES = (5,)
EXTRAS_HINT = "pip install 'aqr[demo]'"

Table = dict[str, dict[str, float | None]]  # method -> model -> mean accuracy (None: n/a)
PerCorruption = dict[str, dict[str, dict[str, float]]]  # model -> method -> corruption -> accuracy


@dataclass(frozen=True)
class DemoModel:
    """A small source model the digits demo trains: architecture, norm, size and schedule."""

    name: str
    arch: str
    norm: str
    kwargs: Mapping[str, Any]
    epochs: int
    quick_epochs: int
    lr: float
    batch_size: int


# Narrow enough to train in seconds on one core. AdamW: SGD at lr 0.1 hardly moves the GN net in a
# few epochs. Small batches give the ResNets enough steps on ~1,000 images. Patch 8 keeps the ViT at
# 16 tokens (the digits are 8x8 images, upscaled); mean pooling learns faster than a class token.
DIGITS_MODELS = (
    DemoModel("resnet20_bn", "resnet20", "bn", {"width": 8}, epochs=4, quick_epochs=1, lr=3e-3, batch_size=16),
    DemoModel("resnet20_gn", "resnet20", "gn", {"width": 8, "groups": 4}, epochs=5, quick_epochs=3, lr=2e-3,
              batch_size=16),
    DemoModel("vit_ln", "vit", "ln", {"dim": 64, "depth": 2, "heads": 4, "patch_size": 8, "pool": "mean"},
              epochs=15, quick_epochs=8, lr=3e-3, batch_size=32),
)


@dataclass(frozen=True)
class DemoConfig:
    """What ``aqr demo`` runs; ``None`` fields take the defaults of the digits or CIFAR path.

    Attributes:
        out: work folder (models, data, statistics cache, results database, figure).
        seed: seeds the digits split, training, and the cells' image order.
        quick: fewer epochs, corruptions, severities and images (about half a minute; for tests).
        threads: torch threads while the demo runs (None or 0: torch's default). One by default:
            the models are tiny, and on a loaded machine more OpenMP threads than free cores made
            training steps 40x slower in our measurements.
        figure: write ``<out>/demo.png``.
        progress: show progress bars.
        data, cifar_c, checkpoint: CIFAR path: clean ``.npz`` for the source statistics, a CIFAR-C
            folder to evaluate on, an aqr checkpoint file or zoo name (or third-party weights with
            ``arch``). All three or none.
        model_name, arch: label of that model in the table; architecture for third-party weights.
        corruptions, severities, batch_size, n_images: the grid (n_images per cell).
        source_indices, eval_indices: CIFAR path: ``"start:stop"`` of the npz for the statistics
            (default: its first half, at most 5,000) and of the CIFAR-C pool the cells draw from
            (default: the folder's second half).
    """

    out: str = "runs/demo"
    seed: int = 0
    quick: bool = False
    threads: int | None = 1
    figure: bool = True
    progress: bool = False
    data: str | None = None
    cifar_c: str | None = None
    checkpoint: str | None = None
    model_name: str | None = None
    arch: str | None = None
    corruptions: tuple[str, ...] | None = None
    severities: tuple[int, ...] | None = None
    batch_size: int | None = None
    n_images: int | None = None
    source_indices: str | None = None
    eval_indices: str | None = None

    @property
    def cifar(self) -> bool:
        """True for the CIFAR path: any of its options is set (then all three files must be)."""
        return any(v is not None for v in (self.data, self.cifar_c, self.checkpoint, self.arch, self.model_name,
                                           self.source_indices, self.eval_indices))


@dataclass
class DemoResult:
    """What a demo run produced.

    ``accuracy[method][model]``: mean accuracy (%) over the grid's corruptions and severities, None
    where the method does not apply (or every cell failed). ``clean[model]``: the unadapted model on
    the same images without corruption (None when the clean images are unknown).
    ``per_corruption[model][method][corruption]``: mean over severities.
    """

    out: Path
    db: Path
    figure: Path | None
    dataset: str
    models: tuple[str, ...]
    methods: tuple[str, ...]
    corruptions: tuple[str, ...]
    severities: tuple[int, ...]
    n_images: int
    batch_size: int
    accuracy: Table
    clean: dict[str, float | None]
    per_corruption: PerCorruption
    summary: GridSummary
    trained: tuple[str, ...] = ()
    wall_s: float = 0.0

    def format_table(self) -> str:
        """The result table as text: rows = methods (plus clean), columns = models."""
        return format_table(self)


# ----------------------------------------------------------------------------- digits data


@dataclass(frozen=True)
class DigitsSplits:
    """The digits as three disjoint (images uint8 N x 32 x 32 x 3, labels int64) splits."""

    train: tuple[np.ndarray, np.ndarray]
    source: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]


def _require_extras() -> None:
    """Fail early, naming the extra to install, when the demo's optional packages are missing."""
    missing = []
    for module, package in (("sklearn", "scikit-learn"), ("PIL", "Pillow"), ("scipy", "scipy")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ImportError(f"the digits demo needs {', '.join(missing)}: {EXTRAS_HINT} "
                          "(or run it on CIFAR files with --data, --cifar-c and --checkpoint)")


def load_digits_rgb32() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as uint8 (N, 32, 32, 3) images (bilinear upscale, gray in 3 channels)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(f"the digits demo needs scikit-learn: {EXTRAS_HINT}") from err
    from PIL import Image

    digits = load_digits()
    gray = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)  # pixel values are 0..16
    big = np.stack([np.asarray(Image.fromarray(im).resize((32, 32), Image.BILINEAR)) for im in gray])
    return np.repeat(big[..., None], 3, axis=-1), digits.target.astype(np.int64)


def split_digits(images: np.ndarray, labels: np.ndarray, seed: int = 0, n_source: int = 200,
                 n_test: int = 600) -> DigitsSplits:
    """A seeded random split into disjoint test, source (statistics) and train (the rest) parts."""
    if n_source + n_test >= len(images):
        raise ValueError(f"n_source + n_test must leave training images; got {n_source} + {n_test} of {len(images)}")
    order = np.random.default_rng(seed).permutation(len(images))
    test, source, train = order[:n_test], order[n_test:n_test + n_source], order[n_test + n_source:]
    return DigitsSplits(*((images[i], labels[i]) for i in (train, source, test)))


def _write_npz(path: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """Write ``x``/``y`` unless the file already holds exactly these arrays.

    An npz records write times, so rewriting identical data would change its hash and with it every
    cell key and cached statistic that depends on it: the demo would never resume.
    """
    if path.is_file():
        old_images, old_labels = load_npz_arrays(path)
        if np.array_equal(old_images, images) and np.array_equal(old_labels, labels):
            return path
    return atomic_write(path, lambda tmp: np.savez(tmp, x=images, y=labels), suffix=".npz")


# ----------------------------------------------------------------------------- training


def _train_config(spec: DemoModel, train_npz: Path, out: Path, seed: int, quick: bool) -> Any:
    from aqr.models.train import TrainConfig

    # No augmentation: random flips turn digits into other digits. No per-epoch test evaluation:
    # it would cost about as much as a third of the training; the model is evaluated once at the end.
    return TrainConfig(model=spec.arch, data=str(train_npz), norm=spec.norm,
                       model_kwargs=dict(spec.kwargs), epochs=spec.quick_epochs if quick else spec.epochs,
                       batch_size=spec.batch_size, optimizer="adamw", lr=spec.lr, weight_decay=0.05,
                       warmup_epochs=0.5, augment=False, seed=seed, out=str(out), command="aqr demo")


# Fields that do not change the trained weights: a checkpoint that differs only in these is reused
# (the training data is compared by its hash; a checkpoint records its paths cut of machine folders).
_IGNORED_TRAIN_FIELDS = ("threads", "command", "data", "test", "out", "work_dir")


def _same_training(checkpoint: Path, cfg: Any) -> bool:
    """True when ``checkpoint`` is a finished run of ``cfg`` on the same training data."""
    from aqr.models.checkpoint import CheckpointError, read_file
    from aqr.models.portable import portable_train_config

    if not checkpoint.is_file():
        return False
    try:
        meta = read_file(checkpoint).get("meta") or {}
    except CheckpointError:
        return False
    old, new = dict(meta.get("train_config") or {}), portable_train_config(asdict(cfg))
    for key in _IGNORED_TRAIN_FIELDS:
        old.pop(key, None)
        new.pop(key, None)
    return (old == new and not meta.get("partial", True)
            and meta.get("data_sha256") == sha256_file(cfg.data))


def train_models(specs: Sequence[DemoModel], train_npz: Path, test: tuple[np.ndarray, np.ndarray],
                 models_dir: Path, seed: int, quick: bool,
                 log: Callable[[str], None]) -> tuple[dict[str, Path], list[str]]:
    """Train (or reuse) each model, logging its clean ``test`` accuracy; returns ({name: checkpoint}, trained)."""
    import torch

    from aqr.models.train import evaluate_accuracy, train

    paths: dict[str, Path] = {}
    trained: list[str] = []
    models_dir.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        path = models_dir / f"{spec.name}.pt"
        cfg = _train_config(spec, train_npz, path, seed, quick)
        paths[spec.name] = path
        if _same_training(path, cfg):
            log(f"model {spec.name}: reusing {path}")
            continue
        t0 = time.perf_counter()
        with open(models_dir / "train.log", "a") as train_log:
            result = train(cfg, log=train_log)
        trained.append(spec.name)
        accuracy = evaluate_accuracy(result["model"], torch.from_numpy(test[0]), torch.from_numpy(test[1]))
        log(f"model {spec.name}: trained {cfg.epochs} epochs in {time.perf_counter() - t0:.1f} s, "
            f"clean test accuracy {accuracy:.1f}%")
    return paths, trained


# ----------------------------------------------------------------------------- the grid


def _methods() -> tuple[MethodSpec, ...]:
    return tuple(MethodSpec(m) for m in BASELINES)


def digits_grid(config: DemoConfig, checkpoints: Mapping[str, Path], source_npz: Path, n_source: int,
                cifar_c: Path, n_test: int) -> GridSpec:
    """The digits grid: every trained model x the methods (BASELINES) x corruptions x severities."""
    n_images = min(config.n_images or (200 if config.quick else n_test), n_test)
    models = tuple(ModelSpec(name, str(path), None, str(source_npz), f"0:{n_source}")
                   for name, path in checkpoints.items())
    return GridSpec("demo", models, DataSpec("digits-c", str(cifar_c), f"0:{n_test}"), _methods(),
                    corruptions=_corruptions(config), severities=_severities(config),
                    batch_sizes=(config.batch_size or (100 if config.quick else 200),), seeds=(config.seed,),
                    n_images=n_images, protocol="episodic")


def _corruptions(config: DemoConfig) -> tuple[str, ...]:
    return tuple(config.corruptions or (QUICK_CORRUPTIONS if config.quick else DEMO_CORRUPTIONS))


def _severities(config: DemoConfig) -> tuple[int, ...]:
    return tuple(config.severities or (QUICK_SEVERITIES if config.quick else DEMO_SEVERITIES))


def prepare_digits(config: DemoConfig, out: Path, log: Callable[[str], None]) -> tuple[GridSpec, list[str], Path]:
    """Digits path: write the splits, train the models, corrupt the test split; returns (grid, trained, test npz)."""
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c

    _require_extras()
    splits = split_digits(*load_digits_rgb32(), seed=config.seed)
    data_dir = out / "data"
    train_npz = _write_npz(data_dir / "digits_train.npz", *splits.train)
    source_npz = _write_npz(data_dir / "digits_source.npz", *splits.source)
    test_npz = _write_npz(data_dir / "digits_test.npz", *splits.test)
    log(f"digits: {len(splits.train[1])} train, {len(splits.source[1])} source, {len(splits.test[1])} test "
        f"images (32x32 RGB) in {data_dir}")
    checkpoints, trained = train_models(DIGITS_MODELS, train_npz, splits.test, out / "models", config.seed,
                                        config.quick, log)
    cifar_c = data_dir / "digits-c"
    corruptions, severities = _corruptions(config), _severities(config)
    gen = GenerationConfig(corruptions=corruptions, severities=severities, seed=config.seed,
                           source={"file": test_npz.name, "sha256": sha256_file(test_npz)})
    timings = generate_cifar_c(*splits.test, cifar_c, gen, progress=config.progress)
    if timings:
        log(f"corrupted the test split: {len(timings)} corruptions x severities {list(severities)} "
            f"in {sum(timings.values()):.1f} s -> {cifar_c}")
    grid = digits_grid(config, checkpoints, source_npz, len(splits.source[1]), cifar_c, len(splits.test[1]))
    return grid, trained, test_npz


def _folder_contents(root: Path) -> tuple[dict[str, list[int]], int]:
    """({corruption: severities} present in a CIFAR-C folder, images per severity block)."""
    from aqr.data.corruption_params import CORRUPTIONS

    manifest = root / "manifest.json"
    info = json.loads(manifest.read_text()) if manifest.is_file() else {}
    default = info.get("severities", [1, 2, 3, 4, 5])  # the released folders: five blocks, no manifest
    present = {}
    for name in CORRUPTIONS:
        if (root / f"{name}.npy").is_file():
            entry = info.get("corruptions", {}).get(name) or {}
            present[name] = [int(s) for s in entry.get("severities", default)]
    if not present:
        raise FileNotFoundError(f"{root}: no <corruption>.npy files of a CIFAR-C folder")
    labels = np.load(root / "labels.npy", mmap_mode="r", allow_pickle=False)
    blocks = len(next(iter(present.values())))
    # labels.npy holds either one label per image or one per row of every severity block
    return present, len(labels) // blocks if len(labels) % blocks == 0 else len(labels)


def _choose_corruptions(config: DemoConfig, root: Path,
                        present: Mapping[str, list[int]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The requested corruptions, else the demo's that the folder has; severities they all have."""
    wanted = tuple(config.corruptions or (c for c in _corruptions(config) if c in present))
    if not wanted:
        raise FileNotFoundError(f"{root}: none of the demo corruptions ({', '.join(_corruptions(config))}); "
                                f"pass --corruptions from {', '.join(present)}")
    missing = [c for c in wanted if c not in present]
    if missing:
        raise FileNotFoundError(f"{root}: no {', '.join(missing)}.npy")
    available = set.intersection(*(set(present[c]) for c in wanted))
    severities = config.severities or tuple(s for s in _severities(config) if s in available) or (max(available),)
    return wanted, tuple(severities)


def _cifar_model(config: DemoConfig, source_indices: str) -> ModelSpec:
    """An aqr checkpoint or zoo name as is; third-party weights through their architecture."""
    checkpoint = str(config.checkpoint)
    name = config.model_name or config.arch or Path(checkpoint).stem
    if config.arch:
        return ModelSpec(name, config.arch, checkpoint, str(config.data), source_indices)
    return ModelSpec(name, checkpoint, None, str(config.data), source_indices)


def cifar_grid(config: DemoConfig) -> GridSpec:
    """CIFAR path: the given model on the given CIFAR-C folder, statistics from the given npz.

    Defaults: statistics from the npz's first half (at most 5,000 images), evaluation drawn from the
    folder's second half, so with CIFAR-10's test set and CIFAR-10-C the two never share an image.
    """
    if not (config.data and config.cifar_c and config.checkpoint):
        raise ValueError("the CIFAR demo needs all of --data (clean .npz), --cifar-c (folder) and --checkpoint")
    n_clean = len(load_npz_arrays(config.data)[1])
    root = Path(config.cifar_c)
    present, n = _folder_contents(root)
    corruptions, severities = _choose_corruptions(config, root, present)
    source = config.source_indices or f"0:{max(1, min(n_clean // 2, 5000))}"
    pool = config.eval_indices or f"{n // 2}:{n}"
    n_images = min(config.n_images or (200 if config.quick else 1000), len(parse_range(pool) or []))
    return GridSpec("demo-cifar", (_cifar_model(config, source),), DataSpec(root.name or "cifar-c", str(root), pool),
                    _methods(), corruptions=corruptions, severities=severities,
                    batch_sizes=(config.batch_size or (100 if config.quick else 200),), seeds=(config.seed,),
                    n_images=n_images, protocol="episodic")


# ----------------------------------------------------------------------------- results


def clean_accuracy(grid: GridSpec, clean_npz: str | Path) -> dict[str, float | None]:
    """Each model unadapted on the clean versions of the images its cells evaluate.

    The npz holds the clean images when its labels over the evaluated indices equal the CIFAR-C
    folder's (as for CIFAR-10's test set and CIFAR-10-C); otherwise the clean accuracy is None.
    """
    from aqr.data import load_cifar_c
    from aqr.harness.eval_loop import evaluate
    from aqr.harness.inputs import load_model
    from aqr.methods import create

    images, labels = load_npz_arrays(clean_npz)
    cell = next(grid.cells())
    idx = np.asarray(eval_indices(cell, parse_range(grid.data.eval_indices) or []))
    if idx.max() >= len(labels):
        return {m.name: None for m in grid.models}
    folder_labels = load_cifar_c(grid.data.root, cell.corruption, cell.severity, indices=idx).labels
    if not np.array_equal(labels[idx], folder_labels):
        return {m.name: None for m in grid.models}
    return {m.name: evaluate(create("source", load_model(m)), images[idx], labels[idx], grid.batch_sizes[0])[0]
            for m in grid.models}


def grid_rows(grid: GridSpec, db: Any) -> list[Row]:
    """The database rows of exactly this grid's cells (not of earlier runs with other settings)."""
    from aqr.harness.grid_driver import keyed_cells

    keys = {key for key, _, _ in keyed_cells(grid)}
    return [r for r in db.rows(experiment=grid.name) if r.key in keys]


def summarize(rows: Sequence[Row]) -> tuple[Table, PerCorruption]:
    """(accuracy[method][model], per_corruption[model][method][corruption]) as means over the ok rows."""
    groups: dict[tuple[str, str], list[float]] = {}
    per: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        groups.setdefault((r.method, r.model), [])
        if r.status == "ok" and r.accuracy is not None:
            groups[(r.method, r.model)].append(r.accuracy)
            per.setdefault((r.model, r.method, r.corruption), []).append(r.accuracy)
    accuracy: Table = {}
    for (method, model), values in groups.items():
        accuracy.setdefault(method, {})[model] = float(np.mean(values)) if values else None
    per_corruption: PerCorruption = {}
    for (model, method, corruption), values in per.items():
        per_corruption.setdefault(model, {}).setdefault(method, {})[corruption] = float(np.mean(values))
    return accuracy, per_corruption


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_table(result: DemoResult) -> str:
    """Rows = clean + methods, columns = models; 'n/a' where a method does not apply."""
    width = max(12, *(len(m) + 2 for m in result.models))
    head = (f"accuracy (%) on {result.dataset}: mean over {_plural(len(result.corruptions), 'corruption')} x "
            f"severities {', '.join(map(str, result.severities))}; {result.n_images} images per cell, "
            f"batch {result.batch_size}")
    lines = [head, f"{'method':<10}" + "".join(f"{m:>{width}}" for m in result.models)]

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    lines.append(f"{'clean':<10}" + "".join(f"{fmt(result.clean.get(m)):>{width}}" for m in result.models))
    for method in result.methods:
        row = result.accuracy.get(method, {})
        lines.append(f"{method:<10}" + "".join(f"{fmt(row.get(m)):>{width}}" for m in result.models))
    return "\n".join(lines)


def write_figure(result: DemoResult, path: str | Path) -> Path:
    """Grouped bars (accuracy per method per model, clean as a dashed line) and per-corruption panels."""
    models, methods = result.models, result.methods
    colors = plot_colors(methods)
    fig = figure((max(8.0, 4.0 * len(models)), 7.5), layout="constrained")
    grid = fig.add_gridspec(2, len(models))
    ax = fig.add_subplot(grid[0, :])
    bar_w = 0.8 / len(methods)
    for j, method in enumerate(methods):
        for i, model in enumerate(models):
            value = result.accuracy.get(method, {}).get(model)
            x = i - 0.4 + (j + 0.5) * bar_w
            if value is None:
                ax.text(x, 1, "n/a", ha="center", va="bottom", rotation=90, fontsize=8)
            else:
                bars = ax.bar(x, value, bar_w, color=colors[method], label=method if i == 0 else None)
                ax.bar_label(bars, fmt="%.0f", fontsize=7)
    for i, model in enumerate(models):
        if result.clean.get(model) is not None:
            ax.hlines(result.clean[model], i - 0.45, i + 0.45, colors="k", linestyles="dashed",
                      label="clean (no shift)" if i == 0 else None)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    fig.suptitle(f"{result.dataset}: accuracy per method, mean over "
                 f"{_plural(len(result.corruptions), 'corruption')} x severities "
                 f"{', '.join(map(str, result.severities))} (below: per corruption)")
    ax.legend(ncol=len(methods) + 1, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    for i, model in enumerate(models):
        sub = fig.add_subplot(grid[1, i])
        per = result.per_corruption.get(model, {})
        xs = np.arange(len(result.corruptions))
        for j, method in enumerate(methods):
            values = [per.get(method, {}).get(c, np.nan) for c in result.corruptions]
            sub.bar(xs - 0.4 + (j + 0.5) * bar_w, values, bar_w, color=colors[method])
        sub.set_xticks(xs, [c.replace("_", "\n") for c in result.corruptions], fontsize=7)
        sub.set_ylim(0, 100)
        sub.set_title(model, fontsize=9)
        if i == 0:
            sub.set_ylabel("accuracy (%)")
    return save(fig, path, dpi=110)[0]


# ----------------------------------------------------------------------------- entry point


def run_demo(config: DemoConfig = DemoConfig(), log: Callable[[str], None] = print) -> DemoResult:
    """Prepare models and data (digits, or the CIFAR files given), run the grid, tabulate and plot.

    Resumable: models, corrupted data, statistics and finished cells in ``config.out`` are reused.
    """
    import torch

    previous_threads = torch.get_num_threads()
    if config.figure:  # before any work: the figure comes last
        require_matplotlib("the demo's figure (or --no-figure)")
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _run(config, log)
    finally:
        torch.set_num_threads(previous_threads)


def _run(config: DemoConfig, log: Callable[[str], None]) -> DemoResult:
    from aqr.harness.cell_run import clear_caches
    from aqr.harness.grid_driver import run_grid
    from aqr.harness.results import ResultsDB

    t0 = time.perf_counter()
    out = Path(config.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Models or corrupted images in the work folder may have been rewritten (retrained, regenerated
    # for another seed) since this process last cached them.
    clear_caches()
    trained: list[str] = []
    if config.cifar:
        grid = cifar_grid(config)
        clean_npz: Path | str = config.data or ""
    else:
        grid, trained, clean_npz = prepare_digits(config, out, log)
    db_path = out / "results.db"
    with ResultsDB(db_path) as db:
        summary = run_grid(grid, db, out / "cache", progress=config.progress, log=log)
        rows = grid_rows(grid, db)
    for message in summary.error_messages:
        log(f"error: {message}")
    accuracy, per_corruption = summarize(rows)
    result = DemoResult(out=out, db=db_path, figure=None, dataset=grid.data.name,
                        models=tuple(m.name for m in grid.models), methods=tuple(m.name for m in grid.methods),
                        corruptions=grid.corruptions, severities=grid.severities,
                        n_images=int(grid.n_images or 0), batch_size=grid.batch_sizes[0], accuracy=accuracy,
                        clean=clean_accuracy(grid, clean_npz), per_corruption=per_corruption, summary=summary,
                        trained=tuple(trained))
    if config.figure:
        result.figure = write_figure(result, out / "demo.png")
    result.wall_s = time.perf_counter() - t0
    return result
