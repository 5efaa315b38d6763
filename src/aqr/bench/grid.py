"""The benchmark grid: what one cell is, how a grid expands into cells, and the paper's presets.

A :class:`Cell` is plain data (JSON-able, frozen): the model and its source data, the evaluation data
and protocol, one method with its options, one corruption, severity, batch size and seed. Running a
cell is a pure function of it (:func:`aqr.bench.runner.run_cell`), so cells can run in any order, in any
process or on any machine; :func:`cell_key` names a cell's result in the results database.

A :class:`GridSpec` is the cross product models x methods x corruptions x severities x batch sizes x
stream orders x seeds, from a preset (:func:`preset`), a YAML/JSON file (:func:`load_grid`) or Python.

A cell's images come in a seeded random order unless it names a stream order (``Cell.order``, the
text of a :class:`aqr.data.streams.StreamOrder`, e.g. ``"delta=0.1"``): then the same images are put
in that order, class-correlated, with the cell's seed; the order is part of the cell's key.

A *continual* cell (corruption ``"continual"``, or ``"continual:fog+contrast+..."`` for another
sequence; :func:`stream_corruptions`) is one whole stream: for each corruption in turn, a block of
the same ``n_images`` drawn images, one block after the other, evaluated without a reset (the
``stream`` preset, issue 15). Its result keeps whether each image was classified right, in stream
order, for the accuracy along the stream.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from aqr.data.corruption_params import CORRUPTIONS
from aqr.data.location import DataDirError, resolve_data_dir
from aqr.data.streams import StreamOrder

# Bump when the meaning of a cell's result changes (evaluation loop, image selection, metrics), so
# rows computed under the old rules are never reused for a new run.
PROTOCOL_VERSION = 1
# Part of AQR cells' keys only: bump when AQR's default source statistics change.
# 1: Average Sample Tails over 100 activation values; 2: over 100 images (tail_unit="images").
AQR_STATS_VERSION = 2
# Part of AQR cells' keys only: bump when the default fast path changes its results.
# 1: p0/p100 and inner knots from the sample (numpy sort); 2: p0/p100 from every value, inner knots
# from the sample's histogram (aqr.backends.native), 2026-11-26; 3: the tie rule in fast mode (marked
# table cells map exactly) and ranges in float64 (issue 14); 4: the sample grows with the batch
# (samples_per_row=64 beyond target_samples; unchanged up to 128 images of 32 x 32), issue 18.
AQR_FAST_PATH_VERSION = 4
# Part of the keys of cells with a stream order only: bump when aqr.data.streams orders images differently.
STREAM_ORDER_VERSION = 1

PRESETS = ("main", "tails", "granularity", "vit-blocks", "smoke", "imagenet", "stream", "stream-noniid")
# A continual cell's corruption: the 15 benchmark corruptions in the order of the test-time-adaptation
# benchmark repository (gaussian noise first), or "continual:<name>+<name>+..." for another sequence.
CONTINUAL = "continual"
CONTINUAL_ORDER: tuple[str, ...] = CORRUPTIONS[:15]
# ModelSpec fields added after results were recorded: absent from a cell's dict while None
OPTIONAL_MODEL_FIELDS = ("image_size", "resize")
# Cell fields added after results were recorded: absent from a cell's dict while None
OPTIONAL_CELL_FIELDS = ("order",)
TAIL_NAMES = ("standard", "average", "none", "clip", "clip-source", "interval", "gaussian")
# Method options that change the source statistics (not the adaptation): they key the stats cache.
STATS_OPTIONS = ("K", "max_samples", "tail_unit")


def parse_range(text: str | Sequence[int] | None) -> list[int] | None:
    """Index selection -> sorted-or-given list of ints.

    ``"0:5000"`` (a Python slice, stop exclusive), ``"1,5,9"``, a list of ints, or
    ``"0:50000~10000"``: 10,000 indices drawn without replacement from ``0:50000`` with
    ``numpy.random.default_rng(0)``, returned sorted. Use the last form whenever the data may be
    ordered by class (the JPEG CIFAR-10 training set is: its first 10,000 images are two classes).
    """
    if text is None:
        return None
    if not isinstance(text, str):
        return [int(i) for i in text]
    text = text.strip()
    span, tilde, count = text.partition("~")
    if ":" in span:
        parts = span.split(":")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"index range must look like 'start:stop' or 'start:stop~n', got {text!r}")
        start, stop = (int(p) for p in parts)
        if not 0 <= start < stop:
            raise ValueError(f"index range {text!r} is empty or negative")
        if not tilde:
            return list(range(start, stop))
        if not count.strip().isdigit() or not 0 < int(count) <= stop - start:
            raise ValueError(f"'~n' in {text!r} must be a count between 1 and {stop - start}")
        import numpy as np

        drawn = np.random.default_rng(0).choice(stop - start, int(count), replace=False)
        return sorted(int(i) + start for i in drawn)
    if tilde:
        raise ValueError(f"'~n' needs a 'start:stop' range before it, got {text!r}")
    try:
        picked = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"indices must be 'start:stop' or comma-separated integers, got {text!r}") from None
    if any(i < 0 for i in picked):  # Python would count them from the end
        raise ValueError(f"indices must not be negative, got {text!r}")
    return picked


@dataclass(frozen=True)
class ModelSpec:
    """A model and the clean data its source statistics come from.

    Attributes:
        name: label used in tables and figures.
        model: first argument of :func:`aqr.models.load` (zoo name, aqr checkpoint, architecture).
        checkpoint: third-party weights for an architecture name (e.g. the akamaster ResNet-20).
        source_data: clean images for the source statistics: CIFAR ``.npz`` or pickle folder, an
            image folder (``<dir>/<class>/*.JPEG``) or a text file listing image paths.
        source_indices: which of them (see :func:`parse_range`); the paper uses 10,000 training
            images: ``"0:50000~10000"`` draws them at random (seeded) from the whole training set,
            ``"balanced~10000"`` draws them class-balanced from all images.
        image_size, resize: override the model's preprocessing of image files (crop size, shorter
            side before the crop); ``None`` keeps the model's (see :func:`aqr.models.preprocessing`).
    """

    name: str
    model: str
    checkpoint: str | None = None
    source_data: str = ""
    source_indices: str = "0:10000"
    image_size: int | None = None
    resize: int | None = None


@dataclass(frozen=True)
class DataSpec:
    """Corrupted evaluation data: a CIFAR-C folder and which test images are evaluated.

    ``eval_indices`` is the pool a cell draws its images from (seeded; see :func:`eval_indices`).
    ``clean``/``frost_dir``: if set, missing corruptions are generated from this clean ``.npz``
    (``aqr corrupt`` semantics, seed 0) before the grid runs.
    """

    name: str = "cifar10-c"
    root: str = "cache/cifar10c"
    eval_indices: str = "5000:10000"
    clean: str | None = None
    frost_dir: str | None = None


@dataclass(frozen=True)
class Cell:
    """One result: a model, a method with options, one corruption/severity/batch size/seed.

    ``order``: ``None`` evaluates the drawn images in their seeded random order; otherwise the
    canonical text of a :class:`~aqr.data.streams.StreamOrder` (see :func:`canonical_order`) that
    reorders them with the cell's seed.
    """

    model: ModelSpec
    data: DataSpec
    method: str
    options: tuple[tuple[str, Any], ...]
    corruption: str
    severity: int
    batch_size: int
    seed: int
    n_images: int | None
    protocol: str = "episodic"
    order: str | None = None

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def variant(self) -> str:
        """``method`` or ``method[key=value,...]``: how the method is labelled in tables."""
        if not self.options:
            return self.method
        return f"{self.method}[{','.join(f'{k}={_fmt(v)}' for k, v in self.options)}]"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["options"] = dict(self.options)
        for key in OPTIONAL_MODEL_FIELDS:  # unset, they are left out: keys of older cells stay the same
            if d["model"][key] is None:
                del d["model"][key]
        for key in OPTIONAL_CELL_FIELDS:
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Cell":
        d = dict(d)
        d["model"] = ModelSpec(**d["model"])
        d["data"] = DataSpec(**d["data"])
        d["options"] = _freeze_options(d.get("options") or {})
        return cls(**d)


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(str(v) for v in value)
    return str(value)


def _freeze_options(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    frozen = []
    for key in sorted(options):
        value = options[key]
        if isinstance(value, list):
            value = tuple(value)
        frozen.append((key, value))
    return tuple(frozen)


def stream_corruptions(corruption: str) -> tuple[str, ...] | None:
    """The corruptions a continual cell streams through, in order (see the module docs); ``None`` for a
    cell of one corruption. ``ValueError`` for a sequence naming an unknown corruption."""
    if corruption == CONTINUAL:
        return CONTINUAL_ORDER
    if not corruption.startswith(CONTINUAL + ":"):
        return None
    names = tuple(n.strip() for n in corruption[len(CONTINUAL) + 1 :].split("+") if n.strip())
    unknown = [n for n in names if n not in CORRUPTIONS]
    if not names or unknown:
        raise ValueError(f"continual stream {corruption!r} must list known corruptions joined by '+'; "
                         f"unknown: {unknown or 'none given'}")
    return names


def data_corruptions(corruptions: Sequence[str]) -> tuple[str, ...]:
    """The corruption files a list of cell corruptions reads (continual streams expanded), each once."""
    return tuple(dict.fromkeys(c for name in corruptions for c in (stream_corruptions(name) or (name,))))


def canonical_order(order: "str | StreamOrder | None") -> str | None:
    """The canonical text of a stream order (``"delta=0.10"`` -> ``"delta=0.1"``), ``None`` for none;
    ``ValueError`` for text that names no order."""
    return None if order is None else str(StreamOrder.parse(order))


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def location_free(cell: Cell) -> dict[str, Any]:
    """The cell as a dict without where its files live: each path is replaced by the role it plays.

    The files enter a key by their content hashes, so nodes (or users) that mount the same data at
    different paths compute the same keys. Generation inputs (``clean``, ``frost_dir``) drop out:
    the generated files' hashes stand for them.
    """
    d = cell.to_dict()
    model, data = d["model"], d["data"]
    if model["checkpoint"] is not None:
        model["checkpoint"] = "<weights file>"
    elif Path(model["model"]).is_file():  # an aqr checkpoint given by path (else a zoo or hub name)
        model["model"] = "<weights file>"
    model["source_data"] = "<source file>"
    data.update(root="<data folder>", clean=None, frost_dir=None)
    return d


def cell_key(cell: Cell, fingerprints: Mapping[str, str], version: str) -> str:
    """Stable id of a cell's result: its config, the content hashes of its files and the code version.

    ``fingerprints`` maps each of the cell's files (checkpoint, source data, evaluation data) to its
    sha256, so regenerated data or retrained weights never reuse old rows; where the files live
    does not count (:func:`location_free`).
    """
    return _key(location_free(cell), cell.method, fingerprints, version)


def legacy_cell_key(cell: Cell, fingerprints: Mapping[str, str], version: str) -> str:
    """The key aqr gave a cell before keys were location-free (file paths included), for old databases."""
    return _key(cell.to_dict(), cell.method, fingerprints, version)


def _key(config: Mapping[str, Any], method: str, fingerprints: Mapping[str, str], version: str) -> str:
    payload = {
        "cell": config,
        "files": dict(sorted(fingerprints.items())),
        "aqr": version,
        "protocol_version": PROTOCOL_VERSION,
    }
    if config.get("order") is not None:
        payload["stream_order_version"] = STREAM_ORDER_VERSION
    if method in ("aqr", "moments"):  # both read the source statistics
        payload["aqr_stats_version"] = AQR_STATS_VERSION
    if method == "aqr":
        payload["aqr_fast_path_version"] = AQR_FAST_PATH_VERSION
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class MethodSpec:
    """A method and its options, e.g. ``MethodSpec("aqr", {"tail": "gaussian", "K": 11})``."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any]) -> "MethodSpec":
        """``"tent"``, ``"aqr:tail=clip,K=11"`` or ``{"method": "aqr", "tail": "clip"}``."""
        if isinstance(entry, Mapping):
            entry = dict(entry)
            if "method" not in entry:
                raise ValueError(f"method entry needs a 'method' key, got {entry}")
            name = entry.pop("method")
            return cls(str(name), entry)
        name, _, rest = str(entry).partition(":")
        options: dict[str, Any] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"method option must be key=value, got {part!r} in {entry!r}")
            options[key.strip()] = _parse_scalar(value.strip())
        return cls(name.strip(), options)


def _parse_scalar(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


@dataclass(frozen=True)
class GridSpec:
    """A grid of cells: the cross product of its lists."""

    name: str
    models: tuple[ModelSpec, ...]
    data: DataSpec
    methods: tuple[MethodSpec, ...]
    corruptions: tuple[str, ...] = CORRUPTIONS
    severities: tuple[int, ...] = (1, 3, 5)
    batch_sizes: tuple[int, ...] = (128, 512)
    seeds: tuple[int, ...] = (0, 1, 2)
    n_images: int | None = 2000
    protocol: str = "episodic"
    orders: tuple[str | None, ...] = (None,)  # stream orders (None: the drawn images' seeded random order)

    def __post_init__(self) -> None:
        if isinstance(self.orders, (str, StreamOrder)) or not self.orders:
            raise ValueError(f"orders must be a non-empty sequence of stream orders (None for none), got {self.orders!r}")
        orders = tuple(canonical_order(o) for o in self.orders)
        if len(set(orders)) != len(orders):
            raise ValueError(f"stream orders must be distinct, got {list(self.orders)}")
        object.__setattr__(self, "orders", orders)
        unknown = [c for c in data_corruptions(self.corruptions) if c not in CORRUPTIONS]
        if unknown:
            raise ValueError(f"unknown corruptions {unknown}; expected names from {', '.join(CORRUPTIONS)} "
                             f"or {CONTINUAL!r}")
        bad = [s for s in self.severities if not 1 <= int(s) <= 5]
        if bad:
            raise ValueError(f"severities must lie in 1..5, got {bad}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.n_images is not None and self.n_images < 1:
            raise ValueError(f"n_images must be positive, got {self.n_images}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")

    def cells(self) -> Iterator[Cell]:
        """Every cell, model-major (so a model's statistics and weights are reused back to back)."""
        for model in self.models:
            for corruption in self.corruptions:
                for severity in self.severities:
                    for batch_size in self.batch_sizes:
                        for order in self.orders:
                            for seed in self.seeds:
                                for method in self.methods:
                                    yield Cell(model, self.data, method.name, _freeze_options(method.options),
                                               corruption, int(severity), int(batch_size), int(seed),
                                               self.n_images, self.protocol, order)

    def __len__(self) -> int:
        return (len(self.models) * len(self.methods) * len(self.corruptions) * len(self.severities)
                * len(self.batch_sizes) * len(self.orders) * len(self.seeds))

    def override(self, **changes: Any) -> "GridSpec":
        """A copy with some fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# ----------------------------------------------------------------------------- presets


def default_models(data_dir: str | Path | None = None) -> dict[str, ModelSpec]:
    """The reproduction's models: the akamaster ResNet-20 (BN), twice, and the zoo's BN and GN ResNet-20 and ViT.

    ``data_dir`` is the data folder (default ``$AQR_DATA_DIR``, see :func:`aqr.data.resolve_data_dir`).
    The zoo's models were trained on the JPEG training set, their source domain: their statistics
    come from 10,000 of those images, as in the paper, drawn at random (the file is sorted by class,
    so its first 10,000 images would be airplanes and automobiles only). The akamaster model was
    trained on the lossless training set, which we lack: ``resnet20`` takes its statistics from clean
    test images 0-4999 (evaluation uses 5000-9999; the first reproduction's choice), and
    ``resnet20_trainstats`` from the same 10,000 JPEG training images as the zoo's models, the
    nearest we have to its source domain.
    """
    d = resolve_data_dir(data_dir)
    train = str(d / "cifar10_train_jpeg75.npz")
    akamaster = str(d / "checkpoints/akamaster/resnet20-12fca82f.th")
    return {
        "resnet20": ModelSpec("resnet20", "resnet20", akamaster, str(d / "cifar10_test.npz"), "0:5000"),
        "resnet20_trainstats": ModelSpec("resnet20_trainstats", "resnet20", akamaster, train, "0:50000~10000"),
        "resnet20_bn": ModelSpec("resnet20_bn", "resnet20_bn", None, train, "0:50000~10000"),
        "resnet20_gn": ModelSpec("resnet20_gn", "resnet20_gn", None, train, "0:50000~10000"),
        "vit_ln": ModelSpec("vit_ln", "vit_ln", None, train, "0:50000~10000"),
    }


def default_data(data_dir: str | Path | None = None, cifar_c: str | Path = "cache/cifar10c") -> DataSpec:
    """CIFAR-10-C in ``cifar_c``, generated when missing from the clean test set and frost images of the data folder."""
    d = resolve_data_dir(data_dir)
    return DataSpec("cifar10-c", str(cifar_c), "5000:10000", clean=str(d / "cifar10_test.npz"),
                    frost_dir=str(d / "frost"))


BASELINES = ("source", "ttn", "tent", "sar", "moments", "aqr")
# The stream preset's methods: per-batch AQR (the reference at batch 128), streaming AQR, and the
# methods used on streams, all online.
STREAM_METHODS = ("source", "ttn", "bn-ema", "tent", "sar", "aqr", "aqr:target=stream")
# The stream-noniid preset (issue 16): the stream preset's stream in these orders, i.i.d. first, then ever
# longer runs of one class, then all corruptions mixed; its methods add rbn and AQR's robust variant, balanced
# and with its class-conditional source knots (balance=0.5: statistics calibrated with groups).
NONIID_ORDERS = ("iid", "delta=1", "delta=0.1", "delta=0.01", "mixed")
NONIID_METHODS = ("source", "ttn", "bn-ema", "rbn", "tent", "aqr", "aqr:target=stream", "aqr:target=robust",
                  "aqr:target=robust,balance=0.5")


def imagenet_models(imagenet_dir: str | Path) -> dict[str, ModelSpec]:
    """The paper's ImageNet models as timm names, with 10,000 class-balanced training images as source.

    ResNet-50 (BN) has torchvision's original weights (the paper's "PyTorch model zoo" model),
    ResNet-50 (GN) timm's, ViT-B/16 is pre-trained on ImageNet-21k and fine-tuned on ImageNet-1k.
    """
    train = str(Path(imagenet_dir) / "train")
    return {
        "resnet50_bn": ModelSpec("resnet50_bn", "timm:resnet50.tv_in1k", None, train, "balanced~10000"),
        "resnet50_gn": ModelSpec("resnet50_gn", "timm:resnet50_gn.a1h_in1k", None, train, "balanced~10000"),
        "vit_b16": ModelSpec("vit_b16", "timm:vit_base_patch16_224.augreg2_in21k_ft_in1k", None, train,
                             "balanced~10000"),
    }


def imagenet_data(imagenet_dir: str | Path, imagenet_c: str | Path | None = None) -> DataSpec:
    """ImageNet-C (released, or written by ``aqr corrupt`` from ``<imagenet_dir>/val``), every image a pool."""
    root = Path(imagenet_c) if imagenet_c is not None else Path(imagenet_dir) / "imagenet-c"
    return DataSpec("imagenet-c", str(root), "all")


def preset(name: str, data_dir: str | Path | None = None, cifar_c: str | Path = "cache/cifar10c",
           imagenet_dir: str | Path | None = None, imagenet_c: str | Path | None = None) -> GridSpec:
    """The paper's experiments on our data (see the module docs of each field in :class:`GridSpec`).

    ``data_dir``: the data folder (default ``$AQR_DATA_DIR``); ``cifar_c``: the CIFAR-10-C folder;
    ``imagenet_dir``: ImageNet with ``train/`` (default ``<data_dir>/imagenet``); ``imagenet_c``: ImageNet-C
    (default ``<imagenet_dir>/imagenet-c``).

    ``main``: Tables 1 and 4-6; ``tails``: Table 2 (tail strategies, batch 128/512); ``granularity``:
    Table 3 (K = 11 vs 101); ``vit-blocks``: AQR on all / top-half / bottom-half ViT layers;
    ``smoke``: every method on ResNet-20, two corruptions, one severity, 256 images (about a minute);
    ``imagenet``: Table 1's ImageNet-C setting (ResNet-50 BN and GN, ViT-B/16 from timm; severities
    1, 3, 5; batch 64; 5,000 of the 50,000 images per cell; see docs/imagenet.md for its cost);
    ``stream``: continual CIFAR-10-C (issue 15): each cell one stream of the 15 corruptions at severity 5
    in the continual order, blocks of ``n_images`` (2,000) test images, online (no reset), batch sizes
    1, 4, 16, 64 and 128, for :data:`STREAM_METHODS` (see docs/results/stream for its cost);
    ``stream-noniid``: that stream in each of :data:`NONIID_ORDERS` (issue 16), blocks of 1,000 images,
    batch sizes 16 and 64, seed 0, for :data:`NONIID_METHODS` (see docs/benchmark.md for its cost).
    """
    methods = tuple(MethodSpec(m) for m in BASELINES)
    if name == "imagenet":
        root = Path(imagenet_dir) if imagenet_dir is not None else resolve_data_dir(data_dir) / "imagenet"
        return GridSpec("imagenet", tuple(imagenet_models(root).values()), imagenet_data(root, imagenet_c), methods,
                        severities=(1, 3, 5), batch_sizes=(64,), seeds=(0,), n_images=5000)
    models = default_models(data_dir)
    data = default_data(data_dir, cifar_c)
    if name == "main":
        return GridSpec("main", tuple(models[n] for n in ("resnet20", "resnet20_bn", "resnet20_gn", "vit_ln")), data,
                        methods)
    if name == "tails":
        return GridSpec("tails", (models["resnet20"],), data,
                        tuple(MethodSpec("aqr", {"tail": t}) for t in TAIL_NAMES)
                        # the other reading of the paper's "batch of 100": 100 values, not 100 images
                        + (MethodSpec("aqr", {"tail": "average", "tail_unit": "values"}),), severities=(3, 5))
    if name == "granularity":
        return GridSpec("granularity", (models["resnet20"],), data,
                        tuple(MethodSpec("aqr", {"K": k}) for k in (11, 101)), severities=(3, 5))
    if name == "vit-blocks":
        return GridSpec("vit-blocks", (models["vit_ln"],), data,
                        tuple(MethodSpec("aqr", {"layers": s}) for s in ("all", "top-half", "bottom-half")),
                        severities=(3, 5))
    if name == "stream":
        return GridSpec("stream", tuple(models[n] for n in ("resnet20", "resnet20_gn", "vit_ln")), data, tuple(MethodSpec.parse(m) for m in STREAM_METHODS),
                        corruptions=(CONTINUAL,), severities=(5,), batch_sizes=(1, 4, 16, 64, 128), seeds=(0,),
                        n_images=2000, protocol="online")
    if name == "stream-noniid":
        return GridSpec("stream-noniid", tuple(models[n] for n in ("resnet20", "resnet20_gn", "vit_ln")), data,
                        tuple(MethodSpec.parse(m) for m in NONIID_METHODS), corruptions=(CONTINUAL,), severities=(5,),
                        batch_sizes=(16, 64), seeds=(0,), n_images=1000, protocol="online", orders=NONIID_ORDERS)
    if name == "smoke":
        smoke_data = replace(data, root=str(Path(cifar_c).parent / "cifar10c-smoke"))
        return GridSpec("smoke", (models["resnet20"],), smoke_data, methods,
                        corruptions=("gaussian_noise", "defocus_blur"), severities=(5,), batch_sizes=(128,),
                        seeds=(0,), n_images=256)
    raise KeyError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")


def grid_from_mapping(spec: Mapping[str, Any], data_dir: str | Path | None = None,
                      cifar_c: str | Path = "cache/cifar10c") -> GridSpec:
    """Build a grid from a parsed YAML/JSON mapping.

    Keys: ``name``, ``preset`` (start from a preset and override the rest), ``models`` (names of
    :func:`default_models` or mappings with :class:`ModelSpec` fields), ``data`` (a mapping with
    :class:`DataSpec` fields), ``methods`` (``"tent"``, ``"aqr:tail=clip"`` or mappings with a
    ``method`` key), ``corruptions`` (``"all"`` or a list), ``severities``, ``batch_sizes``,
    ``seeds``, ``n_images``, ``protocol``, ``orders`` (a list of stream orders such as ``"delta=0.1"``,
    ``null`` for none) or ``order`` (one of them).

    Defaults come from the preset (``main`` when none is named), which reads the data folder
    (``data_dir`` or ``$AQR_DATA_DIR``). A grid that names no preset and lists only its own models
    needs no data folder when none is set: its data then defaults to ``cifar_c`` without a clean
    source to generate from.
    """
    allowed = {"name", "preset", "models", "data", "methods", "corruptions", "severities", "batch_sizes",
               "seeds", "n_images", "protocol", "order", "orders"}
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"unknown grid keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    if "order" in spec and "orders" in spec:
        raise ValueError("give a grid either 'order' (one stream order) or 'orders' (a list), not both")
    own_models = "models" in spec and all(isinstance(m, Mapping) for m in spec["models"])
    try:
        resolve_data_dir(data_dir)
    except DataDirError:
        if "preset" in spec or not own_models:
            raise
        base = GridSpec("custom", (), DataSpec(root=str(cifar_c)), tuple(MethodSpec(m) for m in BASELINES))
        known_models: dict[str, ModelSpec] = {}
    else:
        base = preset(spec.get("preset", "main"), data_dir, cifar_c)
        known_models = default_models(data_dir)
    changes: dict[str, Any] = {"name": spec.get("name", spec.get("preset", "custom"))}
    if "models" in spec:
        models = []
        for entry in spec["models"]:
            if isinstance(entry, str):
                if entry not in known_models:
                    raise ValueError(f"unknown model {entry!r}; give a mapping with ModelSpec fields "
                                     f"or one of {', '.join(known_models)}")
                models.append(known_models[entry])
            else:
                models.append(ModelSpec(**entry))
        changes["models"] = tuple(models)
    if "data" in spec:
        changes["data"] = DataSpec(**{**asdict(base.data), **spec["data"]})
    if "methods" in spec:
        changes["methods"] = tuple(MethodSpec.parse(m) for m in spec["methods"])
    if "corruptions" in spec:
        c = spec["corruptions"]
        changes["corruptions"] = CORRUPTIONS if c == "all" else tuple(c)
    for key in ("severities", "batch_sizes", "seeds"):
        if key in spec:
            changes[key] = tuple(int(v) for v in spec[key])
    if "n_images" in spec:
        changes["n_images"] = None if spec["n_images"] in (None, "all") else int(spec["n_images"])
    if "protocol" in spec:
        changes["protocol"] = spec["protocol"]
    if "order" in spec:
        changes["orders"] = (spec["order"],)
    if "orders" in spec:
        if isinstance(spec["orders"], str) or not isinstance(spec["orders"], Sequence):
            raise ValueError(f"grid key 'orders' must be a list of stream orders, got {spec['orders']!r}")
        changes["orders"] = tuple(spec["orders"])
    return replace(base, **changes)


def load_grid(path: str | Path, data_dir: str | Path | None = None,
              cifar_c: str | Path = "cache/cifar10c") -> GridSpec:
    """Read a grid from a ``.yaml``/``.yml`` (needs PyYAML, ``aqr[bench]``) or ``.json`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grid file {path} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as err:
            raise ImportError("reading YAML grids needs PyYAML: pip install 'aqr[bench]'") from err
        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    if not isinstance(spec, Mapping):
        raise ValueError(f"{path}: a grid file must hold a mapping, got {type(spec).__name__}")
    return grid_from_mapping(spec, data_dir, cifar_c)


def eval_indices(cell: Cell, pool: Sequence[int]) -> list[int]:
    """The test images a cell evaluates: a seeded permutation of the pool, cut to n_images.

    The seed changes both which images are drawn and how they are grouped into batches. A cell with
    a stream order then puts them in that order (:func:`stream_positions`).
    """
    import numpy as np

    order = np.random.default_rng(cell.seed).permutation(len(pool))
    if cell.n_images is not None:
        if cell.n_images > len(pool):
            raise ValueError(f"n_images={cell.n_images} exceeds the {len(pool)} images of eval_indices "
                             f"{cell.data.eval_indices!r}")
        order = order[: cell.n_images]
    pool = list(pool)
    return [pool[i] for i in order]


def stream_positions(cell: Cell, labels: Sequence[int]) -> Sequence[int] | None:
    """Where the cell's stream order puts its drawn images (positions into ``labels``, their labels in
    draw order), or ``None`` when the cell has no order. A mixed order needs a stream of several
    corruptions, which a one-corruption cell is not."""
    if cell.order is None:
        return None
    order = StreamOrder.parse(cell.order)
    if order.mixed:
        raise ValueError(f"stream order {cell.order!r} mixes corruptions; a cell of one corruption cannot")
    return order.positions(labels, cell.seed).tolist()
