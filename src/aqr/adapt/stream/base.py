"""The operations streaming AQR needs from a backend, and the running state they work on.

A streamed layer keeps, per channel, the buffers of :class:`StreamBuffers` (all of fixed size:
nothing grows with the stream). :class:`StreamKernels` are the five operations on them, each one
pass at most: :meth:`~StreamKernels.scan` (map a batch, take each image's extremes, histogram its
values), :meth:`~StreamKernels.push` (a batch into the tail window and the pending group),
:meth:`~StreamKernels.tails`, :meth:`~StreamKernels.merge` and :meth:`~StreamKernels.tables`; and
two compositions of them for a batch merged before it is mapped, :meth:`~StreamKernels.large` and
:meth:`~StreamKernels.merge_map`, which the C kernels run in one call (the same values).
:class:`aqr.adapt.stream.native_kernels.NativeStreamKernels` runs them in aqr's C kernels on CPU,
:class:`aqr.adapt.stream.torch_kernels.TorchStreamKernels` in torch on any device (and is the
reference the C kernels are tested against). :mod:`aqr.adapt.stream.running` decides when each runs.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple, Union

import torch

from aqr.adapt.layer_maps import host_reads_are_cheap
from aqr.backends.base import Affine

Flag = Union[bool, torch.Tensor]  # whether values were finite: a bool, or a 0-d bool tensor not read on the host
MAP, COUNT, IMAGE_COUNT, PAIRED = 1, 2, 4, 8  # scan modes, as _stream_kernels.c reads them
EDGE_BINS = 4  # the histogram's bins outside the inner cells: below p0, [p0, p1), [p_{K-2}, p_{K-1}), above


@dataclass
class StreamTable:
    """The lookup table of one layer's map: ``pairs`` ``(C, G + 2, 2)``, each cell's line as (slope,
    intercept) (cell 0 and G + 1 the edge lines; pairs side by side, so one 64-bit gather reads a
    cell), ``glo``/``ginv`` ``(C,)`` the grid's start and inverse cell width."""

    pairs: torch.Tensor
    glo: torch.Tensor
    ginv: torch.Tensor

    @classmethod
    def empty(cls, channels: int, grid: int, device: torch.device | str = "cpu") -> StreamTable:
        zeros = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(zeros(channels, grid + 2, 2), zeros(channels), zeros(channels))

    @property
    def grid(self) -> int:
        return self.pairs.shape[1] - 2


@dataclass
class TailWindow:
    """The last ``W`` images' per-channel minima and maxima: ``ring_lo``/``ring_hi`` ``(W, C)`` in arrival
    order (row ``head`` the oldest once ``filled == W``), ``sorted_lo`` ``(C, W)`` ascending and
    ``sorted_hi`` the maxima negated and ascending (the most extreme first in both; ``filled`` valid)."""

    ring_lo: torch.Tensor
    sorted_lo: torch.Tensor
    ring_hi: torch.Tensor
    sorted_hi: torch.Tensor
    filled: int = 0
    head: int = 0

    @classmethod
    def empty(cls, channels: int, window: int, device: torch.device | str = "cpu") -> TailWindow:
        return cls(*(torch.zeros(*shape, device=device) for shape in
                     ((window, channels), (channels, window), (window, channels), (channels, window))))

    @property
    def size(self) -> int:
        return self.ring_lo.shape[0]


@dataclass
class PendingGroup:
    """Images seen since the knots last absorbed them: ``counts`` ``(C, GC + 4)`` int32 (a histogram on
    the knots' bins, see :meth:`StreamKernels.scan`), ``gmin``/``gmax`` ``(C,)`` their extremes."""

    counts: torch.Tensor
    gmin: torch.Tensor
    gmax: torch.Tensor
    images: int = 0

    @classmethod
    def empty(cls, channels: int, cells: int, device: torch.device | str = "cpu") -> PendingGroup:
        group = cls(torch.zeros(channels, cells + EDGE_BINS, dtype=torch.int32, device=device),
                    torch.empty(channels, device=device), torch.empty(channels, device=device))
        group.clear()
        return group

    def clear(self) -> None:
        self.counts.zero_()
        self.gmin.fill_(float("inf"))
        self.gmax.fill_(float("-inf"))
        self.images = 0

    @property
    def cells(self) -> int:
        return self.counts.shape[1] - EDGE_BINS


def copy_into(target: object, source: object) -> None:
    """Copy every field of the dataclass ``source`` into ``target`` (tensors in place, so their memory,
    which the kernels were handed, stays the same)."""
    for f in fields(source):  # type: ignore[arg-type]
        value = getattr(source, f.name)
        if isinstance(value, torch.Tensor):
            getattr(target, f.name).copy_(value)
        else:
            setattr(target, f.name, value)


def cloned(state: object) -> object:
    """A copy of the dataclass ``state`` with every tensor cloned."""
    values = {f.name: getattr(state, f.name) for f in fields(state)}  # type: ignore[arg-type]
    return type(state)(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()})


class ScanResult(NamedTuple):
    """What :meth:`StreamKernels.scan` returns: the map ``y`` (``None`` unless asked), each image's
    extremes ``lo``/``hi`` ``(N, C)``, the histogram ``counts`` (``None`` unless asked) and whether every
    value was finite (if not, the rest is meaningless): a ``bool``, or a 0-d bool tensor on the device
    where the kernels do not read it on the host (:func:`all_finite` combines them)."""

    y: torch.Tensor | None
    lo: torch.Tensor
    hi: torch.Tensor
    counts: torch.Tensor | None
    finite: Flag


def per_row(weight: float | torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (a number, or a 0-d tensor kept on its device) for each of ``rows`` rows, float64."""
    if isinstance(weight, torch.Tensor):
        return weight.double().expand(rows)
    return torch.full((rows,), weight, dtype=torch.float64)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host values: weights, indices) on ``device``, copied without waiting for the device's queue (a
    blocking copy to a GPU waits for every kernel before it)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def settled(flag: Flag) -> Flag:
    """``flag`` as a ``bool`` where reading it costs nothing (a CPU tensor), else as it is: a GPU's flag stays on
    the GPU, so its queue of kernels never waits for the host inside a forward pass."""
    if isinstance(flag, torch.Tensor) and host_reads_are_cheap(flag.device):
        return bool(flag)
    return flag


def all_finite(*flags: Flag) -> Flag:
    """Whether every flag is true, without reading one on the host: ``False`` if a ``bool`` is, else the
    tensors' conjunction (``True`` where there is none)."""
    if any(f is False for f in flags):
        return False
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    if not tensors:
        return True
    out = tensors[0]
    for f in tensors[1:]:
        out = out & f
    return out


def check_scan(x: torch.Tensor, images: int, knots: torch.Tensor, source: torch.Tensor, table: StreamTable,
               mode: int = MAP) -> None:
    """Raise ``ValueError`` unless ``x`` (A, C, B) holds ``images`` images, the state fits its C channels and
    ``mode`` is a scan mode."""
    if (not 0 <= mode <= MAP | COUNT | IMAGE_COUNT | PAIRED or (mode & COUNT and mode & IMAGE_COUNT)
            or (mode & PAIRED and not mode & IMAGE_COUNT)):
        raise ValueError(f"scan mode {mode}: MAP, COUNT, IMAGE_COUNT (PAIRED with it) or a sum of them, COUNT and "
                         "IMAGE_COUNT not both")
    a, c, _ = x.shape
    if images < 1 or a % images:
        raise ValueError(f"a layer output of {a} rows cannot hold {images} images (streaming AQR needs the "
                         "batch dimension first)")
    k = knots.shape[1]
    if knots.shape != (c, k) or source.shape != (c, k) or table.pairs.shape != (c, table.grid + 2, 2):
        raise ValueError(f"streaming state of {knots.shape[0]} channels for a layer output of {c}")


class ClusterScan(NamedTuple):
    """What :meth:`StreamKernels.cluster_scan` returns: each image's extremes ``lo``/``hi`` ``(N, C)`` (where it has
    a cluster), each cluster's histogram ``counts`` ``(M, C, cells + 4)`` int32, and whether every value read was
    finite (as :class:`ScanResult`'s ``finite``)."""

    lo: torch.Tensor
    hi: torch.Tensor
    counts: torch.Tensor
    finite: Flag


def check_clusters(x: torch.Tensor, images: int, source: torch.Tensor, of: torch.Tensor,
                   states: Sequence[tuple[torch.Tensor, StreamTable]], maps: Sequence[bool], blend: float,
                   y: torch.Tensor) -> None:
    """Raise ``ValueError`` unless :meth:`StreamKernels.cluster_scan`'s arguments fit: ``x`` (A, C, B) of
    ``images`` images, ``y`` its shape and contiguous, ``of`` ``(images,)`` int64 on the CPU or ``x``'s device below
    ``len(states)`` (read where that costs nothing), one ``maps`` flag per state, each state fitting ``x`` and
    ``source`` on one grid, ``blend`` in [0, 1]."""
    a, c, _ = x.shape
    if images < 1 or a % images:
        raise ValueError(f"a layer output of {a} rows cannot hold {images} images")
    if y.shape != x.shape or not y.is_contiguous():
        raise ValueError(f"cluster_scan writes a contiguous map of {tuple(x.shape)}, got {tuple(y.shape)}")
    if of.shape != (images,) or of.dtype != torch.int64 or of.device not in (torch.device("cpu"), x.device):
        raise ValueError(f"cluster_scan: the images' clusters must be an int64 tensor ({images},) on the CPU or "
                         f"{x.device}, got {tuple(of.shape)} {of.dtype} on {of.device}")
    if not states or len(maps) != len(states):
        raise ValueError(f"cluster_scan: {len(states)} cluster states and {len(maps)} map flags")
    if host_reads_are_cheap(of.device) and bool((of >= len(states)).any()):
        raise ValueError(f"cluster_scan: an image's cluster is not below {len(states)}")
    if not 0.0 <= blend <= 1.0:
        raise ValueError(f"cluster_scan: blend must lie in [0, 1], got {blend}")
    for knots, table in states:
        check_scan(x, images, knots, source, table)
        if table.grid != states[0][1].grid:
            raise ValueError(f"cluster_scan: the clusters' tables have grids {states[0][1].grid} and {table.grid}")


def check_pushes(of: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor,
                 states: Sequence[tuple[TailWindow, PendingGroup]]) -> None:
    """Raise ``ValueError`` unless :meth:`StreamKernels.cluster_push`'s arguments fit: ``of`` ``(N,)`` CPU int64 below
    ``len(states)``, ``lo``/``hi`` ``(N, C)``, ``counts`` one histogram per state on its group's bins, and every
    window of one size."""
    n = of.shape[0] if of.ndim == 1 else -1
    if n < 1 or of.dtype != torch.int64 or of.device.type != "cpu":
        raise ValueError(f"cluster_push: the images' clusters must be a CPU int64 tensor (N,), got {tuple(of.shape)}")
    if lo.ndim != 2 or lo.shape[0] != n or hi.shape != lo.shape:
        raise ValueError(f"cluster_push: extremes {tuple(lo.shape)}, {tuple(hi.shape)} for {n} images")
    c = lo.shape[1]
    if not states or counts.ndim != 3 or counts.shape[:2] != (len(states), c):
        raise ValueError(f"cluster_push: counts {tuple(counts.shape)} for {len(states)} clusters of {c} channels")
    if bool((of >= len(states)).any()):
        raise ValueError(f"cluster_push: an image's cluster is not below {len(states)}")
    size = states[0][0].size
    for window, group in states:
        if window.size != size or window.ring_lo.shape[1] != c or group.counts.shape != counts.shape[1:]:
            raise ValueError("cluster_push: the clusters' windows and groups do not all fit the batch")


def cluster_sizes(of: torch.Tensor, clusters: int) -> list[int]:
    """How many of the images took each of ``clusters`` clusters, from each image's cluster ``of`` (-1: none)."""
    return torch.bincount(of + 1, minlength=clusters + 1)[1:].tolist()


def check_mixture_weights(weights: torch.Tensor | None, groups: int) -> None:
    """:meth:`StreamKernels.mixture`'s ``weights``: ``None`` or one per group (their values are the
    kernels' to check)."""
    if weights is not None and weights.shape != (groups,):
        raise ValueError(f"mixture: {tuple(weights.shape)} weights for {groups} groups")


class StreamKernels(abc.ABC):
    """The operations of streaming AQR on one device (see the module docstring); the last three,
    :meth:`group_merge`, :meth:`mixture` and :meth:`shift_distances`, are ``target="robust"``'s."""

    name = ""

    def available(self) -> bool:
        """Whether the kernels can run in this process (a copy of C kernels may be unpickled where they cannot
        be built; its stream then runs on the torch kernels)."""
        return True

    @abc.abstractmethod
    def takes(self, x: torch.Tensor) -> bool:
        """Whether :meth:`scan` can read ``x`` as it is."""

    @abc.abstractmethod
    def scan(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
             table: StreamTable, mode: int, stride: int, cells: int) -> ScanResult:
        """One pass over ``x`` (A, C, B), whose A rows are ``images`` images' rows, read as
        ``pre[0] * x + pre[1]`` when ``pre`` is given.

        ``mode & MAP``: ``y`` = ``x`` mapped by ``table`` (built from ``knots`` onto ``source``), its
        edge lines stretched out to the batch's extremes where the batch passes ``knots``' ends.
        ``mode & COUNT``: ``counts`` ``(C, cells + 4)`` = the histogram of every ``stride``-th value of
        each channel (flat position ``row * B + b``) on the bins ``[.., p0)``, ``[p0, p1)``, ``cells``
        equal cells of ``[p1, p_{K-2})``, ``[p_{K-2}, p_{K-1})``, ``[p_{K-1}, ..)``.
        ``mode & IMAGE_COUNT`` (not with ``COUNT``): ``counts`` ``(images, C, cells + 4)``, each image's
        own histogram on those bins, of every ``stride``-th value by flat position within its rows; with
        ``PAIRED``, ``counts`` ``(2, C, cells + 4)``: those of the even images summed, then the odd images'.
        """

    def cluster_scan(self, x: torch.Tensor, images: int, pre: Affine | None, source: torch.Tensor,
                     of: torch.Tensor, states: Sequence[tuple[torch.Tensor, StreamTable]], maps: Sequence[bool],
                     blend: float, y: torch.Tensor, stride: int, cells: int) -> ClusterScan:
        """``target="mixed"``'s clusters: each image ``n`` of ``x`` (A, C, B) whose cluster ``k = of[n]`` (``of``
        ``(images,)`` int64, on the CPU or ``x``'s device; ``-1``: none) is :meth:`scan`-ned alone (``COUNT``, and ``MAP`` where
        ``maps[k]``) on cluster ``k``'s ``states[k]`` (knots, table): its extremes, its histogram added to
        ``counts[k]`` ``(M, C, cells + 4)``, and, where ``maps[k]``, the rows of ``y`` (the shared state's map of
        ``x``, contiguous, changed in place) moved ``blend`` of the way to its map, ``y + blend * (m - y)`` in
        float32. ``lo``/``hi`` rows of images of no cluster are meaningless. This form reads ``of`` on the host and
        calls :meth:`scan` once per image (the reference the C kernels' single call and the torch kernels'
        gathered one are held to)."""
        a, c, _ = x.shape
        check_clusters(x, images, source, of, states, maps, blend, y)
        rows = a // images
        counts = torch.zeros(len(states), c, cells + EDGE_BINS, dtype=torch.int32, device=x.device)
        lo, hi = torch.zeros(images, c, device=x.device), torch.zeros(images, c, device=x.device)
        weight = torch.tensor(blend, dtype=torch.float32, device=x.device)
        finite: Flag = True
        for n, k in enumerate(of.tolist()):
            if k < 0:
                continue
            knots, table = states[k]
            part = slice(n * rows, (n + 1) * rows)
            r = self.scan(x[part], 1, pre, knots, source, table, COUNT | (MAP if maps[k] else 0), stride, cells)
            finite = all_finite(finite, r.finite)
            if finite is False:
                return ClusterScan(lo, hi, counts, False)
            lo[n], hi[n] = r.lo[0], r.hi[0]
            counts[k] += r.counts.to(torch.int32)
            if maps[k]:
                y[part] = y[part] + weight * (r.y.to(y.dtype) - y[part])
        return ClusterScan(lo, hi, counts, finite)

    def cluster_push(self, of: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor,
                     states: Sequence[tuple[TailWindow, PendingGroup]]) -> list[int]:
        """``target="mixed"``'s commit of :meth:`cluster_scan`'s batch: each cluster ``k``'s images (``of == k``, in
        batch order) :meth:`push`-ed into its ``states[k]`` (window, group) with its histogram ``counts[k]``; a
        cluster of no image is not touched. Returns how many images each cluster took."""
        check_pushes(of, lo, hi, counts, states)
        sizes = cluster_sizes(of, len(states))
        for k, (size, (window, group)) in enumerate(zip(sizes, states)):
            if size:
                index = on_device((of == k).nonzero().view(-1), lo.device)
                self.push(window, group, counts[k], lo.index_select(0, index), hi.index_select(0, index))
        return sizes

    def bind(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable, window: TailWindow,
             group: PendingGroup, stride: int, cells: int) -> object | None:
        """A layer's state bound to these kernels for the calls of a small batch, with the checks done
        once (:class:`aqr.adapt.stream.native_kernels.BoundStream`), or ``None`` where the kernels have
        no such form (then :meth:`scan` and :meth:`push` serve)."""
        return None

    def large(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
              table: StreamTable, window: TailWindow, group: PendingGroup, weight: float, tail_weights: torch.Tensor,
              stride: int, cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        """A batch merged into copies of the state, then mapped with them: ``x`` counted (:meth:`scan`, ``COUNT``,
        on ``knots``' bins; ``table`` is not read), then :meth:`merge_map`. Returns ``(y, knots, window)`` (the
        copies), or ``None`` when a value was NaN or Inf. Nothing passed in changes."""
        y, knots, window, finite = self.large_flagged(x, images, pre, knots, source, table, window, group, weight,
                                                      tail_weights, stride, cells)
        return (y, knots, window) if finite else None  # type: ignore[return-value]

    def large_flagged(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor,
                      source: torch.Tensor, table: StreamTable, window: TailWindow, group: PendingGroup,
                      weight: float, tail_weights: torch.Tensor, stride: int,
                      cells: int) -> tuple[torch.Tensor | None, torch.Tensor | None, TailWindow | None, Flag]:
        """:meth:`large` with whether the values were finite returned as a flag (:class:`ScanResult`'s ``finite``),
        which it does not read: ``(y, knots, window, finite)``, meaningless where ``finite`` is false."""
        r = self.scan(x, images, pre, knots, source, table, COUNT, stride, cells)
        if r.finite is False:
            return None, None, None, False
        y, knots, window, finite = self.merge_map_flagged(x, images, pre, knots, source, table.grid, window, group,
                                                          r.counts, r.lo, r.hi, weight, tail_weights, stride, cells)
        return y, knots, window, all_finite(r.finite, finite)

    def merge_map(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
                  grid: int, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, weight: float, tail_weights: torch.Tensor, stride: int,
                  cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        """A counted batch (``counts`` ``(C, cells + 4)`` on ``knots``' bins, its images' extremes ``lo``/``hi``
        ``(N, C)``) pushed into copies of ``window`` and ``group`` (``None``: an empty group), the copy of
        ``knots`` merged with the group at ``weight`` with the window copy's :meth:`tails` by ``tail_weights``,
        and ``x`` mapped with a ``grid``-cell table of the result. Returns ``(y, knots, window)`` (the copies),
        or ``None`` when a value was NaN or Inf. Nothing passed in changes."""
        y, knots, window, finite = self.merge_map_flagged(x, images, pre, knots, source, grid, window, group, counts,
                                                          lo, hi, weight, tail_weights, stride, cells)
        return (y, knots, window) if finite else None  # type: ignore[return-value]

    def merge_map_flagged(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor,
                          source: torch.Tensor, grid: int, window: TailWindow, group: PendingGroup | None,
                          counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, weight: float | torch.Tensor,
                          tail_weights: torch.Tensor, stride: int,
                          cells: int) -> tuple[torch.Tensor | None, torch.Tensor, TailWindow, Flag]:
        """:meth:`merge_map` with whether the values were finite returned as a flag, not read:
        ``(y, knots, window, finite)``. ``weight`` may be a 0-d float64 tensor (:meth:`merge`'s)."""
        knots, window = self.merged(knots, grid, window, group, counts, lo, hi, weight, tail_weights, cells)
        table = StreamTable.empty(knots.shape[0], grid, knots.device)
        self.tables(knots, source, table)
        r = self.scan(x, images, pre, knots, source, table, MAP, stride, cells)
        return r.y, knots, window, r.finite

    def merged(self, knots: torch.Tensor, grid: int, window: TailWindow, group: PendingGroup | None,
               counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, weight: float | torch.Tensor,
               tail_weights: torch.Tensor, cells: int) -> tuple[torch.Tensor, TailWindow]:
        """:meth:`merge_map`'s copies of ``knots`` and ``window`` with the counted batch merged, without the map."""
        knots, window = knots.clone(), cloned(window)
        group = PendingGroup.empty(knots.shape[0], cells, knots.device) if group is None else cloned(group)
        self.push(window, group, counts, lo, hi)
        p0, p100 = self.tails(window, tail_weights)
        self.merge(knots, group, weight, p0, p100)
        return knots, window

    def idle_rebuild(self, marginal: torch.Tensor, knots: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                     gmax: torch.Tensor, weight: float | torch.Tensor, window: TailWindow, tail_weights: torch.Tensor) -> None:
        """In place, ``target="robust"``'s rebuild of one batch alone while its groups weigh nothing: the
        ``marginal`` ``(C, K)`` takes the batch's histogram ``counts`` (on ``knots``' bins) spread to ``gmin``/
        ``gmax`` at ``weight`` (:meth:`group_merge`); ``knots``' inner knots become the marginal's, its ends
        the :meth:`tails` of ``window`` by ``tail_weights`` (:meth:`merge` with no group)."""
        c = knots.shape[0]
        self.group_merge(marginal, knots, counts, gmin, gmax, per_row(weight, c))
        knots[:, 1:-1].copy_(marginal[:, 1:-1])
        p0, p100 = self.tails(window, tail_weights)
        self.merge(knots, None, 0.0, p0, p100)

    @abc.abstractmethod
    def push(self, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor | None,
             lo: torch.Tensor, hi: torch.Tensor) -> None:
        """In place: each image's extremes ``lo``/``hi`` ``(N, C)`` into ``window`` (the oldest leave);
        with ``group``, its extremes and ``counts`` join the group's (not its image count)."""

    @abc.abstractmethod
    def tails(self, window: TailWindow, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(p0, p100)`` ``(C,)``: the weighted sums of the ``len(weights)`` most extreme minima and maxima."""

    @abc.abstractmethod
    def merge(self, knots: torch.Tensor, group: PendingGroup | None, weight: float, p0: torch.Tensor,
              p100: torch.Tensor) -> None:
        """In place: ``knots``' inner knots become the quantiles of ``(1 - weight) F_knots + weight F_group``
        (a channel whose group is empty keeps them); the ends become ``p0``/``p100``, kept outside. ``weight``:
        a number, or (the torch kernels) a 0-d float64 tensor, which no host read decides on."""

    @abc.abstractmethod
    def tables(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable) -> None:
        """In place: ``table`` = the map from ``knots`` onto ``source`` (both ``(C, K)``)."""

    @abc.abstractmethod
    def group_merge(self, knots: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                    gmax: torch.Tensor, weights: torch.Tensor) -> None:
        """In place, row by row: ``knots`` ``(R, K)``' inner knots become the quantiles of
        ``(1 - w) F_knots + w F_hist``, ``F_hist`` the histogram ``counts`` ``(R, cells + 4)`` taken on the
        bins of ``bins`` ``(R, K)`` (as :meth:`scan` counts) spread out to ``gmin``/``gmax`` ``(R,)``, ``w``
        the row's ``weights`` (float64 ``(R,)``, in [0, 1]); a row without counts keeps its inner knots.
        The ends move to ``gmin``/``gmax`` by ``w`` (as ``torch.lerp``), kept outside the inner knots; a row
        of weight 0 is left as it is."""

    @abc.abstractmethod
    def mixture(self, groups: torch.Tensor, knots: torch.Tensor, grid: int,
                weights: torch.Tensor | None = None) -> None:
        """In place: ``knots`` ``(C, K)``' inner knots become the inner quantiles of the mixture, with
        ``weights`` ``(M,)`` (finite, >= 0, not all 0; normalized; ``None``: equal), of
        the piecewise-linear CDFs through ``groups`` ``(M, C, K)`` (finite), evaluated at ``grid`` points
        spread over the groups' inner knots and at each group's first two and last two knots (exact
        there, linear in between); the ends are not touched."""

    def shift_test(self, counts: torch.Tensor, knots: torch.Tensor,
                   small: bool) -> tuple[tuple[float, float], torch.Tensor, torch.Tensor]:
        """:meth:`shift_distances` of the per-image ``counts`` ``(N, C, cells + 4)`` (int32), with what the same
        pass can give besides: the counts summed over the images (int32 ``(C, cells + 4)``) and the counts
        as int16 where ``small`` (the caller knows they fit), else as they are."""
        return (self.shift_distances(counts, knots), counts.sum(0, dtype=torch.int32),
                counts.to(torch.int16) if small else counts)

    @abc.abstractmethod
    def shift_distances(self, counts: torch.Tensor, knots: torch.Tensor) -> tuple[float, float]:
        """Over the channels whose even and odd images both counted something: the mean Kolmogorov
        distance between the histogram of all images' ``counts`` ``(N, C, cells + 4)`` (on the bins of
        ``knots`` ``(C, K)``, as :meth:`scan` counts) and the piecewise-linear CDF through ``knots``, at
        the bins' upper edges, and the mean distance between the even and the odd images' histograms
        there; ``(0, 0)`` when no channel counted."""
