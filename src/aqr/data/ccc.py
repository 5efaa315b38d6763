"""Continuously Changing Corruptions (CCC; Press et al., NeurIPS 2023) at CIFAR-10 scale.

A CCC stream noises every image with two corruptions at once. Their severities walk over a grid so
that the source model's accuracy stays near a baseline: the first corruption fades out while the second
fades in (:func:`find_walk`), one grid step every ``speed`` images; when the first reaches 0, the second
becomes the first and a new one, drawn at random, fades in. The walks read the source model's accuracy
on every ordered pair of corruptions at every pair of grid severities (:class:`AccuracyTable`, measured
by :mod:`aqr.harness.ccc_table`). The images are the test images, drawn afresh for every step and
corrupted on the fly with severities between the generator's levels (:func:`aqr.data.corruptions.corrupt`),
each image from its own generator, so any part of a stream is made alone and identically.

``docs/benchmark.md`` says how each of CCC's choices was scaled from ImageNet and which were dropped.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from aqr.data.corruptions import corrupt
from aqr.util.files import WriteTargetError, atomic_write

#: the severity grid of the walks (CCC: steps of 0.25 on ImageNet; here 0.5, see docs/benchmark.md)
SEVERITY_GRID: tuple[float, ...] = tuple(float(s) for s in np.arange(0, 5.01, 0.5))

# CCC's corruptions by baseline (its generate.py): those whose accuracy can reach the baseline
_EASY = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
         "snow", "frost", "fog", "contrast", "elastic_transform", "pixelate", "jpeg_compression")


def ccc_corruptions(baseline: float) -> tuple[str, ...]:
    """The corruptions CCC walks through for a ``baseline`` accuracy (%): fewer as it falls, since the
    milder ones cannot bring the accuracy that low."""
    if baseline >= 40:
        return _EASY
    if baseline >= 20:
        return _EASY[:-1]
    return ("gaussian_noise", "shot_noise", "impulse_noise", "contrast")


@dataclass(frozen=True)
class AccuracyTable:
    """The source model's accuracy (%) on each ordered pair of corruptions: ``pairs[(a, b)][i, j]`` with ``a``
    at ``grid[i]`` and then ``b`` at ``grid[j]`` (severity 0: not applied)."""

    grid: tuple[float, ...]
    pairs: Mapping[tuple[str, str], np.ndarray]
    about: Mapping[str, object]

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (atomically)."""
        data = {"format": "aqr ccc accuracy table", "grid": list(self.grid), "about": dict(self.about),
                "pairs": {f"{a}+{b}": np.asarray(m).round(4).tolist() for (a, b), m in sorted(self.pairs.items())}}
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data)))

    @classmethod
    def load(cls, path: str | Path) -> "AccuracyTable":
        """Read a table written by :meth:`save`; ``ValueError`` naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            grid = tuple(float(s) for s in data["grid"])
            pairs = {tuple(k.split("+")): np.asarray(v, dtype=np.float64) for k, v in data["pairs"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path} is not a CCC accuracy table ({type(err).__name__}: {err})") from None
        if data.get("format") != "aqr ccc accuracy table" or any(
                len(k) != 2 or m.shape != (len(grid), len(grid)) for k, m in pairs.items()):
            raise ValueError(f"{path} is not a CCC accuracy table of {len(grid)} x {len(grid)} severities per pair")
        return cls(grid, pairs, data.get("about", {}))  # type: ignore[arg-type]


def find_walk(accuracy: np.ndarray, baseline: float) -> list[tuple[int, int]]:
    """The walk of one pair: grid indices ``(i, j)`` from ``(start, 0)`` (the first corruption alone) to
    ``(0, end)`` (the second alone), each step lowering ``i`` or raising ``j`` by one.

    As CCC's generator does, every cell keeps the continuation (down or right) whose path's mean accuracy is
    nearer ``baseline`` (a tie goes right, raising the second corruption), and the start is the ``i`` whose
    whole path's mean is nearest."""
    accuracy = np.asarray(accuracy, dtype=np.float64)
    rows, cols = accuracy.shape
    if rows < 2 or cols < 1:
        raise ValueError(f"the accuracy table must have at least 2 x 1 severities, got {accuracy.shape}")
    total = np.zeros((rows, cols))
    length = np.zeros((rows, cols), dtype=np.int64)
    step_down = np.zeros((rows, cols), dtype=bool)  # the next cell is (i - 1, j), else (i, j + 1)
    total[0], length[0] = accuracy[0], 1
    for i in range(1, rows):
        for j in range(cols - 1, -1, -1):
            down = abs((total[i - 1, j] + accuracy[i, j]) / (length[i - 1, j] + 1) - baseline)
            right = (abs((total[i, j + 1] + accuracy[i, j]) / (length[i, j + 1] + 1) - baseline)
                     if j + 1 < cols else np.inf)
            step_down[i, j] = down < right
            before = (i - 1, j) if step_down[i, j] else (i, j + 1)
            total[i, j] = total[before] + accuracy[i, j]
            length[i, j] = length[before] + 1
    start = min(range(1, rows), key=lambda i: abs(total[i, 0] / length[i, 0] - baseline))
    walk, (i, j) = [(start, 0)], (start, 0)
    while i > 0:
        i, j = (i - 1, j) if step_down[i, j] else (i, j + 1)
        walk.append((i, j))
    return walk


@dataclass(frozen=True)
class Step:
    """One step of a CCC stream: ``count`` images under ``first`` at ``first_severity`` then ``second`` at
    ``second_severity``."""

    first: str
    first_severity: float
    second: str
    second_severity: float
    count: int


def ccc_steps(table: AccuracyTable, baseline: float, speed: int, n_images: int, seed: int,
              corruptions: Sequence[str] | None = None) -> list[Step]:
    """The steps of a CCC stream of ``n_images`` images (the last step cut short), ``speed`` images a step.

    The first pair is drawn with ``seed``; each walk (:func:`find_walk` on the pair's table) runs to its end,
    then its second corruption becomes the first of the next pair, with a new second drawn among the others.
    ``corruptions``: those to draw from (default :func:`ccc_corruptions` of the baseline)."""
    names = tuple(corruptions) if corruptions is not None else ccc_corruptions(baseline)
    if isinstance(speed, bool) or not isinstance(speed, int) or speed < 1:
        raise ValueError(f"speed must be an integer >= 1 (images per severity step), got {speed!r}")
    if isinstance(n_images, bool) or not isinstance(n_images, int) or n_images < 1:
        raise ValueError(f"n_images must be an integer >= 1, got {n_images!r}")
    if len(names) < 2:
        raise ValueError(f"a CCC stream needs at least two corruptions, got {list(names)}")
    missing = [f"{a}+{b}" for a in names for b in names if a != b and (a, b) not in table.pairs]
    if missing:
        raise ValueError(f"the accuracy table lacks the pairs {', '.join(missing[:4])}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xCCC]))
    walks: dict[tuple[str, str], list[tuple[int, int]]] = {}
    first = names[int(rng.integers(len(names)))]
    steps: list[Step] = []
    left = n_images
    while left > 0:
        others = [n for n in names if n != first]
        second = others[int(rng.integers(len(others)))]
        pair = (first, second)
        if pair not in walks:
            walks[pair] = find_walk(table.pairs[pair], baseline)
        for i, j in walks[pair]:
            count = min(speed, left)
            steps.append(Step(first, table.grid[i], second, table.grid[j], count))
            left -= count
            if left == 0:
                break
        first = second
    return steps


def corrupt_pair(image: np.ndarray, step: Step, rng: np.random.Generator,
                 frost_overlays: Sequence[np.ndarray] | None = None) -> np.ndarray:
    """``image`` (uint8 HWC) under the step's first corruption, then its second (a severity of 0: not applied)."""
    out = image
    for name, severity in ((step.first, step.first_severity), (step.second, step.second_severity)):
        if severity > 0:
            out = corrupt(out, name, float(severity), rng, frost_overlays=frost_overlays)
    return out


def ccc_picks(pool_size: int, steps: Sequence[Step], seed: int) -> np.ndarray:
    """Which image of the pool (an index below ``pool_size``) each position of the stream shows: every step
    draws its own afresh, without replacement within the step (with it when the step outgrows the pool)."""
    picks = [np.random.default_rng(np.random.SeedSequence([int(seed), 1, k])).choice(
        pool_size, step.count, replace=step.count > pool_size) for k, step in enumerate(steps)]
    return np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)


def ccc_stream(images: np.ndarray, labels: np.ndarray, steps: Sequence[Step], seed: int, start: int = 0,
               stop: int | None = None, frost_overlays: Sequence[np.ndarray] | None = None,
               chunk: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Images ``start:stop`` of the CCC stream, in chunks of at most ``chunk``: ``(uint8 NHWC, labels)``.

    The images are drawn by :func:`ccc_picks`, each flipped left-right with probability 1/2 and corrupted
    with its own generator (a function of ``seed`` and its position), so a part of the stream comes out the
    same whether made alone or with the rest."""
    stream = CCCImages(images, steps, seed, frost_overlays)
    stop = len(stream) if stop is None else stop
    if not 0 <= start <= stop <= len(stream):
        raise ValueError(f"images {start}:{stop} are outside the stream of {len(stream)}")
    for lo in range(start, stop, chunk):
        hi = min(stop, lo + chunk)
        yield stream[lo:hi], np.asarray(labels)[stream.picks[lo:hi]].astype(np.int64)


#: images per file of a CCC stream's cache (about 12.6 MB of 32 x 32 RGB images)
CACHE_SHARD = 4096


class CCCImages:
    """The images of a CCC stream, made when sliced (``stream[a:b]``: uint8 NHWC); ``picks``: the pool image at
    each position (so the labels are ``labels[picks]``, known without making a single image).

    ``cache`` (a folder for this one stream, or ``None``): the images are kept there in shards of ``shard``
    positions, each made whole the first time a slice touches it and read back afterwards, so the methods
    run on one stream make its images once. Every image comes out the same whether made or read: each has
    its own generator. ``made`` counts the images this object made (0 where every shard was there)."""

    def __init__(self, images: np.ndarray, steps: Sequence[Step], seed: int,
                 frost_overlays: Sequence[np.ndarray] | None = None, cache: str | Path | None = None,
                 shard: int = CACHE_SHARD) -> None:
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
            raise ValueError(f"a CCC stream's cache shard must be an integer >= 1, got {shard!r}")
        self.images, self.steps, self.seed, self.frost_overlays = images, list(steps), int(seed), frost_overlays
        self.picks = ccc_picks(len(images), self.steps, self.seed)
        self._step_of = np.repeat(np.arange(len(self.steps)), [s.count for s in self.steps])
        self.cache = None if cache is None else Path(cache)
        self.shard = shard
        self.made = 0

    def __len__(self) -> int:
        return len(self.picks)

    def __getitem__(self, where: slice) -> np.ndarray:
        if not isinstance(where, slice) or where.step not in (None, 1):
            raise TypeError("a CCC stream is read in contiguous slices, stream[a:b]")
        start, stop, _ = where.indices(len(self))
        stop = max(start, stop)
        if self.cache is None or start == stop:
            return self._make(start, stop)
        out = np.empty((stop - start, *self.images.shape[1:]), dtype=np.uint8)
        for s in range(start // self.shard, -(-stop // self.shard)):
            lo = s * self.shard
            block = self._shard(s) if self.cache is not None else self._make(lo, min(len(self), lo + self.shard))
            a, b = max(start, lo), min(stop, lo + len(block))
            out[a - start:b - start] = block[a - lo:b - lo]
        return out

    def _make(self, start: int, stop: int) -> np.ndarray:
        """Images ``start:stop``, each from its own generator (a function of the seed and its position)."""
        out = np.empty((stop - start, *self.images.shape[1:]), dtype=np.uint8)
        for k, position in enumerate(range(start, stop)):
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 2, position]))
            image = self.images[self.picks[position]]
            if rng.random() < 0.5:
                image = image[:, ::-1]
            out[k] = corrupt_pair(np.ascontiguousarray(image), self.steps[self._step_of[position]], rng,
                                  self.frost_overlays)
        self.made += stop - start
        return out

    def _shard(self, s: int) -> np.ndarray:
        """Shard ``s`` of the cache (positions ``s * shard`` on), made first where it is missing or unreadable;
        processes making one at once take turns on a lock file, so each shard is made once. Where the cache
        cannot be written (a read-only folder), the images are made in memory, with one warning."""
        assert self.cache is not None
        lo, hi = s * self.shard, min(len(self), (s + 1) * self.shard)
        name = f"{s:06d}-{self.shard}"  # the shard size in the name: another size's shards are other files
        path = self.cache / f"{name}.npy"
        expected = (hi - lo, *self.images.shape[1:])
        block = _read_shard(path, expected)
        if block is not None:
            return block
        try:
            self.cache.mkdir(parents=True, exist_ok=True)
            with _locked(self.cache / f"{name}.lock"):
                block = _read_shard(path, expected)  # made meanwhile by another process
                if block is None:
                    for stale in self.cache.glob(f".{name}.npy.*"):  # a writer killed mid-file (the lock is ours)
                        stale.unlink(missing_ok=True)
                    block = self._make(lo, hi)
                    atomic_write(path, functools.partial(_write_shard, block))
        except (OSError, WriteTargetError) as err:
            warnings.warn(f"CCC stream cache {self.cache} cannot be written ({err}); the stream's images are made "
                          "in memory instead", RuntimeWarning, stacklevel=3)
            self.cache = None
            return block if block is not None else self._make(lo, hi)
        return block


def _read_shard(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The cached images at ``path`` (memory-mapped), or ``None`` where the file is missing, cut short, empty or
    not a uint8 array of ``shape`` (then it is made again)."""
    try:
        block = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return block if block.dtype == np.uint8 and block.shape == shape else None


def _write_shard(block: np.ndarray, tmp: Path) -> None:
    """``block`` saved at ``tmp``, on disk before it is renamed into place (a crash leaves no empty shard)."""
    with open(tmp, "wb") as f:
        np.save(f, block, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the file ``path`` for the block (where the platform has ``fcntl``; else none). A lock
    file another user made is opened for reading: a lock needs no more."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on the platforms aqr is tested on
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
