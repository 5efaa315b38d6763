"""Running benchmark cells: evaluation loop, cached source statistics, and the resumable grid.

:func:`run_cell` is a pure function of a :class:`aqr.bench.grid.Cell` (plus where the statistics cache
is): it loads the model, data and statistics it needs, runs one method and returns a
:class:`CellResult`. :func:`run_grid` expands a grid, skips the cells already in the results
database, prepares every source-statistics file once, runs the rest on an executor (this process,
local worker processes: :mod:`aqr.bench.executors`; a Ray cluster: :mod:`aqr.bench.ray_executor`)
and is the only writer of the database. Runs sharing a database divide the cells between them
(:mod:`aqr.bench.claims`).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import platform
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from aqr.bench.grid import (STATS_OPTIONS, Cell, DataSpec, GridSpec, ModelSpec, canonical_json, cell_key,
                            data_corruptions, eval_indices, legacy_cell_key, location_free, parse_range,
                            stream_corruptions, stream_positions)
from aqr.bench.results import ResultsDB, pack_correct
from aqr.core.calibrate import DEFAULT_TAIL_UNIT
from aqr.core.stats import StatsError
from aqr.data.arrays import to_float
from aqr.data.images import ImageFolder, Preprocess, balanced_subset, is_image_source, listing_fingerprint
from aqr.util.files import sha256_cached
from aqr.util.threads import torch_threads

if TYPE_CHECKING:
    from aqr.bench.executors import CellExecutor, CellSettings
    from aqr.bench.claims import Claims
    from aqr.bench.ray_executor import RayOptions

DEFAULT_K = 101
DEFAULT_MAX_SAMPLES = 100_000
DEFAULT_GROUPS = 16  # aqr.AQRConfig.groups


@dataclass(frozen=True)
class CellResult:
    """What a cell produced. ``status``: ``"ok"``, ``"n/a"`` (method not applicable) or ``"error"``.

    ``node``, ``threads`` and ``device``: the host that ran the cell, torch's thread count and the
    device there (``None`` when the cell never ran, e.g. its worker died). ``detail``: what a continual
    cell keeps beyond its accuracy (:func:`aqr.bench.continual.stream_detail`).
    """

    status: str
    accuracy: float | None = None
    n_images: int | None = None
    wall_s: float | None = None
    message: str | None = None
    node: str | None = None
    threads: int | None = None
    device: str | None = None
    detail: dict[str, Any] | None = None
    correct: bytes | None = None  # per image, in evaluation order: aqr.bench.results.pack_correct


# ----------------------------------------------------------------------------- evaluation


def evaluate(method: nn.Module, images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
             batch_size: int, progress: bool = False, desc: str = "") -> tuple[float, int]:
    """Top-1 accuracy (percent) of ``method`` fed ``images`` in order, ``batch_size`` at a time.

    ``images``: uint8 NHWC array or float NCHW tensor in [0, 1]. The last batch may be smaller.
    Returns ``(accuracy, number of images)``.
    """
    return evaluate_batches(method, array_batches(images, labels, batch_size), progress, desc,
                            total=-(-len(labels) // batch_size))


def array_batches(images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
                  batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """``(images, labels)`` batches of arrays in order, images as float NCHW in [0, 1]; the last may be smaller."""
    labels = torch.as_tensor(np.asarray(labels)).long()
    if len(labels) == 0:
        raise ValueError("no images to evaluate")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # checked above, read lazily
        for start in range(0, len(labels), batch_size):
            x = images[start : start + batch_size]
            yield (to_float(x) if isinstance(x, np.ndarray) else x), labels[start : start + batch_size]

    return batches()


def evaluate_batches(method: nn.Module, batches: Iterable[tuple[torch.Tensor, Any]], progress: bool = False,
                     desc: str = "", total: int | None = None,
                     device: torch.device | str | None = None) -> tuple[float, int]:
    """Top-1 accuracy (percent) and image count of ``method`` on ``(images, labels)`` batches, in order
    (e.g. a DataLoader). Inputs go to ``device`` (default: where the method's parameters are)."""
    correct = image_correct(method, batches, progress, desc, total, device)
    return 100.0 * float(correct.mean()), int(correct.size)


def image_correct(method: nn.Module, batches: Iterable[tuple[torch.Tensor, Any]], progress: bool = False,
                  desc: str = "", total: int | None = None, device: torch.device | str | None = None) -> np.ndarray:
    """Whether ``method``'s top-1 prediction is right, per image, in the order of ``batches`` (bool array).

    Raises ``ValueError`` when there is no image.
    """
    from tqdm.auto import tqdm

    if device is None:
        param = next(method.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    found = []
    for x, y in tqdm(batches, desc=desc or "batches", leave=False, disable=not progress, unit="batch", total=total):
        logits = method(x.to(device, non_blocking=True))
        found.append((logits.argmax(1).cpu() == torch.as_tensor(y).long()).numpy())
    if sum(len(f) for f in found) == 0:
        raise ValueError("no images to evaluate")
    return np.concatenate(found).astype(bool)


# ----------------------------------------------------------------------------- files and caches


def model_file(spec: ModelSpec) -> Path | None:
    """The file holding the model's weights, or None for a pretrained timm/torchvision name."""
    from aqr import models

    if spec.checkpoint:
        return Path(spec.checkpoint)
    if Path(spec.model).is_file():
        return Path(spec.model)
    entries = models.zoo()
    if spec.model in entries:
        return entries[spec.model]
    return None


def uses_image_folders(data: DataSpec) -> bool:
    """Whether ``data`` is in the ImageNet-C folder layout (``<root>/<corruption>/<severity>/<class>/``)
    rather than CIFAR-C arrays: decided by what is on disk, or by its clean source when nothing is yet."""
    root = Path(data.root)
    if not root.is_dir() or any(root.glob("*.npy")):
        return not root.is_dir() and bool(data.clean) and is_image_source(data.clean)
    return any(p.is_dir() for p in root.iterdir()) or (bool(data.clean) and is_image_source(data.clean))


def cell_files(cell: Cell) -> dict[str, Path]:
    """Role -> file or image folder for everything a cell reads (its content key goes into the cell key)."""
    files: dict[str, Path] = {}
    weights = model_file(cell.model)
    if weights is not None:
        files["weights"] = weights
    files["source"] = Path(cell.model.source_data)
    streamed = stream_corruptions(cell.corruption)
    if streamed is not None:  # a continual cell reads every corruption of its stream
        files.update({f"eval:{name}": Path(cell.data.root) / f"{name}.npy" for name in streamed})
        files["labels"] = Path(cell.data.root) / "labels.npy"
    elif uses_image_folders(cell.data):
        files["eval"] = Path(cell.data.root) / cell.corruption / str(cell.severity)
    else:
        files["eval"] = Path(cell.data.root) / f"{cell.corruption}.npy"
        files["labels"] = Path(cell.data.root) / "labels.npy"
    return files


def fingerprints(cell: Cell) -> dict[str, str]:
    """Role -> content key: a file's sha256, or an image folder's or list's listing (paths and sizes)."""
    out = {}
    for role, path in cell_files(cell).items():
        if path.is_dir() or (role == "source" and is_image_source(path)):
            out[role] = listing_fingerprint(path)
            continue
        if not path.is_file():
            raise FileNotFoundError(f"{role} file of cell {cell.model.name}/{cell.corruption} not found: {path}")
        out[role] = sha256_cached(path)
    if model_file(cell.model) is None:
        out["weights"] = f"pretrained:{cell.model.model}"
    return out


def stats_options(cell: Cell) -> dict[str, Any]:
    """The options that determine the cell's source statistics (read by methods that need statistics)."""
    opts = cell.option_dict
    out = {"K": int(opts.get("K", DEFAULT_K)), "max_samples": int(opts.get("max_samples", DEFAULT_MAX_SAMPLES)),
           "tail_unit": str(opts.get("tail_unit", DEFAULT_TAIL_UNIT))}
    if float(opts.get("balance", 1.0)) < 1:  # class-conditional knots (only then: other cells keep their files)
        out["groups"] = int(opts.get("groups", DEFAULT_GROUPS))
    return out


def stats_path(cell: Cell, cache_dir: str | Path) -> Path:
    """Where the cell's source statistics are cached: keyed by weights, source data and its options."""
    fp = fingerprints(cell)
    key = {"weights": fp.get("weights"), "source": fp["source"], "indices": cell.model.source_indices,
           "model": location_free(cell)["model"]["model"], **stats_options(cell)}
    if cell.model.image_size or cell.model.resize:  # only when set, so older cache files keep their names
        key["preprocess"] = [cell.model.image_size, cell.model.resize]
    digest = hashlib.sha256(canonical_json(key).encode()).hexdigest()[:20]
    return Path(cache_dir) / "stats" / f"{cell.model.name}-K{key['K']}-{digest}.aqr.safetensors"


@functools.lru_cache(maxsize=4)
def load_model(spec: ModelSpec) -> nn.Module:
    """The cell's model (eval mode, [0, 1] inputs); cached per process."""
    from aqr import models

    return models.load(spec.model, checkpoint=spec.checkpoint)


def source_selection(labels: np.ndarray, indices: str | None, n_images: int | None = None, seed: int = 0,
                     where: str = "") -> np.ndarray:
    """Which source images to calibrate on: the ``indices`` pool (see :func:`aqr.bench.grid.parse_range`;
    ``None``: all; ``"balanced~n"``: ``n`` class-balanced at random, seed 0), then, with ``n_images``, that
    many drawn class-balanced at random (``seed``) from the pool. Warns when only some classes are covered."""
    if indices is not None and indices.strip().startswith("balanced~"):
        count = indices.strip().partition("~")[2]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"'balanced~n' needs a positive count, got {indices!r}")
        pool = balanced_subset(labels, int(count), 0)
    else:
        parsed = parse_range(indices)
        pool = np.arange(len(labels)) if parsed is None else np.asarray(parsed, dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"source indices {indices!r} select no image of {where}")
    if pool.min() < 0 or pool.max() >= len(labels):
        raise ValueError(f"source indices {indices!r} exceed the {len(labels)} images of {where}")
    if n_images is not None:
        pool = balanced_subset(labels, n_images, seed, pool)
    classes, picked = len(np.unique(labels)), len(np.unique(labels[pool]))
    if picked < classes and len(pool) >= 10 * classes:
        # Statistics of a few classes are not the source distribution (a class-sorted file read
        # from the start): AQR would then map every test batch onto those classes.
        warnings.warn(f"source images {indices!r} of {where} cover only {picked} of {classes} classes; is the "
                      f"file sorted by class? Draw a class-balanced random subset with --n-images N "
                      f"(or 'balanced~N', or 'start:stop~n', e.g. '0:{len(labels)}~10000')", stacklevel=3)
    return pool


def load_source(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """The clean source images (uint8 NHWC) and labels the statistics are computed on (arrays only)."""
    from aqr.data import load_cifar

    data = load_cifar(spec.source_data)
    idx = source_selection(data.labels, spec.source_indices, where=spec.source_data)
    return np.asarray(data.images[idx]), data.labels[idx]


def model_preprocess(spec: ModelSpec, model: nn.Module) -> Preprocess:
    """How the spec's image files become the model's inputs: the model's preprocessing with the spec's overrides."""
    from aqr import models

    return models.preprocessing(model).with_overrides(spec.image_size, spec.resize)


def source_dataset(spec: ModelSpec, preprocess: Preprocess, n_images: int | None = None,
                   seed: int = 0) -> Subset:
    """The selected clean source images as a dataset: decoded on access from an image folder or list,
    or from CIFAR arrays (used as stored; ``preprocess`` applies to image files)."""
    if is_image_source(spec.source_data):
        data: Any = ImageFolder(spec.source_data, preprocess)
    else:
        from aqr.data import load_cifar

        data = load_cifar(spec.source_data)
    return Subset(data, source_selection(data.labels, spec.source_indices, n_images, seed,
                                         where=spec.source_data).tolist())


def data_loader(dataset: Any, batch_size: int, workers: int = 0, device: torch.device | str | None = None) -> DataLoader:
    """Batches of ``dataset`` in order, decoded by ``workers`` processes (pinned memory for a GPU)."""
    pin = torch.device(device).type == "cuda" if device is not None else False
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=pin,
                      persistent_workers=False, prefetch_factor=4 if workers else None)


def compute_stats(cell: Cell, progress: bool = False, device: str | None = None, loader_workers: int = 0,
                  threads: int | None = None) -> Any:
    """The source statistics a cell needs (:class:`aqr.SourceStats`), computed now on ``device`` with
    ``threads`` torch threads (default: unchanged) and ``loader_workers`` decoding processes."""
    from aqr.core.calibrate import calibrate

    opts = stats_options(cell)
    model = load_model(cell.model)
    if device is not None:
        model.to(device)
    source = source_dataset(cell.model, model_preprocess(cell.model, model))
    with torch_threads(threads):
        return calibrate(model, data_loader(source, 500, loader_workers, device), num_quantiles=opts["K"],
                         max_samples=opts["max_samples"], tail_unit=opts["tail_unit"], progress=progress,
                         groups=opts.get("groups"))


def ensure_stats(cell: Cell, cache_dir: str | Path, progress: bool = False, device: str | None = None,
                 loader_workers: int = 0, threads: int | None = None) -> Path:
    """Compute (once) and cache the source statistics a cell needs; returns the stats file.

    The file is written atomically, so concurrent or interrupted runs never leave half a file.
    """
    path = stats_path(cell, cache_dir)
    if path.is_file():
        return path
    return compute_stats(cell, progress, device, loader_workers, threads).save(path)


@functools.lru_cache(maxsize=4)
def _load_stats(path: str) -> Any:
    from aqr.core.stats import SourceStats

    return SourceStats.load(path)


@functools.lru_cache(maxsize=2)
def _load_eval(root: str, corruption: str, severity: int, indices: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    from aqr.data import load_cifar_c

    ds = load_cifar_c(root, corruption, severity, indices=list(indices))
    return np.asarray(ds.images), ds.labels


def eval_data(cell: Cell) -> tuple[np.ndarray, np.ndarray]:
    """The corrupted images (uint8 NHWC) and labels a cell evaluates, in evaluation order (CIFAR-C arrays)."""
    pool = parse_range(cell.data.eval_indices)
    if pool is None:
        raise ValueError("DataSpec.eval_indices must be set")
    images, labels = _load_eval(cell.data.root, cell.corruption, cell.severity, tuple(eval_indices(cell, pool)))
    positions = stream_positions(cell, labels)
    return (images, labels) if positions is None else (images[positions], labels[positions])


def eval_folder(cell: Cell, preprocess: Preprocess) -> Subset:
    """The images a cell evaluates from an ImageNet-C folder, in evaluation order (pool ``"all"``: every image)."""
    from aqr.data.imagenet_c import ImageNetCFolder

    folder = ImageNetCFolder(cell.data.root, cell.corruption, cell.severity, preprocess=preprocess)
    text = cell.data.eval_indices
    pool = list(range(len(folder))) if text in (None, "", "all") else parse_range(text)
    if max(pool) >= len(folder):
        raise ValueError(f"eval_indices {text!r} exceed the {len(folder)} images of {cell.corruption}/{cell.severity}")
    drawn = eval_indices(cell, pool)
    positions = stream_positions(cell, folder.labels[drawn])
    return Subset(folder, drawn if positions is None else [drawn[i] for i in positions])


def build_method(cell: Cell, cache_dir: str | Path, device: str | None = None, loader_workers: int = 0,
                 stats_file: str | Path | None = None) -> nn.Module:
    """The method of a cell around its (cached) model, given what the method declares it needs.

    ``stats_file``: the cell's source statistics, if the caller has them (else from ``cache_dir``).
    """
    from aqr.methods import create, method_class

    cls = method_class(cell.method)
    model = load_model(cell.model)
    if device is not None:
        model.to(device)
    options = {k: v for k, v in cell.option_dict.items() if k not in STATS_OPTIONS}
    if isinstance(options.get("layers"), tuple):
        options["layers"] = list(options["layers"])
    if cls.needs_batch_size:  # which only the cell knows
        options.setdefault("batch_size", cell.batch_size)
    if cls.needs_stats:
        path = (Path(stats_file) if stats_file is not None
                else ensure_stats(cell, cache_dir, device=device, loader_workers=loader_workers))
        stats = _load_stats(str(path))
        if not stats.computed_with(model):
            # A library user gets a warning; a benchmark cell must not score stale statistics.
            raise StatsError(f"{path} was computed with other weights than {cell.model.model} has now "
                             "(was the checkpoint rewritten during the run?)")
        options["stats"] = stats
    return create(cell.method, model, protocol=cell.protocol, seed=cell.seed, **options)


def needs_stats(cell: Cell) -> bool:
    """Whether the cell's method needs source statistics (``False`` for an unknown method, whose cell fails)."""
    from aqr.methods import METHODS

    cls = METHODS.get(cell.method)
    return cls is not None and cls.needs_stats


def run_cell(cell: Cell, cache_dir: str | Path = "cache", progress: bool = False, device: str | None = None,
             loader_workers: int = 0, *, stats_file: str | Path | None = None,
             threads: int | None = None) -> CellResult:
    """Evaluate one cell (on ``device``; image folders decoded by ``loader_workers`` processes; ``threads``
    torch threads, restored after; ``stats_file``: see :func:`build_method`).
    Never raises for a failing method: errors come back as ``status="error"``."""
    from aqr.methods import NotApplicable

    t0 = time.perf_counter()
    with torch_threads(threads):
        where = {"node": platform.node(), "threads": torch.get_num_threads(), "device": str(device or "cpu")}
        try:
            torch.manual_seed(cell.seed)
            method = build_method(cell, cache_dir, device, loader_workers, stats_file)
            desc = f"{cell.variant} {cell.corruption}-{cell.severity}"
            if stream_corruptions(cell.corruption) is not None:
                return _run_continual(cell, method, progress, desc, t0, where)
            if uses_image_folders(cell.data):
                folder = eval_folder(cell, model_preprocess(cell.model, load_model(cell.model)))
                batches: Iterable[tuple[torch.Tensor, Any]] = data_loader(folder, cell.batch_size, loader_workers,
                                                                          device)
                total = len(batches)  # type: ignore[arg-type]
            else:
                images, labels = eval_data(cell)
                batches, total = array_batches(images, labels, cell.batch_size), -(-len(labels) // cell.batch_size)
            correct = image_correct(method, batches, progress, desc, total)
            return CellResult("ok", 100.0 * float(correct.mean()), int(correct.size), time.perf_counter() - t0,
                              **where, correct=pack_correct(correct))
        except NotApplicable as err:
            return CellResult("n/a", None, None, time.perf_counter() - t0, str(err), **where)
        except Exception as err:  # recorded, so one broken cell doesn't stop a grid
            msg = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"
            return CellResult("error", None, None, time.perf_counter() - t0, msg, **where)


def _run_continual(cell: Cell, method: nn.Module, progress: bool, desc: str, t0: float,
                   where: dict[str, Any]) -> CellResult:
    """A continual cell: the whole stream through ``method``, the per-image results kept."""
    from aqr.bench import continual

    if uses_image_folders(cell.data):
        raise ValueError("continual cells read CIFAR-C arrays; image folders are not supported")
    blocks = continual.stream_blocks(cell)
    images, labels, starts = continual.stream_batches(cell, blocks)
    correct = continual.evaluate_stream(method, images, labels, starts, progress, desc)
    detail = continual.stream_detail(correct, [name for name, _, _ in blocks], len(blocks[0][2]))
    return CellResult("ok", 100.0 * float(correct.mean()), len(correct), time.perf_counter() - t0, **where,
                      detail=detail)


# ----------------------------------------------------------------------------- provenance


@functools.lru_cache(maxsize=1)
def _git_commit(package: Path | None = None) -> str | None:
    """The checkout's commit, with ``-dirty`` when the files of ``package`` (default: aqr's own folder)
    differ from it; other tracked files, such as a results database committed beside the docs and
    updated by the run itself, do not count."""
    package = package or Path(__file__).resolve().parents[1]  # git finds the checkout from any folder inside it
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(cell: Cell, files: dict[str, str], key: str, result: CellResult | None = None,
               executor: str = "local", run: str | None = None) -> dict[str, Any]:
    """Everything needed to trust and reproduce a row: versions, commit, hashes, seed, protocol.

    ``host`` is where the grid's driver ran; ``node``, ``threads`` and ``device`` where and how the
    cell ran (from its ``result``), ``executor`` what ran it and ``run`` which driver.
    """
    from aqr._version import __version__

    result = result or CellResult("ok")
    order = "numpy default_rng(seed).permutation(pool)[:n_images]"
    streamed = stream_corruptions(cell.corruption)
    if streamed is not None:
        order += f", the same images for each of {len(streamed)} corruptions in turn ({'+'.join(streamed)}), no reset"
    if cell.order is not None:
        order += f", then stream order {cell.order!r} (aqr.data.streams, seed {cell.seed})"
    return {
        "aqr": __version__, "torch": torch.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "git_commit": _git_commit(), "host": platform.node(),
        "machine": platform.machine(), "executor": executor, "run": run, "node": result.node,
        "threads": result.threads, "device": result.device, "config_hash": key,
        "files": files, "seed": cell.seed, "protocol": cell.protocol,
        "source": {"data": cell.model.source_data, "indices": cell.model.source_indices},
        "eval": {"data": cell.data.root, "pool": cell.data.eval_indices, "n_images": cell.n_images,
                 "order": order},
    }


# ----------------------------------------------------------------------------- the grid


@dataclass
class GridSummary:
    """What a :func:`run_grid` call did (``by_others``: cells another run on the database finished meanwhile)."""

    total: int = 0
    skipped: int = 0
    ran: int = 0
    errors: int = 0
    not_applicable: int = 0
    by_others: int = 0
    wall_s: float = 0.0
    error_messages: list[str] = field(default_factory=list)


def ensure_data(data: DataSpec, corruptions: Sequence[str], progress: bool = True, workers: int = 1,
                severities: Sequence[int] = (1, 2, 3, 4, 5)) -> None:
    """Generate the corruptions missing from ``data.root`` when ``data.clean`` says how; else explain."""
    root = Path(data.root)
    if uses_image_folders(data):
        _ensure_folders(data, corruptions, severities, progress, workers)
        return
    missing = [c for c in corruptions if not (root / f"{c}.npy").is_file()]
    if not missing and (root / "labels.npy").is_file():
        return
    if not data.clean:
        raise FileNotFoundError(f"{root}: missing {', '.join(missing) or 'labels.npy'}; generate them with "
                                f"`aqr corrupt --data <clean test .npz> --out {root}`")
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c
    from aqr.data import load_npz_arrays

    images, labels = load_npz_arrays(data.clean)
    frost = data.frost_dir if "frost" in missing else None
    config = GenerationConfig(corruptions=tuple(missing), workers=workers, frost_dir=frost,
                              source={"path": data.clean})
    generate_cifar_c(images, labels, root, config, progress=progress)


def _ensure_folders(data: DataSpec, corruptions: Sequence[str], severities: Sequence[int], progress: bool,
                    workers: int) -> None:
    """ImageNet-C layout: write the missing (corruption, severity) folders from ``data.clean``, or explain."""
    root = Path(data.root)
    missing = [f"{c}/{s}" for c in corruptions for s in severities if not (root / c / str(s)).is_dir()]
    if not data.clean:
        if missing:
            raise FileNotFoundError(f"{root}: missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                                    f"generate them with `aqr corrupt --data <ImageNet val folder> --params imagenet "
                                    f"--out {root}` or point the grid at the released ImageNet-C")
        return
    from aqr.data.imagenet_c import FolderGenerationConfig, generate_imagenet_c

    config = FolderGenerationConfig(corruptions=tuple(corruptions), severities=tuple(severities), workers=workers,
                                    frost_dir=data.frost_dir if "frost" in corruptions else None,
                                    source={"listing": listing_fingerprint(data.clean)})
    generate_imagenet_c(ImageFolder(data.clean), root, config, progress=progress)


def keyed_cells(grid: GridSpec) -> list[tuple[str, Cell, dict[str, str]]]:
    """Every cell of ``grid`` with its results-database key and its files' content hashes.

    The files must exist (run :func:`ensure_data` first for generated corruptions).
    """
    keyed = []
    for cell in grid.cells():
        fp = fingerprints(cell)
        keyed.append((cell_key(cell, fp, _version()), cell, fp))
    return keyed


def adopt_legacy_rows(db: ResultsDB, keyed: Sequence[tuple[str, Cell, dict[str, str]]]) -> int:
    """Rekey the finished rows stored under :func:`aqr.bench.grid.legacy_cell_key` (keys with file
    locations) to today's keys, so a database from before keys were location-free is reused; returns
    how many. A legacy key matches only a row computed under today's versions and files.
    """
    missing = {key: (cell, fp) for key, cell, fp in keyed}
    missing = {k: v for k, v in missing.items() if k not in db.finished(missing)}
    legacy = {legacy_cell_key(cell, fp, _version()): key for key, (cell, fp) in missing.items()}
    found = db.finished(legacy)
    for old in found:
        db.rekey(old, legacy[old])
    return len(found)


def clear_caches() -> None:
    """Forget the models, statistics and evaluation images cached in this process.

    Needed only when files the cells read were rewritten in place since they were cached (file
    hashes are memoised by size and mtime and refresh themselves).
    """
    load_model.cache_clear()
    _load_stats.cache_clear()
    _load_eval.cache_clear()


def make_executor(executor: str, cache_dir: str | Path, settings: CellSettings, workers: int = 1,
                  ray: RayOptions | None = None, progress: bool = True,
                  log: Callable[[str], None] = print) -> CellExecutor:
    """The executor named ``executor``: ``"local"`` (``workers`` processes) or ``"ray"`` (``ray`` options)."""
    if executor == "local":
        from aqr.bench.executors import LocalExecutor

        return LocalExecutor(cache_dir, settings, workers=workers, progress=progress, log=log)
    if executor == "ray":
        from aqr.bench.ray_executor import RayExecutor, RayOptions

        return RayExecutor(cache_dir, ray or RayOptions(), settings, progress=progress, log=log)
    raise ValueError(f"unknown executor {executor!r}; expected 'local' or 'ray'")


def run_grid(grid: GridSpec, db: ResultsDB, cache_dir: str | Path = "cache", workers: int = 1,
             threads: int | None = None, progress: bool = True, limit: int | None = None,
             log: Callable[[str], None] = print, device: str | None = None, loader_workers: int = 0,
             executor: str = "local", ray: RayOptions | None = None, lease_s: float = 120.0) -> GridSummary:
    """Run every cell of ``grid`` not already in ``db``; each result is committed as it arrives.

    ``executor="local"`` runs cells in this process, or in ``workers`` processes; ``"ray"`` runs
    each cell as a Ray task (see :class:`aqr.bench.ray_executor.RayOptions`). Either way a cell uses
    ``threads`` torch threads (set inside it), its model runs on ``device`` (default CPU; under Ray,
    CUDA when cells get GPUs), image folders are decoded by ``loader_workers`` processes, and this
    process alone writes the database. Cells are claimed in ``db`` before they start (``lease_s``,
    see :mod:`aqr.bench.claims`), so runs sharing a database divide the cells. ``limit`` stops
    after that many new cells (smoke tests).
    """
    from aqr.bench.claims import Claims
    from aqr.bench.executors import CellSettings

    for name, value, least in (("workers", workers, 1), ("threads", threads, 1), ("limit", limit, 1),
                               ("loader_workers", loader_workers, 0)):
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    t0 = time.perf_counter()
    summary = GridSummary()
    ensure_data(grid.data, data_corruptions(grid.corruptions), progress=progress, severities=grid.severities)
    keyed = keyed_cells(grid)
    summary.total = len(keyed)
    db.add_membership(grid.name, [k for k, _, _ in keyed])
    adopted = adopt_legacy_rows(db, keyed)
    if adopted:
        log(f"{adopted} rows stored under keys with file locations now have location-free keys")
    done = db.finished(k for k, _, _ in keyed)
    todo = [item for item in keyed if item[0] not in done]
    summary.skipped = len(keyed) - len(todo)
    if limit is not None:
        todo = todo[:limit]
    log(f"grid {grid.name!r}: {len(keyed)} cells, {summary.skipped} already in {db.path}, {len(todo)} to run")
    if not todo:
        summary.wall_s = time.perf_counter() - t0
        return summary

    settings = CellSettings(threads=threads, device=device, loader_workers=loader_workers)
    runner = make_executor(executor, cache_dir, settings, workers, ray, progress, log)
    try:
        with Claims(db.path, lease_s) as claims:
            stats = _prepare(runner, todo, cache_dir)
            _drive(runner, claims, todo, stats, db, grid.name, summary, progress)
    finally:
        runner.close()
    summary.wall_s = time.perf_counter() - t0
    return summary


def _prepare(runner: CellExecutor, todo: Sequence[tuple[str, Cell, dict[str, str]]],
             cache_dir: str | Path) -> dict[str, Any]:
    """Check the cells' files where they will run and prepare the statistics once per file.

    Returns cell key -> the executor's handle on the cell's statistics (for cells that need them).
    """
    files = {path for _, cell, _ in todo for path in cell_files(cell).values()}
    runner.check_files({path: -1 if path.is_dir() else path.stat().st_size for path in files})
    needed: dict[Path, Cell] = {}
    of_key: dict[str, Path] = {}
    for key, cell, _ in todo:
        if needs_stats(cell):
            of_key[key] = stats_path(cell, cache_dir)
            needed.setdefault(of_key[key], cell)
    handles = runner.prepare_stats(needed)
    return {key: handles[path] for key, path in of_key.items()}


def _drive(runner: CellExecutor, claims: Claims, todo: Sequence[tuple[str, Cell, dict[str, str]]],
           stats: dict[str, Any], db: ResultsDB, name: str, summary: GridSummary, progress: bool) -> None:
    """Claim, submit and record cells until each of ``todo`` has a row (from this run or another)."""
    from tqdm.auto import tqdm

    from aqr.bench.claims import BUSY, CLAIMED

    poll_s = min(5.0, claims.lease_s / 6)
    queue = collections.deque(todo)
    waiting: list[tuple[str, Cell, dict[str, str]]] = []   # claimed by other runs: checked again later
    in_flight: dict[Any, tuple[str, Cell, dict[str, str]]] = {}
    last_check = time.monotonic()
    bar = tqdm(total=len(todo), desc=name, unit="cell", disable=not progress, dynamic_ncols=True)
    try:
        while queue or waiting or in_flight:
            if waiting and time.monotonic() - last_check >= poll_s:
                queue.extend(waiting)
                waiting.clear()
                last_check = time.monotonic()
            while queue and len(in_flight) < runner.capacity():
                item = queue.popleft()
                state = claims.claim(item[0])
                if state == CLAIMED:
                    in_flight[runner.submit(item[1], stats.get(item[0]))] = item
                elif state == BUSY:
                    waiting.append(item)
                else:
                    summary.by_others += 1
                    bar.update(1)
            if in_flight:
                for handle, result in runner.wait(list(in_flight), poll_s):
                    key, cell, fp = in_flight.pop(handle)
                    db.add(key, cell.to_dict(), result.status, result.accuracy, result.n_images, result.wall_s,
                           provenance(cell, fp, key, result, runner.name, claims.owner), result.message,
                           result.detail, result.correct)
                    claims.release(key)
                    _count(summary, cell, result)
                    acc = "n/a" if result.accuracy is None else f"{result.accuracy:.2f}"
                    bar.set_postfix_str(f"{cell.model.name} {cell.variant} {cell.corruption}-{cell.severity} "
                                        f"b{cell.batch_size}: {acc}", refresh=False)
                    bar.update(1)
            elif waiting:
                time.sleep(max(0.0, poll_s - (time.monotonic() - last_check)))
    finally:
        bar.close()


def _count(summary: GridSummary, cell: Cell, result: CellResult) -> None:
    summary.ran += 1
    if result.status == "error":
        summary.errors += 1
        first = (result.message or "").splitlines()[0] if result.message else ""
        summary.error_messages.append(f"{cell.model.name} {cell.variant} {cell.corruption}-{cell.severity} "
                                      f"b{cell.batch_size} s{cell.seed}: {first}")
    elif result.status == "n/a":
        summary.not_applicable += 1


def _version() -> str:
    from aqr._version import __version__

    return __version__


def describe_cells(grid: GridSpec) -> Iterable[str]:
    """One line per cell (for ``--dry-run``)."""
    for cell in grid.cells():
        yield (f"{cell.model.name}\t{cell.variant}\t{cell.corruption}\t{cell.severity}\t{cell.batch_size}\t"
               f"{cell.order or '-'}\t{cell.seed}\t{cell.n_images}")


def result_json(summary: GridSummary) -> str:
    return json.dumps(summary.__dict__, indent=2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `aqr bench`")
