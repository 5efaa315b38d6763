"""What one benchmark cell is: plain, frozen, JSON-able data, and what a cell produced.

A :class:`Cell` names the model and its source data, the evaluation data and protocol, one method with
its options, one corruption, severity, batch size and seed. Running a cell is a pure function of it
(:func:`aqr.harness.cell_run.run_cell`), so cells can run in any order, in any process or on any
machine; :func:`aqr.harness.keys.cell_key` names a cell's result in the results database.

A cell's images come in a seeded random order unless it names a stream order (``Cell.order``, the
text of a :class:`aqr.data.streams.StreamOrder`, e.g. ``"delta=0.1"``): then the same images are put
in that order, class-correlated, with the cell's seed; the order is part of the cell's key.

A *continual* cell (corruption ``"continual"``, or ``"continual:fog+contrast+..."`` for another
sequence; :func:`stream_corruptions`) is one whole stream: for each corruption in turn, a block of
the same ``n_images`` drawn images, one block after the other, evaluated without a reset (the
``stream`` preset). Its result keeps whether each image was classified right, in stream order, for
the accuracy along the stream. A *gradual* cell (``"gradual"`` or ``"gradual:fog+contrast+..."``) is the
same stream with each corruption's block repeated at severities ``1, 2, ..., s, ..., 2, 1`` (``s`` the
cell's severity: nine blocks per corruption at 5, the ``gradual`` setting of the test-time-adaptation
benchmark repository), again without a reset.

A cell's ``protocol`` is a method's (``"episodic"``, ``"online"``) or ``"realtime"``: online, but the
method adapts only on the batches it has time for when it costs ``cost`` times a plain forward pass
(:mod:`aqr.harness.realtime`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from aqr.data.corruption_params import CORRUPTIONS
from aqr.data.streams import StreamOrder


# A continual cell's corruption: the 15 benchmark corruptions in the order of the test-time-adaptation
# benchmark repository (gaussian noise first), or "continual:<name>+<name>+..." for another sequence.
CONTINUAL = "continual"
CONTINUAL_ORDER: tuple[str, ...] = CORRUPTIONS[:15]

# A gradual cell's corruption: each corruption's severity rises to the cell's and falls back to 1
GRADUAL = "gradual"

# A CCC cell's corruption: "ccc:baseline=B,speed=S,images=N" (Continuously Changing Corruptions, aqr.harness.ccc)
CCC = "ccc"

# Cell protocols beyond the methods' own: online, adapting only on the batches a method has time for
REALTIME = "realtime"
CELL_PROTOCOLS = ("episodic", "online", REALTIME)

# ModelSpec fields added after results were recorded: absent from a cell's dict while None
OPTIONAL_MODEL_FIELDS = ("image_size", "resize")

# Cell fields added after results were recorded: absent from a cell's dict while None
OPTIONAL_CELL_FIELDS = ("order", "cost")


# The largest image index an index selection may name: beyond any image collection, and what an int64
# array of indices and a 32-bit row count still hold
MAX_INDEX = 2**31 - 1


def parse_range(text: str | Sequence[int] | None, size: int | None = None, where: str = "") -> list[int] | None:
    """Index selection -> sorted-or-given list of ints.

    ``"0:5000"`` (a Python slice, stop exclusive), ``"1,5,9"``, a list of ints, or
    ``"0:50000~10000"``: 10,000 indices drawn without replacement from ``0:50000`` with
    ``numpy.random.default_rng(0)``, returned sorted. Use the last form whenever the data may be
    ordered by class (the JPEG CIFAR-10 training set is: its first 10,000 images are two classes).
    With ``size`` (the images of ``where``), an index past them is a ``ValueError`` before any list is
    made; none may exceed :data:`MAX_INDEX` either way.
    """
    if text is None:
        return None
    if not isinstance(text, str):
        picked = [int(i) for i in text]
        _check_indices(picked, repr(picked), size, where)
        return picked
    text = text.strip()
    span = _span(text)
    if span is not None:
        start, stop, count = span
        _check_indices([stop - 1], repr(text), size, where)
        if count is None:
            return list(range(start, stop))
        import numpy as np

        drawn = np.random.default_rng(0).choice(stop - start, count, replace=False)
        return sorted(int(i) + start for i in drawn)
    try:
        picked = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"indices must be 'start:stop' or comma-separated integers, got {text!r}") from None
    _check_indices(picked, repr(text), size, where)
    return picked


def index_count(text: str | Sequence[int] | None) -> int | None:
    """How many indices :func:`parse_range` gives for ``text`` (without making the list), or ``None``
    where the data decides (``None``, ``""``, ``"all"``, ``"balanced~n"`` draws from the labels)."""
    if text is None or (isinstance(text, str) and (text.strip() in ("", "all") or text.strip().startswith("balanced~"))):
        return None
    if isinstance(text, str):
        span = _span(text.strip())
        if span is not None:
            start, stop, count = span
            return stop - start if count is None else count
    return len(parse_range(text) or [])


def _span(text: str) -> tuple[int, int, int | None] | None:
    """``"start:stop"`` or ``"start:stop~n"`` -> ``(start, stop, n or None)``, checked; ``None`` for a comma list."""
    span, tilde, count = text.partition("~")
    if ":" not in span:
        if tilde:
            raise ValueError(f"'~n' needs a 'start:stop' range before it, got {text!r}")
        return None
    parts = span.split(":")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise ValueError(f"index range must look like 'start:stop' or 'start:stop~n', got {text!r}")
    start, stop = (int(p) for p in parts)
    if not 0 <= start < stop:
        raise ValueError(f"index range {text!r} is empty or negative")
    if stop - 1 > MAX_INDEX:
        raise ValueError(f"index range {text!r} reaches past index {MAX_INDEX}, beyond any image collection")
    if not tilde:
        return start, stop, None
    if not count.strip().isdigit() or not 0 < int(count) <= stop - start:
        raise ValueError(f"'~n' in {text!r} must be a count between 1 and {stop - start}")
    return start, stop, int(count)


def _check_indices(picked: Sequence[int], text: str, size: int | None, where: str) -> None:
    """Raise ``ValueError`` for a negative index, one past ``size`` images (of ``where``) or past :data:`MAX_INDEX`."""
    if not picked:
        return
    low, high = min(picked), max(picked)
    if low < 0:  # Python would count them from the end
        raise ValueError(f"indices must not be negative, got {text}")
    if size is not None and high >= size:
        raise ValueError(f"indices {text} exceed the {size} images{f' of {where}' if where else ''}")
    if high > MAX_INDEX:
        raise ValueError(f"indices {text} reach past index {MAX_INDEX}, beyond any image collection")


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
    reorders them with the cell's seed. ``cost``: under the ``"realtime"`` protocol, the method's time
    per batch relative to the plain forward pass (``C``, see :mod:`aqr.harness.realtime`); ``None``
    under the other protocols.
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
    cost: float | None = None

    @property
    def method_protocol(self) -> str:
        """The protocol the cell's method runs under (a realtime cell's method runs online)."""
        return "online" if self.protocol == REALTIME else self.protocol

    @property
    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def spec(self) -> str:
        """``method`` or ``method:key=value,...``: the cell's method in the bench's method syntax
        (:meth:`aqr.harness.specs.MethodSpec.parse` reads it back), as messages and progress bars spell it."""
        if not self.options:
            return self.method
        return f"{self.method}:{','.join(f'{k}={_fmt(v)}' for k, v in self.options)}"

    @property
    def variant(self) -> str:
        """``method`` or ``method[key=value,...]``: the label the results database and the costs file store
        for the method (kept as the committed rows spell it; the reports print it). Elsewhere a cell's
        method is spelled as a spec (:attr:`spec`)."""
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
        d["options"] = freeze_options(d.get("options") or {})
        return cls(**d)


def _fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(str(v) for v in value)
    return str(value)


def freeze_options(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    frozen = []
    for key in sorted(options):
        value = options[key]
        if isinstance(value, list):
            value = tuple(value)
        frozen.append((key, value))
    return tuple(frozen)


def stream_corruptions(corruption: str) -> tuple[str, ...] | None:
    """The corruptions a continual or gradual cell streams through, in order (see the module docs);
    ``None`` for a cell of one corruption. ``ValueError`` for a sequence naming an unknown corruption."""
    for kind in (CONTINUAL, GRADUAL):
        if corruption == kind:
            return CONTINUAL_ORDER
        if corruption.startswith(kind + ":"):
            names = tuple(n.strip() for n in corruption[len(kind) + 1 :].split("+") if n.strip())
            unknown = [n for n in names if n not in CORRUPTIONS]
            if not names or unknown:
                raise ValueError(f"{kind} stream {corruption!r} must list known corruptions joined by '+'; "
                                 f"unknown: {unknown or 'none given'}")
            return names
    return None


def is_gradual(corruption: str) -> bool:
    """Whether a cell's corruption is a gradual stream (severities rising and falling per corruption)."""
    return corruption == GRADUAL or corruption.startswith(GRADUAL + ":")


def severity_ramp(peak: int) -> tuple[int, ...]:
    """A gradual stream's severities per corruption: ``1, ..., peak, ..., 1`` (nine blocks for 5)."""
    return tuple(range(1, peak + 1)) + tuple(range(peak - 1, 0, -1))


def stream_schedule(cell: "Cell") -> tuple[tuple[str, int], ...] | None:
    """``(corruption, severity)`` of each block of a continual or gradual cell, in stream order; ``None``
    for a cell of one corruption."""
    names = stream_corruptions(cell.corruption)
    if names is None:
        return None
    if is_gradual(cell.corruption):
        return tuple((name, s) for name in names for s in severity_ramp(cell.severity))
    return tuple((name, cell.severity) for name in names)


def block_name(corruption: str, severity: int, gradual: bool) -> str:
    """How a stream's block is named in its result: the corruption, and its severity in a gradual stream."""
    return f"{corruption}-{severity}" if gradual else corruption


def data_corruptions(corruptions: Sequence[str]) -> tuple[str, ...]:
    """The corruption files a list of cell corruptions reads (continual streams expanded), each once; a CCC
    stream reads none (its images are made on the fly from the clean ones)."""
    return tuple(dict.fromkeys(c for name in corruptions if not is_ccc(name)
                               for c in (stream_corruptions(name) or (name,))))


def is_ccc(corruption: str) -> bool:
    """Whether a cell's corruption is a CCC stream (``ccc:baseline=B,speed=S,images=N``; :mod:`aqr.harness.ccc`)."""
    return corruption.startswith(CCC + ":")


def canonical_order(order: "str | StreamOrder | None") -> str | None:
    """The canonical text of a stream order (``"delta=0.10"`` -> ``"delta=0.1"``), ``None`` for none;
    ``ValueError`` for text that names no order."""
    return None if order is None else str(StreamOrder.parse(order))


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


@dataclass(frozen=True)
class CellResult:
    """What a cell produced. ``status``: ``"ok"``, ``"n/a"`` (method not applicable) or ``"error"``.

    ``node``, ``threads``, ``device`` and ``cpu``: the host that ran the cell, torch's thread count, the
    device there and the vector unit torch's CPU kernels use there (``torch.backends.cpu.get_cpu_capability()``,
    e.g. ``"AVX512"``: machines with another give other bits of the same floating-point sums) (``None`` when
    the cell never ran, e.g. its worker died). ``detail``: what a continual
    cell keeps beyond its accuracy (:func:`aqr.harness.continual.stream_detail`).
    """

    status: str
    accuracy: float | None = None
    n_images: int | None = None
    wall_s: float | None = None
    message: str | None = None
    node: str | None = None
    threads: int | None = None
    device: str | None = None
    cpu: str | None = None
    detail: dict[str, Any] | None = None
    correct: bytes | None = None  # per image, in evaluation order: aqr.harness.results.pack_correct
