"""The fast path in torch: sampled target quantiles and a lookup-table map, on any device.

Two costs dominate a naive AQR layer: exact per-channel quantiles (a sort of every value) and the
map itself (a binary search and several gathers per value, on a transposed copy). Here:

1. The inner target knots come from the sampled positions of :class:`aqr.backends.subsets.SubsetCache`;
   p0 and p100 are the batch's own extremes (one pass over the values), as in the exact path: the
   tail strategies anchor on them, and a sample's extremes fall short of the batch's.
2. The map is piecewise linear. Between the first and last inner knots it is tabulated on a uniform
   grid of ``cells`` cells per channel (the exact map at the grid points); outside, every tail
   strategy is affine (:func:`aqr.core.qmap.tail_lines`). One elementwise pass evaluates it directly
   on the ``(A, C, B)`` view of the layer output: no transpose, no sort, no search.

Building the table and applying it are one function, compiled once (``torch.compile`` when
available): each small table op would otherwise cost a dispatch on CPU and a kernel launch on a
GPU. On a GPU the sort joins them and nothing reads a value back from the device; on CPU numpy
sorts the sample eagerly (several times faster than torch's or inductor's sort).

The grid bends the map's kinks over one cell; with ``grid=1024`` cells and ``K=101`` knots a cell is
a tenth of the median knot spacing of a Gaussian channel.

Marked cells (the tie rule). Where a run of target knots is tied (``p_a = ... = p_b = v``) the exact
map jumps at ``v``: values just below go to the source near level ``a``, ``v`` itself to the middle
level ``(a + b) / 2``, values just above near level ``b``. A line per cell cannot hold a jump, so
such cells are *marked* and their values take the exact map instead. Precisely, per channel, with
``lo = p_1``, ``hi = p_{K-2}``, ``width = (hi - lo) / cells`` and ``step`` the same in float64:

* ``inv = 1 / width`` (0 when ``width`` is 0; 0 and cell 1 marked when it overflows float32); grid
  point ``j`` is ``lo + width * j`` in float32 (``float32(lo + step * j)``, and ``width``
  ``float32(step)``, where ``hi - lo`` overflows float32: no overflow for any finite knots);
* a value ``v``'s cell is ``trunc(clamp((v - lo) * inv + 1, 0, cells + 1))`` in float32, NaN -> 0;
* marked: for every knot that is tied with a neighbour, its own cell and the two next to it (unless
  all K knots are equal: every value then equals them and falls in cell 1, whose line is then the
  constant the exact map gives that value: the middle level for the Eq. 1 tails, the upper tail
  line's value for the others); and every cell whose slope or intercept is not finite. A marked cell stores NaN as its slope and
  intercept, so the table gives NaN for exactly the values that need the exact map;
* a value whose table result is NaN (and that is not NaN itself) gets :func:`aqr.core.qmap.map_rows_with_lines`
  with the table's own tail lines: Eq. 1 with the tie rule, then the tail strategy below ``p_1``
  and at or above ``p_{K-2}``.

aqr's C kernels implement the same rule (``_kernels.c``: ``build_table``, ``exact_value``); another
backend mirrors it by marking the same cells and mapping a NaN table result exactly, per value.
(aqr's Triton kernels do not yet: there the table draws a line across each jump, ``mark_jumps=False``.)
"""

from __future__ import annotations

import torch

from aqr.backends.base import Affine, LayerBackend, LayerSource, Targets
from aqr.backends.subsets import SubsetCache
from aqr.core.qmap import (PARAMETRIC_TAILS, eval_levels, interp_levels, map_rows_with_lines, sort_rows,
                           sorted_quantiles, tail_lines)
from aqr.util.compiled import run_compiled


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


def _map_points(points: torch.Tensor, tq: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
    """The exact map at a few sorted points per channel: ``(C, P)``, without branching on the data."""
    return eval_levels(interp_levels(points.contiguous(), tq.contiguous(), branch_free=True), sq)


def sample_targets(
    x: torch.Tensor, ordered: torch.Tensor, num_quantiles: int, moments: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Target knots ``(C, K)`` of ``x`` (A, C, B) from its sorted sample ``ordered`` (C, S).

    Also the sample's mean and std ``(C, 1)`` when ``moments`` (else ``None``), and a 0-d bool
    tensor: whether every value of ``x`` is finite (its extremes, which p0 and p100 are, are).
    """
    k = num_quantiles
    tq = sorted_quantiles(ordered, k)
    # p0 and p100 are the extremes of every value, as in the exact path: the sample's fall short of
    # the batch's, and the tail strategies anchor on them. A NaN anywhere makes them NaN.
    tq = torch.cat([x.amin(dim=(0, 2)).float()[:, None], tq[:, 1 : k - 1], x.amax(dim=(0, 2)).float()[:, None]], dim=1)
    mean = std = None
    if moments:  # in float64, as the C kernels: squares of float32 values above 1.8e19 overflow
        var, mean = torch.var_mean(ordered.double(), dim=1, correction=0, keepdim=True)
        mean, std = mean.float(), var.sqrt().float()
    finite = torch.isfinite(tq[:, 0]).all() & torch.isfinite(tq[:, -1]).all()
    return tq, mean, std, finite


def table_map(
    x: torch.Tensor,
    tq: torch.Tensor,
    sq: torch.Tensor,
    tail: str,
    mean: torch.Tensor | None,
    std: torch.Tensor | None,
    loc: torch.Tensor | None,
    scale: torch.Tensor | None,
    z: tuple[float, float] | None,
    cells: int,
    mark_jumps: bool = True,
) -> torch.Tensor:
    """Map ``x`` (A, C, B) from the target knots ``tq`` onto ``sq`` (C, K) by each channel's lookup table.

    The table holds the tail lines of :func:`aqr.core.qmap.tail_lines` and the exact map on a grid
    of ``cells`` cells between the first and last inner target knots; :func:`_lookup_kernel` applies
    it. Values in marked cells come out NaN (see the module docstring); :func:`resolve_marked` maps
    them. ``mark_jumps=False`` builds the table without marks (lines across the jumps at tied knots),
    as aqr's Triton kernels still do.
    """
    k, c = sq.shape[1], sq.shape[0]
    a_lo, b_lo, a_hi, b_hi = tail_lines(sq, tq, tail, mean, std, loc, scale, z=z)
    lo, hi = tq[:, 1:2], tq[:, k - 2 : k - 1]
    width = (hi - lo) / cells
    grid = lo + width * torch.arange(cells + 1, device=x.device, dtype=lo.dtype)  # (C, cells + 1)
    wide = ~torch.isfinite(hi - lo)  # knots spanning more than FLT_MAX: the grid in float64 there
    step = (hi.double() - lo.double()) / cells
    width = torch.where(wide, step.float(), width)
    steps = torch.arange(cells + 1, device=x.device, dtype=torch.float64)
    grid = torch.where(wide, (lo.double() + step * steps).float(), grid)
    values = _map_points(grid, tq, sq)
    inv = torch.where(width > 0, 1.0 / torch.where(width > 0, width, torch.ones_like(width)), torch.zeros_like(width))
    overflow = ~torch.isfinite(inv)  # a subnormal width: everything goes to cell 1, which is marked
    inv = torch.where(overflow, torch.zeros_like(inv), inv)
    cell_slope = (values[:, 1:] - values[:, :-1]) * inv
    cell_icpt = values[:, :-1] - cell_slope * grid[:, :-1]
    if mark_jumps and tail not in ("standard", "average"):
        # all knots equal: every value is that value and goes to cell 1 (inv = 0), where the exact
        # map takes the upper tail line (Eq. 1 tails: the middle level, values[:, 0], as it is)
        constant = torch.where(tq[:, :1] == tq[:, -1:], a_hi * tq[:, :1] + b_hi, cell_icpt[:, :1])
        cell_icpt = torch.cat([constant, cell_icpt[:, 1:]], dim=1)
    slope = torch.cat([a_lo, cell_slope, a_hi], dim=1)  # (C, cells + 2)
    icpt = torch.cat([b_lo, cell_icpt, b_hi], dim=1)
    if mark_jumps:
        marked = _marked_cells(tq, lo, inv, cells) | ~torch.isfinite(slope) | ~torch.isfinite(icpt)
        marked = marked | (overflow & (torch.arange(cells + 2, device=x.device) == 1))
        nan = torch.full_like(slope, float("nan"))
        slope, icpt = torch.where(marked, nan, slope), torch.where(marked, nan, icpt)
    base = (torch.arange(c, device=x.device, dtype=torch.int32) * (cells + 2)).view(1, c, 1)
    return _lookup_kernel(x, lo.reshape(1, c, 1), inv.reshape(1, c, 1), slope.reshape(-1), icpt.reshape(-1), base, cells)


def _marked_cells(tq: torch.Tensor, lo: torch.Tensor, inv: torch.Tensor, cells: int) -> torch.Tensor:
    """``(C, cells + 2)`` bool: the cells of tied knots and their neighbours (the jumps of the exact map)."""
    same = tq[:, 1:] == tq[:, :-1]
    no = torch.zeros_like(same[:, :1])
    tied = torch.cat([no, same], dim=1) | torch.cat([same, no], dim=1)
    tied = tied & (tq[:, :1] != tq[:, -1:])  # all knots equal: no jump (cell 1 maps to the middle level)
    t = ((tq - lo) * inv + 1.0).clamp(0, cells + 1)
    cell = torch.where(t == t, t, torch.zeros_like(t)).to(torch.int64)
    hits = torch.zeros(tq.shape[0], cells + 4, device=tq.device, dtype=torch.float32)  # one pad each side
    for shift in (0, 1, 2):  # the knot's cell - 1, cell, cell + 1
        hits = hits.scatter_add(1, cell + shift, tied.float())
    return hits[:, 1 : cells + 3] > 0


def resolve_marked(x: torch.Tensor, y: torch.Tensor, tq: torch.Tensor, sq: torch.Tensor, tail: str,
                   mean: torch.Tensor | None, std: torch.Tensor | None, loc: torch.Tensor | None,
                   scale: torch.Tensor | None, z: tuple[float, float] | None) -> torch.Tensor:
    """``y`` = :func:`table_map` of ``x`` (A, C, B) with the values of marked cells (NaN where ``x``
    is not) mapped exactly, by Eq. 1 with the tie rule and the table's tail lines.

    On CPU only the channels that have such values are mapped; elsewhere every channel is (no
    value is read back from the device).
    """
    marked = torch.isnan(y) & ~torch.isnan(x)
    channels = None
    if x.device.type == "cpu":
        channels = marked.any(dim=2).any(dim=0).nonzero().squeeze(1)
        if channels.numel() == 0:
            return y
    lines = None
    if tail not in ("standard", "average"):
        lines = tail_lines(sq, tq, tail, mean, std, loc, scale, z=z)
    if channels is not None:
        pick = lambda t: t if t is None else t.index_select(0, channels)  # noqa: E731
        tq, sq = pick(tq), pick(sq)
        lines = None if lines is None else tuple(pick(t) for t in lines)
        x, sub_y, sub_marked = x.index_select(1, channels), y.index_select(1, channels), marked.index_select(1, channels)
    else:
        sub_y, sub_marked = y, marked
    a, c, b = x.shape
    rows = x.float().transpose(0, 1).reshape(c, a * b)
    exact = map_rows_with_lines(rows, sq, tq, lines).reshape(c, a, b).transpose(0, 1).to(y.dtype)
    resolved = torch.where(sub_marked, exact, sub_y)
    if channels is None:
        return resolved
    return y.index_copy(1, channels, resolved)


def map_sample(
    x: torch.Tensor,
    sample: torch.Tensor,
    presorted: bool,
    sq: torch.Tensor,
    tail: str,
    loc: torch.Tensor | None,
    scale: torch.Tensor | None,
    z: tuple[float, float] | None,
    cells: int,
    mark_jumps: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`sample_targets` then :func:`table_map`, as one function: one ``torch.compile`` fuses the
    few dozen small table ops with the map (and the sort of ``sample``, unless ``presorted``).

    Returns the mapped ``x`` (marked cells' values NaN: :func:`resolve_marked`), whether every
    value of ``x`` was finite (0-d bool tensor), and the target knots, mean and std.
    """
    ordered = sample if presorted else sort_rows(sample)
    tq, mean, std, finite = sample_targets(x, ordered, sq.shape[1], tail in PARAMETRIC_TAILS)
    return table_map(x, tq, sq, tail, mean, std, loc, scale, z, cells, mark_jumps), finite, tq, mean, std


def affine(x: torch.Tensor, pre: Affine | None) -> torch.Tensor:
    """``scale * x + shift`` per channel of ``x`` (A, C, B); ``x`` itself without ``pre``."""
    if pre is None:
        return x
    scale, shift = pre
    return x * scale.view(1, -1, 1) + shift.view(1, -1, 1)


class TorchBackend(LayerBackend):
    """The fast path in torch (any device, dtype and autograd state); see the module docstring."""

    name = "torch"

    def __init__(self, source: LayerSource, subsets: SubsetCache, compile: bool = True) -> None:
        super().__init__(source, subsets)
        self.compile = compile

    def _sample(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The ``(C, S)`` sampled values of ``x``, sorted on CPU (numpy's sort, eagerly); whether sorted."""
        sample = self.subsets.rows(x)
        presorted = x.device.type == "cpu"
        return (sort_rows(sample) if presorted else sample), presorted

    def target_knots(self, x: torch.Tensor, pre: Affine | None = None) -> Targets:
        x = affine(x, pre)
        sample, presorted = self._sample(x)
        ordered = sample if presorted else sort_rows(sample)
        tq, mean, std, finite = run_compiled(sample_targets, self.compile, x, ordered, self.source.num_quantiles,
                                             self.source.needs_moments)
        return Targets(tq, mean, std, finite)

    def apply(self, x: torch.Tensor, targets: Targets, pre: Affine | None = None) -> torch.Tensor:
        s = self.source
        x = affine(x, pre)
        y = run_compiled(table_map, self.compile, x, targets.knots, s.knots, s.tail, targets.mean, targets.std, s.loc,
                         s.scale, s.z, s.cells)
        return resolve_marked(x, y, targets.knots, s.knots, s.tail, targets.mean, targets.std, s.loc, s.scale, s.z)

    def recalibrate(self, x: torch.Tensor, pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = affine(x, pre)
        sample, presorted = self._sample(x)
        s = self.source
        y, finite, tq, mean, std = run_compiled(map_sample, self.compile, x, sample, presorted, s.knots, s.tail, s.loc,
                                                s.scale, s.z, s.cells)
        return resolve_marked(x, y, tq, s.knots, s.tail, mean, std, s.loc, s.scale, s.z), finite
