"""Streaming AQR's operations in aqr's C kernels (``_stream_kernels.c``, a library of its own).

:class:`NativeStreamKernels` implements :class:`aqr.adapt.stream.base.StreamKernels` for float32
CPU tensors without gradients; :class:`aqr.adapt.stream.torch_kernels.TorchStreamKernels` is the same
in torch. :func:`aqr.backends.build.load_library` builds the library (linked with the per-batch kernels'
thread team, cached by the hash of its sources) on first use; the kernels run on torch's OpenMP team
for large layers and in the calling thread otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from aqr.adapt.stream.base import (COUNT, EDGE_BINS, IMAGE_COUNT, MAP, PAIRED, ClusterScan, PendingGroup, ScanResult,
                                   StreamKernels, StreamTable, TailWindow, check_clusters, check_mixture_weights,
                                   check_pushes, check_scan, cluster_sizes)
from aqr.backends import build, layout
from aqr.backends.base import Affine
from aqr.backends.native import NativeKernelError, native_takes

SOURCE = Path(__file__).with_name("_stream_kernels.c")

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
STATUS = {-1: "could not allocate its scratch memory", -2: "was given sizes or counters out of bounds"}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the stream entry points' argument types on the loaded kernels (idempotent): a descriptor
    (:mod:`aqr.backends.layout`) and the thread count, or, for the three of few arguments, those."""
    structs = lib.structs
    for name in ("scan", "push", "merge", "tables", "group_merge", "merge_map", "large", "idle_rebuild",
                 "cluster_scan", "cluster_push"):
        layout.declare(lib, structs, f"aqr_stream_{name}", f"aqr_stream_{name}_args", _C)
    layout.declare(lib, structs, "aqr_stream_shift_test", "aqr_stream_shift_test_args")
    layout.declare(lib, structs, "aqr_stream_bound_scan", "aqr_stream_layer",
                   ctypes.POINTER(structs["aqr_stream_bound_batch"]), _C)
    layout.declare(lib, structs, "aqr_stream_bound_commit", "aqr_stream_layer",
                   ctypes.POINTER(structs["aqr_stream_bound_commit_args"]), _C)
    lib.aqr_stream_tails.argtypes = [_I, _I, _P, _P, _P, _I, _P, _P]
    lib.aqr_stream_mixture.argtypes = [_I, _I, _I, _P, _P, _I, _P, _C]
    lib.aqr_stream_shift_distances.argtypes = [_I, _I, _I, _P, _P, _I, _P]
    for name in ("tails", "mixture", "shift_distances"):
        getattr(lib, f"aqr_stream_{name}").restype = _C
    return lib


def load(command: list[str], name: str = "aqr_stream_kernels") -> ctypes.CDLL:
    """Build the stream kernels with ``command`` (cached as ``name``), load them and declare their entry points."""
    return declare(build.load_library(command, name, (SOURCE,)))


@functools.lru_cache(maxsize=None)
def load_stream_kernels() -> tuple[ctypes.CDLL | None, str]:
    """The loaded stream kernels (built on first use), or ``None`` and the reason they are unavailable."""
    return build.try_load(load)


def native_stream_kernels() -> ctypes.CDLL | None:
    """The stream kernels, or ``None`` (warning once with the reason) when they cannot be built."""
    lib, reason = load_stream_kernels()
    return build.warned(lib, reason)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(status: int, name: str) -> int:
    if status < 0:
        raise NativeKernelError(f"aqr_stream_{name} {STATUS.get(status, f'failed ({status})')}")
    return status


def _cpu_float(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (itself when it already is one)."""
    if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu", dtype).contiguous()


def _addresses(tensors: list[torch.Tensor], dtype: torch.dtype | None, what: str) -> list[int]:
    """The tensors' addresses for a C call that reads them as they are; ``ValueError`` naming ``what`` unless each
    is a contiguous CPU tensor (of ``dtype``, where given)."""
    addresses = []
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu" or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"{what} is not a contiguous {dtype or ''} tensor on the CPU")
        addresses.append(t.data_ptr())
    return addresses


ROWS = 16  # _stream_kernels.c's STREAM_ROWS: x and y laid out (A, B, C), beside the scan modes


def _layout(x: torch.Tensor, grid: int) -> tuple[torch.Tensor, int]:
    """``x`` (A, C, B) as the kernels read it, and ``ROWS`` where that is the ``(A, B, C)`` layout of a
    channels-last output (each position's channels side by side, read in place) or 0: contiguous (a copy
    of any other layout, and of one whose pair indices, ``C * (grid + 2)``, would not fit in int32)."""
    a, c, b = x.shape
    if x.is_contiguous():
        return x, 0
    if c > 1 and b > 1 and x.transpose(1, 2).is_contiguous() and c * (grid + 2) < 2**31:
        return x, ROWS
    return x.contiguous(), 0


def _group_fields(group: PendingGroup | None) -> dict[str, int | None]:
    """A descriptor's fields for the pending group (its counts, its extremes), NULL without one."""
    if group is None:
        return {"pending": None, "gmin": None, "gmax": None}
    return {"pending": group.counts.data_ptr(), "gmin": group.gmin.data_ptr(), "gmax": group.gmax.data_ptr()}


class NativeStreamKernels(StreamKernels):
    """:class:`~aqr.adapt.stream.base.StreamKernels` in C; the state's tensors must be CPU, float32
    (int32 counts) and contiguous, as :mod:`aqr.adapt.stream.running` allocates them."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib: ctypes.CDLL | None = declare(lib)

    @property
    def lib(self) -> ctypes.CDLL:
        """The loaded kernels. A copy holds no ctypes handle (one cannot be pickled): it loads aqr's build
        of the kernels on first use."""
        if self._lib is None:
            lib, reason = load_stream_kernels()
            if lib is None:
                raise NativeKernelError(f"aqr's stream C kernels are unavailable in this process ({reason})")
            self._lib = declare(lib)
        return self._lib

    def available(self) -> bool:
        """Whether the kernels are loaded or can be (a copy may be unpickled where they cannot be built);
        warns once with the reason where they cannot."""
        return self._lib is not None or native_stream_kernels() is not None

    def __getstate__(self) -> dict[str, object]:
        return {"_lib": None}  # re-loaded on use: a ctypes handle cannot be copied or pickled

    def takes(self, x: torch.Tensor) -> bool:
        return native_takes(x)

    def scan(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
             table: StreamTable, mode: int, stride: int, cells: int) -> ScanResult:
        x, rows = _layout(x, table.grid)  # a channels-last x is read, and y written, in place of its rows
        a, c, b = x.shape
        check_scan(x, images, knots, source, table, mode)
        y = torch.empty_like(x) if mode & MAP else None
        counts = None
        if mode & COUNT:
            counts = torch.empty(c, cells + EDGE_BINS, dtype=torch.int32)
        elif mode & IMAGE_COUNT:
            counts = torch.empty(2 if mode & PAIRED else images, c, cells + EDGE_BINS, dtype=torch.int32)
        lo, hi = torch.empty(images, c), torch.empty(images, c)
        scale, shift = (None, None) if pre is None else pre
        lib = self.lib
        status = _check(lib.aqr_stream_scan(lib.structs["aqr_stream_scan_args"].of(
            x=x.data_ptr(), y=_ptr(y), A=a, C=c, B=b, N=images, pre_scale=_ptr(scale), pre_shift=_ptr(shift),
            K=knots.shape[1], kn=knots.data_ptr(), sq=source.data_ptr(), pairs=table.pairs.data_ptr(), G=table.grid,
            glo=table.glo.data_ptr(), ginv=table.ginv.data_ptr(), stride=stride, GC=cells, counts=_ptr(counts),
            lo=lo.data_ptr(), hi=hi.data_ptr(), mode=mode | rows), torch.get_num_threads()), "scan")
        return ScanResult(y, lo, hi, counts, status == 0)

    def cluster_scan(self, x: torch.Tensor, images: int, pre: Affine | None, source: torch.Tensor,
                     of: torch.Tensor, states: Sequence[tuple[torch.Tensor, StreamTable]], maps: Sequence[bool],
                     blend: float, y: torch.Tensor, stride: int, cells: int) -> ClusterScan:
        # StreamKernels.cluster_scan in one C call (aqr_stream_cluster_scan): the clusters' states passed by address
        x = x.contiguous()
        a, c, b = x.shape
        check_clusters(x, images, source, of, states, maps, blend, y)
        m = len(states)
        addresses = torch.tensor(_addresses([t for knots, table in states
                                             for t in (knots, table.pairs, table.glo, table.ginv)], torch.float32,
                                            "a cluster's state"), dtype=torch.int64)
        flags = torch.tensor(maps, dtype=torch.int32)
        of = of.contiguous()
        counts = torch.empty(m, c, cells + EDGE_BINS, dtype=torch.int32)
        lo, hi = torch.empty(images, c), torch.empty(images, c)
        scale, shift = (None, None) if pre is None else pre
        lib = self.lib
        status = _check(lib.aqr_stream_cluster_scan(lib.structs["aqr_stream_cluster_scan_args"].of(
            x=x.data_ptr(), y=y.data_ptr(), A=a, C=c, B=b, N=images, pre_scale=_ptr(scale), pre_shift=_ptr(shift),
            K=source.shape[1], sq=source.data_ptr(), G=states[0][1].grid, stride=stride, GC=cells, M=m,
            cluster=of.data_ptr(), states=addresses.data_ptr(), maps=flags.data_ptr(), blend=float(blend),
            counts=counts.data_ptr(), lo=lo.data_ptr(), hi=hi.data_ptr()), torch.get_num_threads()), "cluster_scan")
        return ClusterScan(lo, hi, counts, status == 0)

    def cluster_push(self, of: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, counts: torch.Tensor,
                     states: Sequence[tuple[TailWindow, PendingGroup]]) -> list[int]:
        # StreamKernels.cluster_push in one C call (aqr_stream_cluster_push); the windows' counters advanced here
        check_pushes(of, lo, hi, counts, states)
        addresses = torch.tensor(_addresses([t for w, g in states for t in (g.counts, g.gmin, g.gmax, w.ring_lo,
                                                                            w.sorted_lo, w.ring_hi, w.sorted_hi)],
                                            None, "a cluster's window or group"), dtype=torch.int64)
        filled = torch.tensor([w.filled for w, _ in states], dtype=torch.int64)
        head = torch.tensor([w.head for w, _ in states], dtype=torch.int64)
        of, lo, hi, counts = of.contiguous(), _cpu_float(lo), _cpu_float(hi), _cpu_float(counts, torch.int32)
        n, c = lo.shape
        window = states[0][0].size
        lib = self.lib
        _check(lib.aqr_stream_cluster_push(lib.structs["aqr_stream_cluster_push_args"].of(
            C=c, bins=counts.shape[2], W=window, M=len(states), N=n, cluster=of.data_ptr(), lo=lo.data_ptr(),
            hi=hi.data_ptr(), counts=counts.data_ptr(), states=addresses.data_ptr(), filled=filled.data_ptr(),
            head=head.data_ptr()), torch.get_num_threads()), "cluster_push")
        sizes = cluster_sizes(of, len(states))
        for size, (w, _) in zip(sizes, states):
            w.filled = min(w.filled + size, w.size)
            w.head = (w.head + size) % w.size
        return sizes

    def large(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
              table: StreamTable, window: TailWindow, group: PendingGroup, weight: float, tail_weights: torch.Tensor,
              stride: int, cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        # StreamKernels.large in one C call (aqr_stream_large): the same operations in the same order, without
        # six calls' arguments and the state's copies made in torch; a channels-last x read in place
        x, rows = _layout(x, table.grid)
        check_scan(x, images, knots, source, table, COUNT)
        middle = dict(pairs=table.pairs.data_ptr(), G=table.grid, glo=table.glo.data_ptr(),
                      ginv=table.ginv.data_ptr(), stride=stride, GC=cells, rows=rows)
        return self._merged("large", x, images, pre, knots, source, middle, window, group, weight, tail_weights)

    def merge_map(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
                  grid: int, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, weight: float, tail_weights: torch.Tensor, stride: int,
                  cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        x, rows = _layout(x, grid)
        a, c, _ = x.shape
        if images < 1 or a % images or knots.shape[0] != c or source.shape != knots.shape:
            raise ValueError(f"merge_map: a layer output {tuple(x.shape)} of {images} images for knots "
                             f"{tuple(knots.shape)} and source knots {tuple(source.shape)}")
        counts = _cpu_float(counts, torch.int32)
        lo, hi = _cpu_float(lo), _cpu_float(hi)
        if counts.shape != (c, cells + EDGE_BINS) or lo.shape != (images, c) or hi.shape != (images, c):
            raise ValueError(f"merge_map: counts {tuple(counts.shape)} and extremes {tuple(lo.shape)}, "
                             f"{tuple(hi.shape)} for {images} images of {c} channels and {cells} cells")
        middle = dict(G=grid, stride=stride, GC=cells, counts=counts.data_ptr(), lo=lo.data_ptr(), hi=hi.data_ptr(),
                      rows=rows)
        return self._merged("merge_map", x, images, pre, knots, source, middle, window, group, weight, tail_weights)

    def large_flagged(self, *args: object) -> tuple[torch.Tensor | None, torch.Tensor | None, TailWindow | None, bool]:
        # the C kernels' flag is read on the CPU anyway: large's answer with it
        done = self.large(*args)  # type: ignore[arg-type]
        return (None, None, None, False) if done is None else (*done, True)

    def merge_map_flagged(self, *args: object) -> tuple[torch.Tensor | None, torch.Tensor | None, TailWindow | None,
                                                        bool]:
        done = self.merge_map(*args)  # type: ignore[arg-type]
        return (None, None, None, False) if done is None else (*done, True)

    def _merged(self, name: str, x: torch.Tensor, images: int, pre: Affine | None,
                knots: torch.Tensor, source: torch.Tensor, middle: dict[str, int], window: TailWindow,
                group: PendingGroup | None, weight: float,
                tail_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        """Call ``aqr_stream_large`` or ``aqr_stream_merge_map`` (``name``; ``middle``: the fields of their
        descriptors that differ) with new buffers for the map and the knots' and the window's copies."""
        a, c, b = x.shape
        size = window.size
        filled = min(window.filled + images, size)
        tail_weights = _cpu_float(tail_weights, torch.float64)
        if not 1 <= len(tail_weights) <= filled:
            raise ValueError(f"{len(tail_weights)} tail weights for a window holding {filled} images")
        y, knots_out = torch.empty_like(x), torch.empty_like(knots)
        out = TailWindow(torch.empty_like(window.ring_lo), torch.empty_like(window.sorted_lo),
                         torch.empty_like(window.ring_hi), torch.empty_like(window.sorted_hi), filled,
                         (window.head + images) % size)
        scale, shift = (None, None) if pre is None else pre
        lib = self.lib
        status = _check(getattr(lib, f"aqr_stream_{name}")(lib.structs[f"aqr_stream_{name}_args"].of(
            x=x.data_ptr(), y=y.data_ptr(), A=a, C=c, B=b, N=images, pre_scale=_ptr(scale), pre_shift=_ptr(shift),
            K=knots.shape[1], kn=knots.data_ptr(), sq=source.data_ptr(), **middle, **_group_fields(group), W=size,
            ring_lo=window.ring_lo.data_ptr(), sorted_lo=window.sorted_lo.data_ptr(),
            ring_hi=window.ring_hi.data_ptr(), sorted_hi=window.sorted_hi.data_ptr(), filled=window.filled,
            head=window.head, w=tail_weights.data_ptr(), nw=len(tail_weights), weight=float(weight),
            kn_out=knots_out.data_ptr(), ring_lo_out=out.ring_lo.data_ptr(), sorted_lo_out=out.sorted_lo.data_ptr(),
            ring_hi_out=out.ring_hi.data_ptr(), sorted_hi_out=out.sorted_hi.data_ptr()), torch.get_num_threads()), name)
        return (y, knots_out, out) if status == 0 else None

    def idle_rebuild(self, marginal: torch.Tensor, knots: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                     gmax: torch.Tensor, weight: float, window: TailWindow, tail_weights: torch.Tensor) -> None:
        # StreamKernels.idle_rebuild in one C call (aqr_stream_idle_rebuild): the same operations in order
        c, k = knots.shape
        if marginal.shape != (c, k) or counts.dim() != 2 or counts.shape[0] != c or gmin.shape != (c,) \
                or gmax.shape != (c,) or not marginal.is_contiguous() or not knots.is_contiguous():
            raise ValueError(f"idle_rebuild: knots {tuple(knots.shape)}, marginal {tuple(marginal.shape)}, counts "
                             f"{tuple(counts.shape)}, extremes {tuple(gmin.shape)} and {tuple(gmax.shape)}")
        counts, gmin, gmax = _cpu_float(counts, torch.int32), _cpu_float(gmin), _cpu_float(gmax)
        tail_weights = _cpu_float(tail_weights, torch.float64)
        if not 1 <= len(tail_weights) <= window.filled:
            raise ValueError(f"{len(tail_weights)} tail weights for a window holding {window.filled} images")
        lib = self.lib
        _check(lib.aqr_stream_idle_rebuild(lib.structs["aqr_stream_idle_rebuild_args"].of(
            C=c, K=k, mg=marginal.data_ptr(), kn=knots.data_ptr(), counts=counts.data_ptr(),
            GC=counts.shape[1] - EDGE_BINS, gmin=gmin.data_ptr(), gmax=gmax.data_ptr(), weight=float(weight),
            W=window.size, sorted_lo=window.sorted_lo.data_ptr(), sorted_hi=window.sorted_hi.data_ptr(),
            w=tail_weights.data_ptr(), nw=len(tail_weights)), torch.get_num_threads()), "idle_rebuild")

    def bind(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable, window: TailWindow,
             group: PendingGroup, stride: int, cells: int) -> BoundStream:
        return BoundStream(self, knots, source, table, window, group, stride, cells)

    def push(self, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor | None,
             lo: torch.Tensor, hi: torch.Tensor) -> None:
        n, c = lo.shape
        lo, hi = _cpu_float(lo), _cpu_float(hi)
        counts = None if counts is None else _cpu_float(counts, torch.int32)
        bins = 0 if group is None else group.counts.shape[1]
        lib = self.lib
        _check(lib.aqr_stream_push(lib.structs["aqr_stream_push_args"].of(
            C=c, bins=bins, counts=_ptr(counts), lo=lo.data_ptr(), hi=hi.data_ptr(), N=n, **_group_fields(group),
            W=window.size, ring_lo=window.ring_lo.data_ptr(), sorted_lo=window.sorted_lo.data_ptr(),
            ring_hi=window.ring_hi.data_ptr(), sorted_hi=window.sorted_hi.data_ptr(), filled=window.filled,
            head=window.head), torch.get_num_threads()), "push")
        window.filled = min(window.filled + n, window.size)
        window.head = (window.head + n) % window.size

    def tails(self, window: TailWindow, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = window.sorted_lo.shape[0]
        weights = _cpu_float(weights, torch.float64)
        if len(weights) > window.filled:
            raise ValueError(f"{len(weights)} tail weights for a window holding {window.filled} images")
        p0, p100 = torch.empty(c), torch.empty(c)
        _check(self.lib.aqr_stream_tails(c, window.size, window.sorted_lo.data_ptr(), window.sorted_hi.data_ptr(),
                                         weights.data_ptr(), len(weights), p0.data_ptr(), p100.data_ptr()), "tails")
        return p0, p100

    def merge(self, knots: torch.Tensor, group: PendingGroup | None, weight: float, p0: torch.Tensor,
              p100: torch.Tensor) -> None:
        c, k = knots.shape
        p0, p100 = _cpu_float(p0), _cpu_float(p100)
        cells = 1 if group is None else group.cells
        lib = self.lib
        pending = _group_fields(group)
        _check(lib.aqr_stream_merge(lib.structs["aqr_stream_merge_args"].of(
            C=c, K=k, kn=knots.data_ptr(), counts=pending["pending"], GC=cells, gmin=pending["gmin"],
            gmax=pending["gmax"], w=float(weight), p0=p0.data_ptr(), p100=p100.data_ptr()), torch.get_num_threads()),
            "merge")

    def tables(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable) -> None:
        c, k = knots.shape
        lib = self.lib
        _check(lib.aqr_stream_tables(lib.structs["aqr_stream_tables_args"].of(
            C=c, K=k, kn=knots.data_ptr(), sq=source.data_ptr(), G=table.grid, pairs=table.pairs.data_ptr(),
            glo=table.glo.data_ptr(), ginv=table.ginv.data_ptr()), torch.get_num_threads()), "tables")

    def group_merge(self, knots: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                    gmax: torch.Tensor, weights: torch.Tensor) -> None:
        r, k = knots.shape
        if bins.shape != (r, k) or counts.dim() != 2 or counts.shape[0] != r or gmin.shape != (r,) or gmax.shape != (r,) \
                or weights.shape != (r,):
            raise ValueError(f"group_merge: {r} rows of knots, bins {tuple(bins.shape)}, counts "
                             f"{tuple(counts.shape)}, extremes {tuple(gmin.shape)}, weights {tuple(weights.shape)}")
        bins, counts = _cpu_float(bins), _cpu_float(counts, torch.int32)
        gmin, gmax, weights = _cpu_float(gmin), _cpu_float(gmax), _cpu_float(weights, torch.float64)
        lib = self.lib
        _check(lib.aqr_stream_group_merge(lib.structs["aqr_stream_group_merge_args"].of(
            R=r, K=k, gk=knots.data_ptr(), bk=bins.data_ptr(), counts=counts.data_ptr(), GC=counts.shape[1] - EDGE_BINS,
            gmin=gmin.data_ptr(), gmax=gmax.data_ptr(), w=weights.data_ptr()), torch.get_num_threads()), "group_merge")

    def mixture(self, groups: torch.Tensor, knots: torch.Tensor, grid: int,
                weights: torch.Tensor | None = None) -> None:
        m, c, k = groups.shape
        if knots.shape != (c, k):
            raise ValueError(f"mixture: groups of {c} channels and {k} knots for knots {tuple(knots.shape)}")
        check_mixture_weights(weights, m)
        if weights is not None:
            weights = weights.detach().to("cpu", torch.float64).contiguous()
        groups = _cpu_float(groups)
        _check(self.lib.aqr_stream_mixture(m, c, k, groups.data_ptr(), _ptr(weights), grid, knots.data_ptr(),
                                           torch.get_num_threads()), "mixture")

    def shift_test(self, counts: torch.Tensor, knots: torch.Tensor,
                   small: bool) -> tuple[tuple[float, float], torch.Tensor, torch.Tensor]:
        # StreamKernels.shift_test in one C pass over the counts (aqr_stream_shift_test)
        n, c, bins = counts.shape if counts.dim() == 3 else (0, 0, 0)
        if counts.dim() != 3 or (c, knots.shape[1]) != tuple(knots.shape) or bins <= EDGE_BINS:
            raise ValueError(f"shift_test: counts {tuple(counts.shape)} for knots {tuple(knots.shape)}")
        counts, knots = _cpu_float(counts, torch.int32), _cpu_float(knots)
        total = torch.empty(c, bins, dtype=torch.int32)
        compact = torch.empty(n, c, bins, dtype=torch.int16) if small else counts
        out = (ctypes.c_double * 2)()
        lib = self.lib
        _check(lib.aqr_stream_shift_test(lib.structs["aqr_stream_shift_test_args"].of(
            N=n, C=c, K=knots.shape[1], kn=knots.data_ptr(), counts=counts.data_ptr(), GC=bins - EDGE_BINS,
            out=ctypes.addressof(out), total=total.data_ptr(), small=compact.data_ptr() if small else None)),
            "shift_test")
        return (out[0], out[1]), total, compact

    def shift_distances(self, counts: torch.Tensor, knots: torch.Tensor) -> tuple[float, float]:
        c, k = knots.shape
        if counts.dim() != 3 or counts.shape[1] != c or counts.shape[2] <= EDGE_BINS:
            raise ValueError(f"shift_distances: counts {tuple(counts.shape)} for knots {tuple(knots.shape)}")
        counts, knots = _cpu_float(counts, torch.int32), _cpu_float(knots)
        out = (ctypes.c_double * 2)()
        _check(self.lib.aqr_stream_shift_distances(counts.shape[0], c, k, knots.data_ptr(), counts.data_ptr(),
                                                   counts.shape[2] - EDGE_BINS, ctypes.addressof(out)),
               "shift_distances")
        return out[0], out[1]


def _state_buffer(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str) -> int:
    """The address of the state buffer ``t``, checked to be a contiguous CPU tensor of ``dtype`` and ``shape``."""
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"stream state {name!r}: {tuple(t.shape)} {t.dtype} on {t.device}, expected a contiguous "
                         f"CPU tensor {shape} {dtype}")
    return t.data_ptr()


class BoundStream:
    """One layer's running state bound to the C kernels for the two calls of a batch of fewer than
    ``rebuild_every`` images (:meth:`map_count`, then :meth:`commit`), with its buffers' addresses and
    sizes taken and checked once, into the descriptor the C side reads (``aqr_stream_bound_scan``,
    ``aqr_stream_bound_commit``). The running state changes its buffers in place only
    (:mod:`aqr.adapt.stream.running`), so the addresses stay valid; the bound state holds the tensors."""

    def __init__(self, kernels: NativeStreamKernels, knots: torch.Tensor, source: torch.Tensor, table: StreamTable,
                 window: TailWindow, group: PendingGroup, stride: int, cells: int) -> None:
        c, k = knots.shape
        g, w, bins = table.grid, window.size, cells + EDGE_BINS
        f32 = torch.float32
        self.kernels = kernels
        lib = kernels.lib
        self._scan_fn, self._commit_fn = lib.aqr_stream_bound_scan, lib.aqr_stream_bound_commit
        self._batch, self._commit = lib.structs["aqr_stream_bound_batch"], lib.structs["aqr_stream_bound_commit_args"]
        self.channels, self.bins, self.grid = c, bins, g
        self._tensors = (knots, source, table, window, group)  # the buffers whose addresses are used below
        self._window = window
        # a committed stage, which the next scan of as many images reuses (allocating and freeing one stage
        # per layer and image cost about 1.5 us each)
        self._spare: torch.Tensor | None = None
        # read-only once made: the running state changes its buffers in place only, so the addresses stay valid
        self._descriptor = lib.structs["aqr_stream_layer"].of(
            C=c, K=k, G=g, GC=cells, W=w, stride=stride, kn=_state_buffer(knots, f32, (c, k), "knots"),
            sq=_state_buffer(source, f32, (c, k), "source"),
            pairs=_state_buffer(table.pairs, f32, (c, g + 2, 2), "table.pairs"),
            glo=_state_buffer(table.glo, f32, (c,), "table.glo"), ginv=_state_buffer(table.ginv, f32, (c,), "table.ginv"),
            pending=_state_buffer(group.counts, torch.int32, (c, bins), "group.counts"),
            gmin=_state_buffer(group.gmin, f32, (c,), "group.gmin"), gmax=_state_buffer(group.gmax, f32, (c,), "group.gmax"),
            ring_lo=_state_buffer(window.ring_lo, f32, (w, c), "window.ring_lo"),
            sorted_lo=_state_buffer(window.sorted_lo, f32, (c, w), "window.sorted_lo"),
            ring_hi=_state_buffer(window.ring_hi, f32, (w, c), "window.ring_hi"),
            sorted_hi=_state_buffer(window.sorted_hi, f32, (c, w), "window.sorted_hi"))

    def stage_floats(self, images: int) -> int:
        """The floats a batch of ``images`` images stages: its extremes ``(2, images, C)``, then its counts
        ``(C, cells + 4)`` (int32, in float32's place)."""
        return self.channels * (2 * images + self.bins)

    def map_count(self, x: torch.Tensor, images: int, pre: Affine) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`NativeStreamKernels.scan` of ``x`` with ``MAP | COUNT`` on the bound state: ``x`` a float32
        CPU tensor ``(A, C, ...)`` of at least one value (another layout than contiguous is copied: at batch 1
        reading channels-last rows in place was slower than the copy), read as ``(A, C, B)``, and ``pre`` an
        affine of contiguous float32 CPU tensors ``(C,)`` (the caller's to ensure). Returns ``y`` shaped and laid out as ``x``, the
        staged extremes and counts (:meth:`stage_floats`, for :meth:`commit`; the buffer of the last batch
        committed, where it has the size) and whether every value was finite."""
        shape = x.shape
        a, c = shape[0], self.channels
        if shape[1] != c or images < 1 or a % images:
            raise ValueError(f"a layer output {tuple(shape)} for a streaming state of {c} channels and a batch "
                             f"of {images} images (streaming AQR needs the batch dimension first)")
        x = x.contiguous()
        y = torch.empty_like(x)
        stage, floats = self._spare, self.stage_floats(images)
        if stage is not None and stage.numel() == floats:
            self._spare = None  # this batch's now (a second scan before its commit allocates its own)
        else:
            stage = torch.empty(floats)
        batch = self._batch.of(x=x.data_ptr(), y=y.data_ptr(), A=a, B=x.numel() // (a * c), N=images,
                               pre_scale=pre[0].data_ptr(), pre_shift=pre[1].data_ptr(), stage=stage.data_ptr())
        status = self._scan_fn(self._descriptor, batch, torch.get_num_threads())
        if status < 0:
            _check(status, "bound_scan")
        return y if y.shape == shape else y.view(shape), stage, status == 0

    def staged_parts(self, stage: torch.Tensor, images: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lo, hi, counts)`` of a batch's ``stage`` from :meth:`map_count` (views)."""
        c, n = self.channels, images * self.channels
        return stage[:n].view(images, c), stage[n:2 * n].view(images, c), stage[2 * n:].view(torch.int32).view(c, -1)

    def commit(self, stage: torch.Tensor, images: int, rebuild: tuple[float, torch.Tensor] | None) -> None:
        """The push of what :meth:`map_count` staged for ``images`` images into the group and the window
        and, with ``rebuild`` = ``(weight, tail_weights)``, the rebuild after it, in one call: the window's
        :meth:`~NativeStreamKernels.tails` by ``tail_weights``, the group merged into the knots at ``weight``
        (:meth:`~NativeStreamKernels.merge`), the table built (:meth:`~NativeStreamKernels.tables`) and the
        group's counts and extremes cleared (its image count is the caller's). The same values as those calls."""
        window = self._window
        size = window.size
        if (stage.numel() != self.stage_floats(images) or stage.dtype != torch.float32 or not stage.is_cpu
                or not stage.is_contiguous()):  # the C side reads it, and the next scan writes it, as one block
            raise ValueError(f"a stage of {stage.numel()} {stage.dtype} values ({stage.device}, contiguous: "
                             f"{stage.is_contiguous()}) for {images} images of {self.channels} channels: "
                             f"map_count's stage is one contiguous float32 CPU block")
        if rebuild is None:
            commit = self._commit.of(filled=window.filled, head=window.head, stage=stage.data_ptr(), N=images,
                                     rebuild=0, weight=0.0, tail_w=None, ntail=0)
        else:
            tail = _cpu_float(rebuild[1], torch.float64)
            commit = self._commit.of(filled=window.filled, head=window.head, stage=stage.data_ptr(), N=images,
                                     rebuild=1, weight=float(rebuild[0]), tail_w=tail.data_ptr(), ntail=len(tail))
        status = self._commit_fn(self._descriptor, commit, torch.get_num_threads())
        _check(status, "bound_commit")
        window.filled = min(window.filled + images, size)
        window.head = (window.head + images) % size
        self._spare = stage  # committed: the next batch's scan stages into it
