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
from pathlib import Path

import torch

from aqr.adapt.stream.base import (COUNT, EDGE_BINS, IMAGE_COUNT, MAP, PAIRED, PendingGroup, ScanResult,
                                   StreamKernels, StreamTable, TailWindow, check_mixture_weights, check_scan)
from aqr.backends import build
from aqr.backends.base import Affine
from aqr.backends.native import NativeKernelError, native_takes

SOURCE = Path(__file__).with_name("_stream_kernels.c")

_P, _I, _D, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
STATUS = {-1: "could not allocate its scratch memory", -2: "was given sizes or counters out of bounds"}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the stream entry points' argument types on the loaded kernels (idempotent)."""
    lib.aqr_stream_scan.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _P, _P,
                                    _P, _C, _C]
    lib.aqr_stream_push.argtypes = [_I, _I, _I, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _C]
    lib.aqr_stream_tails.argtypes = [_I, _I, _P, _P, _P, _I, _P, _P]
    lib.aqr_stream_merge.argtypes = [_I, _I, _P, _P, _I, _P, _P, _D, _P, _P, _C]
    lib.aqr_stream_tables.argtypes = [_I, _I, _P, _P, _I, _P, _P, _P, _C]
    lib.aqr_stream_group_merge.argtypes = [_I, _I, _P, _P, _P, _I, _P, _P, _P, _C]
    lib.aqr_stream_mixture.argtypes = [_I, _I, _I, _P, _P, _I, _P, _C]
    lib.aqr_stream_shift_distances.argtypes = [_I, _I, _I, _P, _P, _I, _P]
    window = [_I, _P, _P, _P, _P, _I, _I, _P, _I, _D, _P, _P, _P, _P, _P, _C]  # the window .. the copies, threads
    lib.aqr_stream_large.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _P, _P, _P,
                                     *window]
    lib.aqr_stream_merge_map.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P,
                                         *window]
    lib.aqr_stream_shift_test.argtypes = [_I, _I, _I, _P, _P, _I, _P, _P, _P]
    lib.aqr_stream_idle_rebuild.argtypes = [_I, _I, _P, _P, _P, _I, _P, _P, _D, _I, _P, _P, _P, _I, _C]
    lib.aqr_stream_bound_fields.restype = _I
    lib.aqr_stream_bound_fields.argtypes = []
    lib.aqr_stream_bound_scan.argtypes = [_P, _P, _P, _I, _I, _I, _P, _P, _P, _C]
    lib.aqr_stream_bound_commit.argtypes = [_P, _I, _I, _P, _I, _C, _D, _P, _I, _C]
    for name in ("scan", "push", "tails", "merge", "tables", "group_merge", "mixture", "shift_distances", "large",
                 "merge_map", "idle_rebuild", "shift_test"):
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
        x = x.contiguous()
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
        status = _check(self.lib.aqr_stream_scan(
            x.data_ptr(), _ptr(y), a, c, b, images, _ptr(scale), _ptr(shift), knots.shape[1], knots.data_ptr(),
            source.data_ptr(), table.pairs.data_ptr(), table.grid, table.glo.data_ptr(), table.ginv.data_ptr(),
            stride, cells, _ptr(counts), lo.data_ptr(), hi.data_ptr(), mode,
            torch.get_num_threads()), "scan")
        return ScanResult(y, lo, hi, counts, status == 0)

    def large(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
              table: StreamTable, window: TailWindow, group: PendingGroup, weight: float, tail_weights: torch.Tensor,
              stride: int, cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        # StreamKernels.large in one C call (aqr_stream_large): the same operations in the same order, without
        # six calls' arguments and the state's copies made in torch
        x = x.contiguous()
        check_scan(x, images, knots, source, table, COUNT)
        middle = (table.pairs.data_ptr(), table.grid, table.glo.data_ptr(), table.ginv.data_ptr(), stride, cells)
        return self._merged(self.lib.aqr_stream_large, "large", x, images, pre, knots, source, middle, window, group,
                            weight, tail_weights)

    def merge_map(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
                  grid: int, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, weight: float, tail_weights: torch.Tensor, stride: int,
                  cells: int) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        x = x.contiguous()
        a, c, _ = x.shape
        if images < 1 or a % images or knots.shape[0] != c or source.shape != knots.shape:
            raise ValueError(f"merge_map: a layer output {tuple(x.shape)} of {images} images for knots "
                             f"{tuple(knots.shape)} and source knots {tuple(source.shape)}")
        counts = _cpu_float(counts, torch.int32)
        lo, hi = _cpu_float(lo), _cpu_float(hi)
        if counts.shape != (c, cells + EDGE_BINS) or lo.shape != (images, c) or hi.shape != (images, c):
            raise ValueError(f"merge_map: counts {tuple(counts.shape)} and extremes {tuple(lo.shape)}, "
                             f"{tuple(hi.shape)} for {images} images of {c} channels and {cells} cells")
        middle = (grid, stride, cells, counts.data_ptr(), lo.data_ptr(), hi.data_ptr())
        return self._merged(self.lib.aqr_stream_merge_map, "merge_map", x, images, pre, knots, source, middle, window,
                            group, weight, tail_weights)

    def _merged(self, function: object, name: str, x: torch.Tensor, images: int, pre: Affine | None,
                knots: torch.Tensor, source: torch.Tensor, middle: tuple[int, ...], window: TailWindow,
                group: PendingGroup | None, weight: float,
                tail_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, TailWindow] | None:
        """Call ``aqr_stream_large`` or ``aqr_stream_merge_map`` (``function``; ``middle``: their arguments between
        the source knots and the group, which differ) with new buffers for the map and the knots' and the
        window's copies."""
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
        pending = (None, None, None)
        if group is not None:
            pending = (group.counts.data_ptr(), group.gmin.data_ptr(), group.gmax.data_ptr())
        status = _check(function(  # type: ignore[operator]
            x.data_ptr(), y.data_ptr(), a, c, b, images, _ptr(scale), _ptr(shift), knots.shape[1], knots.data_ptr(),
            source.data_ptr(), *middle, *pending, size, window.ring_lo.data_ptr(),
            window.sorted_lo.data_ptr(), window.ring_hi.data_ptr(), window.sorted_hi.data_ptr(), window.filled,
            window.head, tail_weights.data_ptr(), len(tail_weights), float(weight), knots_out.data_ptr(),
            out.ring_lo.data_ptr(), out.sorted_lo.data_ptr(), out.ring_hi.data_ptr(), out.sorted_hi.data_ptr(),
            torch.get_num_threads()), name)
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
        _check(self.lib.aqr_stream_idle_rebuild(
            c, k, marginal.data_ptr(), knots.data_ptr(), counts.data_ptr(), counts.shape[1] - EDGE_BINS,
            gmin.data_ptr(), gmax.data_ptr(), float(weight), window.size, window.sorted_lo.data_ptr(),
            window.sorted_hi.data_ptr(), tail_weights.data_ptr(), len(tail_weights), torch.get_num_threads()),
            "idle_rebuild")

    def bind(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable, window: TailWindow,
             group: PendingGroup, stride: int, cells: int) -> BoundStream:
        return BoundStream(self, knots, source, table, window, group, stride, cells)

    def push(self, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor | None,
             lo: torch.Tensor, hi: torch.Tensor) -> None:
        n, c = lo.shape
        lo, hi = _cpu_float(lo), _cpu_float(hi)
        counts = None if counts is None else _cpu_float(counts, torch.int32)
        bins = 0 if group is None else group.counts.shape[1]
        _check(self.lib.aqr_stream_push(
            c, bins, window.size, None if group is None else group.counts.data_ptr(), _ptr(counts),
            None if group is None else group.gmin.data_ptr(), None if group is None else group.gmax.data_ptr(),
            lo.data_ptr(), hi.data_ptr(), n, window.ring_lo.data_ptr(), window.sorted_lo.data_ptr(),
            window.ring_hi.data_ptr(), window.sorted_hi.data_ptr(), window.filled, window.head,
            torch.get_num_threads()), "push")
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
        _check(self.lib.aqr_stream_merge(
            c, k, knots.data_ptr(), None if group is None else group.counts.data_ptr(), cells,
            None if group is None else group.gmin.data_ptr(), None if group is None else group.gmax.data_ptr(),
            float(weight), p0.data_ptr(), p100.data_ptr(), torch.get_num_threads()), "merge")

    def tables(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable) -> None:
        c, k = knots.shape
        _check(self.lib.aqr_stream_tables(c, k, knots.data_ptr(), source.data_ptr(), table.grid,
                                          table.pairs.data_ptr(), table.glo.data_ptr(), table.ginv.data_ptr(),
                                          torch.get_num_threads()), "tables")

    def group_merge(self, knots: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                    gmax: torch.Tensor, weights: torch.Tensor) -> None:
        r, k = knots.shape
        if bins.shape != (r, k) or counts.dim() != 2 or counts.shape[0] != r or gmin.shape != (r,) or gmax.shape != (r,) \
                or weights.shape != (r,):
            raise ValueError(f"group_merge: {r} rows of knots, bins {tuple(bins.shape)}, counts "
                             f"{tuple(counts.shape)}, extremes {tuple(gmin.shape)}, weights {tuple(weights.shape)}")
        bins, counts = _cpu_float(bins), _cpu_float(counts, torch.int32)
        gmin, gmax, weights = _cpu_float(gmin), _cpu_float(gmax), _cpu_float(weights, torch.float64)
        _check(self.lib.aqr_stream_group_merge(r, k, knots.data_ptr(), bins.data_ptr(), counts.data_ptr(),
                                               counts.shape[1] - EDGE_BINS, gmin.data_ptr(), gmax.data_ptr(),
                                               weights.data_ptr(), torch.get_num_threads()), "group_merge")

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
        _check(self.lib.aqr_stream_shift_test(n, c, knots.shape[1], knots.data_ptr(), counts.data_ptr(),
                                              bins - EDGE_BINS, ctypes.addressof(out), total.data_ptr(),
                                              compact.data_ptr() if small else None), "shift_test")
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
        self.channels, self.bins = c, bins
        self._tensors = (knots, source, table, window, group)  # the buffers whose addresses are used below
        self._window = window
        # a committed stage, which the next scan of as many images reuses (allocating and freeing one stage
        # per layer and image cost about 1.5 us each)
        self._spare: torch.Tensor | None = None
        fields = (c, k, g, cells, w, stride,
                  _state_buffer(knots, f32, (c, k), "knots"), _state_buffer(source, f32, (c, k), "source"),
                  _state_buffer(table.pairs, f32, (c, g + 2, 2), "table.pairs"),
                  _state_buffer(table.glo, f32, (c,), "table.glo"), _state_buffer(table.ginv, f32, (c,), "table.ginv"),
                  _state_buffer(group.counts, torch.int32, (c, bins), "group.counts"),
                  _state_buffer(group.gmin, f32, (c,), "group.gmin"), _state_buffer(group.gmax, f32, (c,), "group.gmax"),
                  _state_buffer(window.ring_lo, f32, (w, c), "window.ring_lo"),
                  _state_buffer(window.sorted_lo, f32, (c, w), "window.sorted_lo"),
                  _state_buffer(window.ring_hi, f32, (w, c), "window.ring_hi"),
                  _state_buffer(window.sorted_hi, f32, (c, w), "window.sorted_hi"))
        if len(fields) != lib.aqr_stream_bound_fields():
            raise NativeKernelError(f"aqr_stream_bound_fields: the C kernels read {lib.aqr_stream_bound_fields()} "
                                    f"fields of a bound stream, this module writes {len(fields)}")
        self._fields = (ctypes.c_int64 * len(fields))(*fields)
        self._descriptor = _P(ctypes.addressof(self._fields))  # passed as it is, not converted on every call

    def stage_floats(self, images: int) -> int:
        """The floats a batch of ``images`` images stages: its extremes ``(2, images, C)``, then its counts
        ``(C, cells + 4)`` (int32, in float32's place)."""
        return self.channels * (2 * images + self.bins)

    def map_count(self, x: torch.Tensor, images: int, pre: Affine) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`NativeStreamKernels.scan` of ``x`` with ``MAP | COUNT`` on the bound state: ``x`` a contiguous
        float32 CPU tensor ``(A, C, ...)`` of at least one value, read as ``(A, C, B)``, and ``pre`` an
        affine of contiguous float32 CPU tensors ``(C,)`` (the caller's to ensure). Returns ``y`` shaped as
        ``x``, the staged extremes and counts (:meth:`stage_floats`, for :meth:`commit`; the buffer of the
        last batch committed, where it has the size) and whether every value was finite."""
        shape = x.shape
        a, c = shape[0], self.channels
        if shape[1] != c or images < 1 or a % images:
            raise ValueError(f"a layer output {tuple(shape)} for a streaming state of {c} channels and a batch "
                             f"of {images} images (streaming AQR needs the batch dimension first)")
        y = torch.empty_like(x)
        stage, floats = self._spare, self.stage_floats(images)
        if stage is not None and stage.numel() == floats:
            self._spare = None  # this batch's now (a second scan before its commit allocates its own)
        else:
            stage = torch.empty(floats)
        status = self._scan_fn(self._descriptor, x.data_ptr(), y.data_ptr(), a, x.numel() // (a * c), images,
                               pre[0].data_ptr(), pre[1].data_ptr(), stage.data_ptr(), torch.get_num_threads())
        if status < 0:
            _check(status, "bound_scan")
        return y, stage, status == 0

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
            status = self._commit_fn(self._descriptor, window.filled, window.head, stage.data_ptr(), images, 0, 0.0,
                                     None, 0, torch.get_num_threads())
        else:
            tail = _cpu_float(rebuild[1], torch.float64)
            status = self._commit_fn(self._descriptor, window.filled, window.head, stage.data_ptr(), images, 1,
                                     float(rebuild[0]), tail.data_ptr(), len(tail), torch.get_num_threads())
        _check(status, "bound_commit")
        window.filled = min(window.filled + images, size)
        window.head = (window.head + images) % size
        self._spare = stage  # committed: the next batch's scan stages into it
