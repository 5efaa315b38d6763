"""The fast recalibration path: subsampled target quantiles and a lookup-table map.

Two costs dominate a naive AQR layer: exact per-channel quantiles (a sort of every value) and the
map itself (a binary search and several gathers per value, on a transposed copy). Here:

1. Target quantiles come from a fixed random subset of at most ``target_samples`` positions per
   layer (the same positions for every channel, drawn once per tensor shape with a fixed seed, so a
   batch's result never depends on earlier batches). By DKW, 8,192 values keep the sample CDF
   within 0.015 of the batch CDF with probability 0.95. p0 and p100 are the batch's own extremes
   (one pass over the values), as in the exact path: the tail strategies anchor on them, and a
   sample's extremes fall short of the batch's.
2. The map is piecewise linear. Between the first and last inner knots it is tabulated on a uniform
   grid of ``grid`` cells per channel (the exact map at the grid points); outside, every tail
   strategy is affine (:func:`aqr.core.qmap.tail_lines`). One elementwise pass evaluates it directly
   on the ``(A, C, B)`` view of the layer output: no transpose, no sort, no search.
3. On CPU (float32, no autograd) aqr's C kernels (:mod:`aqr.backends.native`) do both steps: the sample's
   quantiles from a fine histogram (each knot within one histogram bucket of the sorted sample's,
   p0 and p100 exact), and the table with its map, with an eval-mode BatchNorm's affine step
   folded in (see :class:`aqr.AQR`). Elsewhere, building the table and applying it are one
   function, compiled once (``torch.compile`` when available); on a GPU the sort joins it and
   nothing reads a value back from the device.

The grid bends the map's kinks over one cell; with ``grid=1024`` cells and ``K=101`` knots a cell is
a tenth of the median knot spacing of a Gaussian channel. On the zoo's three models the histogram
moves no knot by more than 0.37 of a cell.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable

import torch

from aqr.backends.native import (
    PARAMETRIC_TAILS, ROWS_LAYOUT_BELOW, Affine, load_kernels, recalibrate, subset_quantiles, table_map,
)
from aqr.core.qmap import _eval_levels, _interp_levels, gaussian_z, sort_rows, sorted_quantiles, tail_lines

_SUBSET_SEED = 0x5EED


def _lookup_kernel(
    x: torch.Tensor,
    lo: torch.Tensor,
    inv: torch.Tensor,
    slope: torch.Tensor,
    icpt: torch.Tensor,
    base: torch.Tensor,
    cells: int,
) -> torch.Tensor:
    """``slope[cell] * x + icpt[cell]`` on ``x`` (A, C, B); ``(1, C, 1)`` per-channel ``lo``/``inv``/``base``.

    Cell 0 is the lower tail line, cells 1..cells the grid, cell cells+1 the upper tail line.
    """
    xf = x.float()
    # NaN would convert to an arbitrary integer: send it to cell 0 (its output stays NaN).
    t = ((xf - lo) * inv + 1.0).clamp(0, cells + 1)
    t = torch.where(t == t, t, torch.zeros_like(t))  # vectorizes, unlike nan_to_num
    cell = t.to(torch.int32) + base  # int32 indices gather markedly faster than int64 here
    y = slope[cell] * xf + icpt[cell]
    return y.to(x.dtype)


_COMPILED: dict[Callable[..., object], Callable[..., object]] = {}  # compiled kernels, shared by all layers


def compiled(fn: Callable[..., object], enabled: bool = True) -> Callable[..., object]:
    """``torch.compile(fn)`` once per process; ``fn`` itself when disabled or after a failed compile."""
    if not enabled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def run_compiled(fn: Callable[..., object], enabled: bool, *args: object) -> object:
    """Call the compiled ``fn``; if compiling fails (no C++ compiler...), warn once and run it eagerly."""
    try:
        return compiled(fn, enabled)(*args)
    except Exception as err:
        if not enabled or _COMPILED.get(fn) is fn:
            raise
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {err}); aqr runs {fn.__name__} eagerly", stacklevel=3)
        _COMPILED[fn] = fn
        return fn(*args)


def as_acb(out: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """View a layer output as ``(A, C, B)`` with the channel in the middle (no copy when contiguous)."""
    dim = channel_dim % out.ndim
    a = 1
    for s in out.shape[:dim]:
        a *= s
    return out.reshape(a, out.shape[dim], -1)


class SubsetCache:
    """Fixed random position subsets, one per ``(A, C, B)`` shape, so results are history-free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cache: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
        self._offsets: dict[tuple[object, ...], torch.Tensor] = {}

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        """``(S,)`` int64 flat offsets of the subset positions of channel 0 in contiguous ``x`` (A, C, B).

        ``S = min(size, A * B)``; below ``size`` positions every position is taken. Channel ``c``'s
        values are at these offsets plus ``c * B``.
        """
        a, c, b = x.shape
        key = (a, c, b, x.device)
        if key not in self._cache:
            total = a * b
            if total <= self.size:
                pos = torch.arange(total)
            else:
                g = torch.Generator().manual_seed(_SUBSET_SEED + total)
                pos = torch.randperm(total, generator=g)[: self.size].sort().values
            self._cache[key] = (pos // b * (c * b) + pos % b).to(x.device)
        return self._cache[key]

    def offsets(self, x: torch.Tensor) -> torch.Tensor:
        """``(C, S)`` int64 flat offsets into contiguous ``x`` (A, C, B): each channel's subset positions."""
        a, c, b = x.shape
        key = (a, c, b, x.device, "offsets")
        if key not in self._offsets:
            # torch.take on flat offsets reads about a third faster than advanced indexing plus a
            # transposed copy
            self._offsets[key] = self.positions(x)[None, :] + (torch.arange(c, device=x.device) * b)[:, None]
        return self._offsets[key]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(C, S)`` float32 values of every channel at the subset positions of ``x`` (A, C, B)."""
        return torch.take(x if x.is_contiguous() else x.contiguous(), self.offsets(x)).float()


def _map_points(points: torch.Tensor, tq: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """The exact map at a few sorted points per channel: ``(C, P)``, without branching on the data."""
    return _eval_levels(_interp_levels(points.contiguous(), tq.contiguous(), branch_free=True), sq)


def _map_sample(
    x: torch.Tensor,
    sample: torch.Tensor,
    presorted: bool,
    sq: torch.Tensor,
    tail: str,
    loc: torch.Tensor,
    scale: torch.Tensor,
    gaussian_p: float,
    cells: int,
    z: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map ``x`` (A, C, B) with the target knots of ``sample`` (C, S), sorted first unless ``presorted``.

    Builds the lookup table (tail lines, the exact map on the grid) and applies
    :func:`_lookup_kernel`; as one function, one ``torch.compile`` fuses the few dozen small table
    ops with the map (and the sort, where it runs here). Also returns a 0-d bool tensor: whether
    every value of ``x`` is finite (its extremes are).
    """
    k, c = sq.shape[1], sq.shape[0]
    ordered = sample if presorted else sort_rows(sample)
    tq = sorted_quantiles(ordered, k)
    # p0 and p100 are the extremes of every value, as in the exact path: the sample's fall short of
    # the batch's, and the tail strategies anchor on them. A NaN anywhere makes them NaN.
    tq = torch.cat([x.amin(dim=(0, 2)).float()[:, None], tq[:, 1 : k - 1], x.amax(dim=(0, 2)).float()[:, None]], dim=1)
    mean = std = None
    if tail in ("interval", "gaussian"):
        mean = ordered.mean(dim=1, keepdim=True)
        std = ordered.std(dim=1, correction=0, keepdim=True)
    a_lo, b_lo, a_hi, b_hi = tail_lines(sq, tq, tail, mean, std, loc, scale, gaussian_p, z)
    lo, hi = tq[:, 1:2], tq[:, k - 2 : k - 1]
    width = (hi - lo) / cells
    grid = lo + width * torch.arange(cells + 1, device=x.device, dtype=lo.dtype)  # (C, cells + 1)
    values = _map_points(grid, tq, sq)
    inv = torch.where(width > 0, 1.0 / torch.where(width > 0, width, torch.ones_like(width)), torch.zeros_like(width))
    cell_slope = (values[:, 1:] - values[:, :-1]) * inv
    cell_icpt = values[:, :-1] - cell_slope * grid[:, :-1]
    slope = torch.cat([a_lo, cell_slope, a_hi], dim=1)  # (C, cells + 2)
    icpt = torch.cat([b_lo, cell_icpt, b_hi], dim=1)
    base = (torch.arange(c, device=x.device, dtype=torch.int32) * (cells + 2)).view(1, c, 1)
    y = _lookup_kernel(x, lo.reshape(1, c, 1), inv.reshape(1, c, 1), slope.reshape(-1), icpt.reshape(-1), base, cells)
    # p0 and p100 are x's own extremes: finite extremes mean finite values.
    finite = torch.isfinite(tq[:, 0]).all() & torch.isfinite(tq[:, -1]).all()
    return y, finite


def lookup_map(
    x: torch.Tensor,
    subsets: SubsetCache,
    sq: torch.Tensor,
    tail: str,
    loc: torch.Tensor,
    scale: torch.Tensor,
    gaussian_p: float,
    cells: int,
    compile: bool,
    native: bool = True,
    pre: Affine | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map ``x`` (A, C, B) using target knots estimated from its ``subsets`` positions.

    With ``pre`` (per-channel scale and shift, native kernels only) the map applies to
    ``scale * x + shift``: an eval-mode BatchNorm folded into the map.

    Also returns a 0-d bool tensor: whether every value of ``x`` was finite (read off its per-channel
    extremes, which p0 and p100 are). On CPU with ``native``, aqr's C kernels do the
    work (:mod:`aqr.backends.native`). Otherwise table and map are compiled together (each small op would
    cost a dispatch on CPU and a kernel launch on a GPU); the sort joins them on a GPU, and nothing
    there waits for the device.
    """
    z = gaussian_z(sq.shape[1], gaussian_p) if tail == "gaussian" else None
    if native and native_takes(x):
        lib = native_kernels()
        if lib is not None:
            x = x.contiguous()
            if x.shape[2] >= ROWS_LAYOUT_BELOW:  # one pass per channel, quantiles then map
                y, finite = recalibrate(lib, x, subsets.positions(x), sq, tail, cells, loc, scale, z, pre)
                return (y, torch.tensor(True)) if finite else (x, torch.tensor(False))
            moments = tail in PARAMETRIC_TAILS
            tq, mean, std, finite = subset_quantiles(lib, x, subsets.positions(x), sq.shape[1], moments, pre)
            if not finite:
                return x, torch.tensor(False)
            return table_map(lib, x, tq, sq, tail, cells, mean, std, loc, scale, z, pre), torch.tensor(True)
    if pre is not None:
        raise ValueError("a folded affine step needs aqr's native kernels (CPU, float32)")
    sample = subsets.rows(x)
    # numpy's sort is several times faster than torch's (or inductor's) on CPU: there it runs eagerly.
    presorted = x.device.type == "cpu"
    if presorted:
        sample = sort_rows(sample)
    return run_compiled(_map_sample, compile, x, sample, presorted, sq, tail, loc, scale, gaussian_p, cells, z)


def native_takes(x: torch.Tensor) -> bool:
    """Whether the native kernels can map ``x``: float32 on CPU, with no gradient to keep."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled())


def native_kernels() -> ctypes.CDLL | None:
    """aqr's C kernels, or ``None`` (warning once with the reason) when they cannot be built."""
    lib, reason = load_kernels()
    if lib is None and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"aqr's C kernels are unavailable ({reason}); the fast path runs through torch", stacklevel=3)
    return lib


_WARNED: set[str] = set()
