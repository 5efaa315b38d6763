"""Orders of a test stream: i.i.d., class-correlated (Dirichlet, as RoTTA builds it) and mixed shifts.

A stream is a sequence of blocks of test images, one block per corruption in the continual order. How
the images follow one another is a pure function of their labels, a seed and a :class:`StreamOrder`:

``delta = inf`` (i.i.d.)
    each block is a uniformly random permutation of its images.
``delta`` finite (class-correlated; Yuan et al., "Robust Test-Time Adaptation in Dynamic Scenarios",
CVPR 2023, whose sampler the NOTE paper and the test-time-adaptation benchmark repository also use)
    a block is cut into ``T`` time slots, ``T`` the number of classes (at most :data:`MAX_SLOTS`, as
    RoTTA caps it). Each class's images, in the order given, are split into ``T`` consecutive parts
    with proportions drawn from ``Dirichlet(delta, ..., delta)``; part ``s`` goes to slot ``s``.
    Inside a slot each class's part is one contiguous run, the runs in random order. A small
    ``delta`` puts nearly all of a class's images into one slot: long runs of one class.
``mixed``
    the images of all blocks are pooled, shuffled and ordered as a single block ("mixed domains"), so
    consecutive images come from different corruptions; with a finite ``delta`` the pooled stream is
    class-correlated as well.

The functions draw from numpy generators only (no global state), so the same labels, seed and order
give the same stream on every machine and numpy version that keeps its generator streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: RoTTA's sampler uses min(classes, 100) time slots per block.
MAX_SLOTS = 100
# Separates the order's random numbers from other draws made with the same seed (e.g. which test
# images a benchmark cell evaluates): the order of block k comes from SeedSequence(seed, (_SPAWN, k)).
_SPAWN = 16


def check_labels(labels: Sequence[int] | np.ndarray, num_classes: int | None = None) -> np.ndarray:
    """``labels`` as a 1-D int64 array of class indices in ``[0, num_classes)``; a clear error otherwise."""
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64)
    if array.size and array.min() < 0:
        raise ValueError(f"labels must be non-negative class indices, got {array.min()}")
    if num_classes is not None and array.size and array.max() >= num_classes:
        raise ValueError(f"label {array.max()} is out of range for num_classes={num_classes}")
    return array


def check_delta(delta: float) -> float:
    """The Dirichlet concentration as a float: positive, ``0`` (sorted by class) or ``inf`` (i.i.d.), never NaN."""
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"delta must be a non-negative number or 'inf', got {delta!r}") from None
    if not value >= 0:  # also catches NaN
        raise ValueError(f"delta must be >= 0 (0: sorted by class; inf: i.i.d.), got {delta!r}")
    return value


def dirichlet_order(labels: Sequence[int] | np.ndarray, delta: float, rng: int | np.random.Generator,
                    num_classes: int | None = None) -> np.ndarray:
    """Positions ``0..n-1`` of ``labels`` in class-correlated stream order (RoTTA's Dirichlet sampler).

    ``delta = inf`` gives a uniformly random permutation (i.i.d.), ``delta = 0`` the positions sorted by class
    (stable: a class's images in the order given). ``num_classes`` (default: largest
    label + 1) sets the number of time slots, ``min(num_classes, MAX_SLOTS)``; a class with no image
    simply has empty runs. Images of a class keep their relative order from ``labels``, as in RoTTA,
    so pass them in random order (e.g. a seeded draw) unless that order is meant.
    """
    labels = check_labels(labels, num_classes)
    delta = check_delta(delta)
    rng = np.random.default_rng(rng)
    n = len(labels)
    if math.isinf(delta) or n == 0:
        return rng.permutation(n)
    if delta == 0:
        return np.argsort(labels, kind="stable").astype(np.int64)
    classes = int(num_classes) if num_classes is not None else int(labels.max()) + 1
    slots = min(classes, MAX_SLOTS)
    if slots < 2:
        return np.arange(n)  # one class: every order is the same stream of that class
    proportions = rng.dirichlet(np.full(slots, delta), size=classes)
    runs: list[list[np.ndarray]] = [[] for _ in range(slots)]
    for c in range(classes):
        members = np.flatnonzero(labels == c)
        cuts = (np.cumsum(proportions[c])[:-1] * len(members)).astype(np.int64)
        for slot, part in enumerate(np.split(members, np.clip(cuts, 0, len(members)))):
            runs[slot].append(part)
    order = [slot_runs[i] for slot_runs in runs for i in rng.permutation(len(slot_runs))]
    return np.concatenate(order).astype(np.int64)


def run_lengths(labels: Sequence[int] | np.ndarray) -> np.ndarray:
    """Lengths of the maximal runs of equal consecutive labels (``[1, 1, 2, 1]`` -> ``[2, 1, 1]``)."""
    labels = np.asarray(labels)
    if labels.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
    return np.diff(np.r_[starts, labels.size]).astype(np.int64)


def mean_run_length(labels: Sequence[int] | np.ndarray) -> float:
    """Mean length of the runs of one class in a stream: about ``1 / (1 - 1/classes)`` for i.i.d. balanced classes."""
    lengths = run_lengths(labels)
    return float(lengths.mean()) if lengths.size else 0.0


def _block_rng(seed: int, block: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(_SPAWN, block)))


@dataclass(frozen=True)
class StreamOrder:
    """How a stream's images follow one another: Dirichlet concentration ``delta`` and ``mixed`` shifts.

    Its text form (``str(order)``, read back by :meth:`parse`) is canonical and names it in benchmark
    cells: ``"iid"``, ``"delta=0.1"``, ``"mixed"``, ``"mixed,delta=0.1"``.
    """

    delta: float = math.inf
    mixed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "delta", check_delta(self.delta))
        if not isinstance(self.mixed, bool):
            raise ValueError(f"mixed must be True or False, got {self.mixed!r}")

    @property
    def iid(self) -> bool:
        """Whether the images come in uniformly random order (no class correlation)."""
        return math.isinf(self.delta)

    def __str__(self) -> str:
        parts = (["mixed"] if self.mixed else []) + ([] if self.iid else [f"delta={self.delta:g}"])
        return ",".join(parts) or "iid"

    @classmethod
    def parse(cls, text: "str | StreamOrder") -> "StreamOrder":
        """Read ``"iid"``, ``"delta=0.1"`` (``delta=inf`` is i.i.d.), ``"mixed"`` or ``"mixed,delta=0.1"``."""
        if isinstance(text, StreamOrder):
            return text
        delta, mixed = math.inf, False
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            key, eq, value = part.partition("=")
            if part == "iid":
                continue
            if part == "mixed":
                mixed = True
            elif key.strip() == "delta" and eq:
                delta = check_delta(value.strip())
            else:
                raise ValueError(f"stream order must look like 'iid', 'delta=0.1', 'mixed' or 'mixed,delta=0.1'; "
                                 f"got {text!r}")
        return cls(delta, mixed)

    def positions(self, labels: Sequence[int] | np.ndarray, seed: int, num_classes: int | None = None) -> np.ndarray:
        """The order of one block's images: positions into ``labels``. A mixed order needs several blocks
        (:meth:`stream`)."""
        if self.mixed:
            raise ValueError("a mixed stream order shuffles several corruptions together: use StreamOrder.stream "
                             "with one block per corruption, not a single block")
        return dirichlet_order(labels, self.delta, _block_rng(seed, 0), num_classes)

    def stream(self, block_labels: Sequence[Sequence[int] | np.ndarray], seed: int,
               num_classes: int | None = None) -> np.ndarray:
        """The whole stream as an ``(n, 2)`` int64 array of ``(block, position in block)`` rows, in order.

        Not mixed: block after block (the continual order), each ordered with its own generator, so a
        block's order does not depend on the others. Mixed: all images pooled, shuffled and ordered as
        one block. Use :func:`take` to gather images or labels along it.
        """
        blocks = [check_labels(b, num_classes) for b in block_labels]
        if not blocks:
            raise ValueError("a stream needs at least one block")
        if num_classes is None:
            num_classes = max((int(b.max()) + 1 for b in blocks if b.size), default=1)
        if not self.mixed:
            return np.concatenate([_pairs(k, dirichlet_order(b, self.delta, _block_rng(seed, k), num_classes))
                                   for k, b in enumerate(blocks)])
        pooled = np.concatenate([_pairs(k, np.arange(len(b))) for k, b in enumerate(blocks)])
        rng = _block_rng(seed, len(blocks))
        pooled = pooled[rng.permutation(len(pooled))]
        labels = np.concatenate(blocks)[_flat_index(blocks, pooled)]
        return pooled[dirichlet_order(labels, self.delta, rng, num_classes)]


def _pairs(block: int, positions: np.ndarray) -> np.ndarray:
    return np.stack([np.full(len(positions), block, dtype=np.int64), positions.astype(np.int64)], axis=1)


def _flat_index(blocks: Sequence[np.ndarray], pairs: np.ndarray) -> np.ndarray:
    offsets = np.cumsum([0] + [len(b) for b in blocks])[:-1]
    return offsets[pairs[:, 0]] + pairs[:, 1]


def take(block_arrays: Sequence[np.ndarray], stream: np.ndarray) -> np.ndarray:
    """Rows of the per-block arrays (images, labels, indices) in the order of ``stream``
    (``(block, position)`` rows from :meth:`StreamOrder.stream`)."""
    stream = np.asarray(stream)
    if stream.ndim != 2 or stream.shape[1] != 2:
        raise ValueError(f"stream must be (n, 2) rows of (block, position), got shape {stream.shape}")
    if not block_arrays:
        raise ValueError("no block arrays to take from")
    if stream.size and (stream[:, 0].min() < 0 or stream[:, 0].max() >= len(block_arrays)):
        raise IndexError(f"stream names blocks outside 0..{len(block_arrays) - 1}")
    first = np.asarray(block_arrays[0])
    out = np.empty((len(stream),) + first.shape[1:], dtype=first.dtype)
    for k, array in enumerate(block_arrays):
        rows = stream[:, 0] == k
        if rows.any():
            positions = stream[rows, 1]
            if positions.min() < 0 or positions.max() >= len(array):
                raise IndexError(f"stream positions of block {k} must lie in [0, {len(array)}), "
                                 f"got [{positions.min()}, {positions.max()}]")
            out[rows] = np.asarray(array)[positions]
    return out
