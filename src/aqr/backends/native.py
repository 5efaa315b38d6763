"""The fast path in aqr's C kernels on CPU (float32, no autograd): :class:`NativeBackend`.

Two calls per layer replace the sort, the table and the compiled map of the torch backend:

* :func:`subset_quantiles`: the quantiles of each channel's sampled positions, read from a
  histogram of ``S / 2`` equal-width buckets. Each inner knot is within one bucket width (and its
  rank within ``S / 256``) of the sorted sample's; a bucket holding more values than that (ties,
  outliers) is sorted, so its knots are exact, and samples of up to 512 values are sorted whole.
  p0 and p100 are the extremes of every value of the channel, as in the exact path.
* :func:`table_map`: builds each channel's lookup table and maps the channel while the table is
  in cache, one 64-bit gather per (slope, intercept) pair where the CPU has AVX2. An eval-mode
  BatchNorm's affine step can be folded into both calls (``pre``).

For channel-major layouts :func:`recalibrate` does both in one pass per channel. On ResNet-20 at
batch 128 the kernels take about 45 ms per batch on 2 cores, against about 95 ms for the compiled
torch path. :mod:`aqr.backends.build` compiles and loads the library.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from aqr.backends.base import TAIL_CODES, Affine, LayerBackend, LayerSource, Targets
from aqr.backends.subsets import SubsetCache
from aqr.core.layers import as_acb
from aqr.core.qmap import PARAMETRIC_TAILS, quantile_levels

ROWS_LAYOUT_BELOW = 16  # as in _kernels.c: fewer values per (row, channel) count as channels-last


class NativeKernelError(RuntimeError):
    """A C kernel could not run: its scratch memory could not be allocated, or it refused its arguments."""


def _check(status: int, kernel: str, what: str) -> None:
    """Raise :class:`NativeKernelError` for a kernel's nonzero status (-1: no memory, -2: bad arguments)."""
    if status == -1:
        raise NativeKernelError(f"{kernel} could not allocate scratch memory for {what}")
    if status != 0:
        raise NativeKernelError(f"{kernel} refused its arguments ({what}): sizes, positions, ranks or tail code out of bounds")


@functools.lru_cache(maxsize=64)
def _ranks(samples: int, num_quantiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Type-7 interpolation of ``samples`` sorted values at the K levels, as :func:`aqr.core.qmap.sorted_quantiles`."""
    pos = quantile_levels(num_quantiles) * (samples - 1)
    lo = pos.floor().long().clamp_(0, samples - 1)
    return lo, (pos - lo.to(pos.dtype)).float()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _ptr_or_null(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _affine_ptrs(pre: Affine | None) -> tuple[int | None, int | None]:
    return (None, None) if pre is None else (_ptr(pre[0]), _ptr(pre[1]))


def _histogram(samples: int) -> tuple[int, int]:
    """Buckets of the sample's histogram (two values each on average) and :func:`crowded_bucket`."""
    return max(16, samples // 2), crowded_bucket(samples)


def crowded_bucket(samples: int) -> int:
    """Buckets holding more sampled values than this are sorted rather than interpolated.

    ``samples / 256`` bounds the rank error of an interpolated order statistic at 0.4 % of the
    sample (a third of DKW's 95 % bound at 8,192 values); samples of up to 512 values are sorted
    whole, so small layers get exact quantiles, ties included.
    """
    return max(8, samples // 256) if samples > 512 else 0


def _tail_code(source: LayerSource, moments: bool) -> int:
    """The kernels' code for the source's tail, after checking that what it reads is given (a NULL would crash)."""
    tail = source.tail
    if tail not in TAIL_CODES:
        raise ValueError(f"unknown tail strategy {tail!r}")
    if tail in PARAMETRIC_TAILS and (
        not moments or source.scale is None or (tail == "gaussian" and (source.loc is None or source.z is None))
    ):
        raise ValueError(f'tail="{tail}" needs the sample mean and std and the source moments')
    return TAIL_CODES[tail]


def _probits(source: LayerSource) -> torch.Tensor | None:
    return None if source.z is None else torch.tensor(source.z, dtype=torch.float64)


def subset_quantiles(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    positions: torch.Tensor,
    num_quantiles: int,
    moments: bool = True,
    pre: Affine | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """Quantiles ``(C, K)`` of ``x`` (A, C, B; float32, contiguous) at flat ``positions`` (S,) of channel 0.

    Channel ``c`` is read at ``positions + c * B`` (and transformed by ``pre`` first, if given);
    p0 and p100 are the extremes of all of the channel's values, as in the exact path. Also returns
    the sample's mean and std ``(C, 1)`` (``None`` unless ``moments``) and whether every value was
    finite (the knots of a channel that was not are NaN).
    """
    c, s = x.shape[1], positions.shape[0]
    rank_lo, frac = _ranks(s, num_quantiles)
    tq = torch.empty(c, num_quantiles)
    stats = torch.empty(c, 2) if moments else None
    finite = torch.empty(c, dtype=torch.int32)
    nbins, crowded = _histogram(s)
    sample = lib.structs["aqr_sample"].of(A=x.shape[0], C=c, B=x.shape[2], pos=_ptr(positions), S=s, K=num_quantiles,
                                          rank_lo=_ptr(rank_lo), frac=_ptr(frac), nbins=nbins, crowded=crowded)
    status = lib.aqr_subset_quantiles(sample, _ptr(x), *_affine_ptrs(pre), _ptr(tq), _ptr_or_null(stats), _ptr(finite),
                                      torch.get_num_threads())
    _check(status, "aqr_subset_quantiles", f"{c} x {s} values")
    mean, std = (None, None) if stats is None else (stats[:, :1], stats[:, 1:])
    return tq, mean, std, bool(finite.all())


def table_map(lib: ctypes.CDLL, x: torch.Tensor, targets: Targets, source: LayerSource,
              pre: Affine | None = None) -> torch.Tensor:
    """``x`` (A, C, B, float32, contiguous) mapped from ``targets`` onto ``source`` by each channel's table.

    As :func:`aqr.backends.torch_backend.table_map`, with the same float32 arithmetic. With ``pre``,
    maps ``scale * x + shift``.
    """
    a, c, b = x.shape
    code = _tail_code(source, targets.mean is not None and targets.std is not None)
    y = torch.empty_like(x)
    tq, sq = targets.knots.contiguous().float(), source.knots.contiguous().float()
    moments = [None if t is None else t.reshape(-1).contiguous().float() for t in (targets.mean, targets.std)]
    zs = _probits(source)
    mean, std = map(_ptr_or_null, moments)
    described = lib.structs["aqr_map"].of(
        A=a, C=c, B=b, K=tq.shape[1], tq=_ptr(tq), mean=mean, std=std, sq=_ptr(sq), tail=code,
        loc=_ptr_or_null(source.loc), scale=_ptr_or_null(source.scale), z=_ptr_or_null(zs), cells=source.cells)
    status = lib.aqr_table_map(described, _ptr(x), _ptr(y), *_affine_ptrs(pre), torch.get_num_threads())
    _check(status, "aqr_table_map", f"{c} channels, a {source.cells}-cell table")
    return y


class BoundRecalibrate:
    """``aqr_recalibrate`` bound to one layer's source and one batch shape.

    The positions, the ranks, the source knots and the tail's arrays stay the same from batch to
    batch of one shape, so a call converts and passes only the batch, its output and the folded
    affine step: a layer's Python around the C call is a few microseconds. ``shape`` is the layer
    output's, channels on dim 1 (``(A, C, ...)``, read as ``(A, C, B)``: no views are made). It holds
    no per-batch state (the C side keeps the knots, moments and finite flags in its own scratch), so
    threads may share it.
    """

    def __init__(self, lib: ctypes.CDLL, shape: torch.Size, positions: torch.Tensor, source: LayerSource) -> None:
        a, c = shape[0], shape[1]
        b = math.prod(shape[2:])
        if b < ROWS_LAYOUT_BELOW:
            raise ValueError(f"recalibrate takes channel-major layouts ({ROWS_LAYOUT_BELOW}+ values per row and "
                             f"channel), got {b}")
        s, k = positions.shape[0], source.num_quantiles
        rank_lo, frac = _ranks(s, k)
        sq, zs = source.knots.contiguous().float(), _probits(source)
        self.shape = shape
        self._fn = lib.aqr_recalibrate
        self._what = f"{c} x {s} values"
        nbins, crowded = _histogram(s)
        # read-only once made (the outputs NULL: the C side keeps the knots, moments and finite flags in scratch
        # of its own), so threads share it
        self._descriptor = lib.structs["aqr_recalibration"].of(
            A=a, C=c, B=b, pos=positions.data_ptr(), S=s, K=k, rank_lo=_ptr(rank_lo), frac=_ptr(frac), nbins=nbins,
            crowded=crowded, sq=_ptr(sq), tail=_tail_code(source, True), loc=_ptr_or_null(source.loc),
            scale=_ptr_or_null(source.scale), z=_ptr_or_null(zs), cells=source.cells, tq=None, moments=None,
            finite=None)
        self._keep = (positions, rank_lo, frac, sq, zs, source)  # the memory the pointers above read

    def __call__(self, x: torch.Tensor, pre: Affine | None = None) -> tuple[torch.Tensor, bool]:
        """The map of ``x`` (contiguous float32 on CPU, of :attr:`shape`; ``pre`` likewise) in ``x``'s
        shape, and whether every value was finite (if not, its non-finite channels are never written)."""
        if x.shape != self.shape:  # the C side reads A * C * B values
            raise ValueError(f"recalibrate was bound to batches of shape {tuple(self.shape)}, got {tuple(x.shape)}")
        if x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():  # ... as one float32 block
            raise ValueError(f"recalibrate reads contiguous float32 CPU batches, got {x.dtype} on {x.device}"
                             f"{'' if x.is_contiguous() else ', not contiguous'}")
        y = torch.empty_like(x)
        scale, shift = (None, None) if pre is None else (pre[0].data_ptr(), pre[1].data_ptr())
        status = self._fn(self._descriptor, x.data_ptr(), y.data_ptr(), scale, shift, torch.get_num_threads())
        if status < 0:
            _check(status, "aqr_recalibrate", self._what)
        return y, status == 0


def recalibrate(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor, source: LayerSource,
                pre: Affine | None = None) -> tuple[torch.Tensor, bool]:
    """:func:`subset_quantiles` then :func:`table_map`, in one pass per channel (channel-major ``x``).

    A channel is mapped right after its quantiles, while its values are still in cache. Returns the
    mapped ``x`` and whether every value was finite; if not, the output's non-finite channels hold
    no values (they are never written).
    """
    return BoundRecalibrate(lib, x.shape, positions, source)(x, pre)


def channels_last_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (A, C, ...) with its channels as the fastest axis and the other axes in order (``torch.channels_last``
    and its 3-d and 5-d forms) viewed as ``(A * ..., C, 1)`` rows, the kernels' channels-last layout; ``None``
    where ``x`` is not laid out so (a contiguous ``x`` with ``C > 1`` included)."""
    if x.ndim < 3 or x.shape[1] < 2:
        return None
    moved = x.movedim(1, -1)
    if not moved.is_contiguous():
        return None
    return moved.view(-1, x.shape[1], 1)


def native_takes(x: torch.Tensor) -> bool:
    """Whether the C kernels can map ``x``: float32 on CPU, with no gradient to keep."""
    return x.is_cpu and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())


class NativeBackend(LayerBackend):
    """The fast path in aqr's C kernels; inputs they do not take go to ``fallback`` (the torch backend)."""

    name = "native"

    def __init__(self, source: LayerSource, subsets: SubsetCache, lib: ctypes.CDLL, fallback: LayerBackend) -> None:
        if source.device.type != "cpu":
            raise ValueError(f"aqr's C kernels run on CPU, not {source.device}")
        super().__init__(source, subsets)
        self.lib = lib
        self.fallback = fallback
        self._bound: dict[torch.Size, BoundRecalibrate] = {}  # per batch shape (channels on dim 1); filled idempotently
        # recalibrate's flags, made once rather than a tensor per layer and batch: shared by every caller,
        # which only reads them (never in place)
        self._all_finite, self._not_finite = torch.tensor(True), torch.tensor(False)

    def folds(self, x: torch.Tensor) -> bool:
        return native_takes(x)

    def target_knots(self, x: torch.Tensor, pre: Affine | None = None) -> Targets:
        if not native_takes(x):
            return self.fallback.target_knots(x, pre)
        x = x.contiguous()
        tq, mean, std, finite = subset_quantiles(self.lib, x, self.subsets.positions(x), self.source.num_quantiles,
                                                 self.source.needs_moments, pre)
        return Targets(tq, mean, std, torch.tensor(finite))

    def apply(self, x: torch.Tensor, targets: Targets, pre: Affine | None = None) -> torch.Tensor:
        if not native_takes(x):
            return self.fallback.apply(x, targets, pre)
        return table_map(self.lib, x.contiguous(), targets, self.source, pre)

    def recalibrate(self, x: torch.Tensor, pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Both steps; on a non-finite batch, ``x`` itself and ``False`` (nothing is mapped)."""
        if not native_takes(x):
            return self.fallback.recalibrate(x, pre)
        x = x.contiguous()
        if x.shape[2] >= ROWS_LAYOUT_BELOW:  # one pass per channel, quantiles then map
            y, finite = self._bound_to(x)(x, pre)
        else:
            targets = self.target_knots(x, pre)
            finite = bool(targets.finite)
            y = self.apply(x, targets, pre) if finite else x
        return (y, self._all_finite) if finite else (x, self._not_finite)

    def recalibrate_output(self, out: torch.Tensor, channel_dim: int,
                           pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """As :meth:`LayerBackend.recalibrate_output`; a contiguous channel-major output (channels on
        dim 1, 16+ values per row and channel) goes straight to its shape's bound call, in its own shape."""
        if (out.ndim >= 3 and channel_dim % out.ndim == 1 and math.prod(out.shape[2:]) >= ROWS_LAYOUT_BELOW
                and native_takes(out) and out.is_contiguous()):
            y, finite = self._bound_to(out)(out, pre)
            return (y, True) if finite else (out, False)
        if channel_dim % max(out.ndim, 1) == 1 and native_takes(out) and channels_last_rows(out) is not None:
            return self._recalibrate_channels_last(out, pre)
        return super().recalibrate_output(out, channel_dim, pre)

    def _recalibrate_channels_last(self, out: torch.Tensor, pre: Affine | None) -> tuple[torch.Tensor, bool]:
        """:meth:`recalibrate_output` of a channels-last ``out`` (channels on dim 1, the fastest axis), read and
        written in place of the ``(positions, C)`` rows: the same sample (each channel's values in the order of
        the ``(A, C, B)`` view) and so the same bits as the contiguous layout, and an output in ``out``'s layout."""
        rows = channels_last_rows(out)
        positions = self.subsets.strided_positions(as_acb(out, 1))  # p * C: the contiguous layout's p-th value
        tq, mean, std, finite = subset_quantiles(self.lib, rows, positions, self.source.num_quantiles,
                                                 self.source.needs_moments, pre)
        if not finite:
            return out, False
        y = table_map(self.lib, rows, Targets(tq, mean, std, self._all_finite), self.source, pre)
        return y.view(out.movedim(1, -1).shape).movedim(-1, 1), True

    def _bound_to(self, x: torch.Tensor) -> BoundRecalibrate:
        """The bound call for batches of ``x``'s shape (channels on dim 1), made on first use."""
        bound = self._bound.get(x.shape)
        if bound is None:
            positions = self.subsets.positions(as_acb(x, 1))
            bound = self._bound.setdefault(x.shape, BoundRecalibrate(self.lib, x.shape, positions, self.source))
        return bound
