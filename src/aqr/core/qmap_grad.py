"""The quantile map's gradient: each value's segment slope, the knots held constant.

For fixed source and target knots, Eq. 1 (with a tail strategy's lines) is piecewise linear in each
value, so its derivative is the slope of the segment the value falls in: ``(p_{j+1}^S - p_j^S) /
(p_{j+1}^T - p_j^T)`` inside, the tail line's slope below ``p1^T`` / from ``p_{K-2}^T`` on, 0 on a
zero-width (tied) segment. The target knots themselves are taken as constants: they are quantiles
of the batch, moved only by the few values that define them, and a running estimate's knots hold
earlier batches too.

:func:`with_segment_slopes` attaches that gradient to a map computed by any path (the C or Triton
fast paths, the streaming kernels): the forward value is the given one, untouched, and the backward
pass multiplies the incoming gradient by the slopes of the reference map
(:func:`aqr.core.qmap.map_rows_with_lines`) with the knots the map used (:func:`segment_slopes`; at a
value equal to a knot, the slope of the segment starting there).
"""

from __future__ import annotations

import torch

from aqr.core.qmap import to_channel_rows

Lines = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def from_channel_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`aqr.core.qmap.to_channel_rows`: ``(C, M)`` rows back to the shape of ``like``."""
    shape = list(like.shape)
    shape.insert(0, shape.pop(dim))
    return rows.reshape(shape).movedim(0, dim)


#: cells per knot of the table that finds each value's segment, and the most knots one cell may hold
#: before the search falls back to ``torch.searchsorted`` (constant channels, long runs of tied knots)
CELLS_PER_KNOT = 4
MAX_KNOTS_PER_CELL = 8


def knots_at_or_below(rows: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """``torch.searchsorted(knots, rows, right=True)``: how many of each row's sorted knots are ``<=`` each
    value, for ``(C, M)`` rows and ``(C, K)`` knots.

    Found through a table of ``CELLS_PER_KNOT * K`` equal cells per row between its end knots: the knots
    in cells before a value's cell are all below it, those after it all above, so only the few knots in
    its own cell are compared (a binary search of every value is several times slower on CPU).
    """
    c, k = knots.shape
    cells = CELLS_PER_KNOT * k
    lo = knots[:, :1]
    span = knots[:, -1:] - lo
    scale = torch.where(span > 0, cells / torch.where(span > 0, span, torch.ones_like(span)), torch.zeros_like(span))

    def cell_of(v: torch.Tensor) -> torch.Tensor:  # monotone in v, so a knot <= v never lands in a later cell
        return torch.nan_to_num((v - lo) * scale, nan=0.0).floor_().clamp_(0, cells - 1).long()

    knot_cells = cell_of(knots)
    per_cell = torch.zeros(c, cells, dtype=torch.long, device=knots.device)
    per_cell.scatter_add_(1, knot_cells, torch.ones_like(knot_cells))
    crowded = int(per_cell.max())
    if crowded > MAX_KNOTS_PER_CELL:
        return torch.searchsorted(knots, rows, right=True)
    before = per_cell.cumsum(1) - per_cell  # knots in the cells before each cell
    where = cell_of(rows)
    first = before.gather(1, where)
    inside = per_cell.gather(1, where)
    count = first
    for d in range(crowded):  # the knots of the value's own cell, in order
        knot = knots.gather(1, (first + d).clamp_(max=k - 1))
        count = count + ((inside > d) & (knot <= rows)).long()
    return count


def segment_slopes(rows: torch.Tensor, source_q: torch.Tensor, target_q: torch.Tensor,
                   lines: Lines | None = None) -> torch.Tensor:
    """The derivative of :func:`aqr.core.qmap.map_rows_with_lines` at each value of ``(C, M)`` ``rows``, the
    knots constant: the slope of the value's segment (the edge segments' beyond the end knots, 0 on a
    zero-width one), the tail lines' slopes below ``p1^T`` and from ``p_{K-2}^T`` on."""
    k = target_q.shape[1]
    rise, run = source_q.diff(dim=1), target_q.diff(dim=1)
    slope = torch.where(run > 0, rise / torch.where(run > 0, run, torch.ones_like(run)), torch.zeros_like(run))
    segment = (knots_at_or_below(rows, target_q) - 1).clamp_(0, k - 2)
    out = slope.gather(1, segment)
    if lines is not None:
        a_lo, _, a_hi, _ = lines
        out = torch.where(rows < target_q[:, 1:2], a_lo.expand_as(out), out)
        out = torch.where(rows >= target_q[:, k - 2 : k - 1], a_hi.expand_as(out), out)
    return out


def segment_slope_vjp(x: torch.Tensor, grad: torch.Tensor, source_q: torch.Tensor, target_q: torch.Tensor,
                      lines: Lines | None, dim: int) -> torch.Tensor:
    """``grad`` times the map's segment slope at each value of ``x`` (channels on ``dim``), knots constant."""
    work = torch.promote_types(x.dtype, torch.float32)
    rows = to_channel_rows(x.detach(), dim).to(work)
    sq, tq = source_q.to(rows), target_q.to(rows).contiguous()
    lines = None if lines is None else tuple(t.to(rows) for t in lines)  # type: ignore[assignment]
    slopes = segment_slopes(rows, sq, tq, lines)  # type: ignore[arg-type]
    return from_channel_rows(slopes.mul_(to_channel_rows(grad, dim).to(work)), x, dim).to(grad.dtype)


class _SegmentSlopes(torch.autograd.Function):
    """Forward: the given mapped values; backward: :func:`segment_slope_vjp`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mapped: tuple[torch.Tensor], source_q: torch.Tensor,  # type: ignore[override]
                target_q: torch.Tensor, lines: Lines | None, dim: int) -> torch.Tensor:
        ctx.save_for_backward(x, source_q, target_q, *(lines or ()))
        ctx.dim, ctx.has_lines = dim, lines is not None
        # handed in a tuple, so the output is no input returned as-is (a view, which a later in-place op,
        # say ReLU(inplace=True) after a layer without affine parameters, could not modify)
        return mapped[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, source_q, target_q, *lines = ctx.saved_tensors
        dx = segment_slope_vjp(x, grad, source_q, target_q, tuple(lines) if ctx.has_lines else None, ctx.dim)
        return dx, None, None, None, None, None


def with_segment_slopes(x: torch.Tensor, mapped: torch.Tensor, source_q: torch.Tensor, target_q: torch.Tensor,
                        lines: Lines | None = None, dim: int = 0) -> torch.Tensor:
    """``mapped`` (the map of ``x``, channels on ``dim``, computed without gradient) whose gradient
    with respect to ``x`` is the segment slope of the map with knots ``source_q``/``target_q``
    (``(C, K)``) and tail ``lines`` (:func:`aqr.core.qmap.tail_lines`; ``None``: Eq. 1's edge segments
    extended), the knots held constant."""
    if not x.requires_grad:
        return mapped
    return _SegmentSlopes.apply(x, (mapped.detach(),), source_q.detach(), target_q.detach(),
                                None if lines is None else tuple(t.detach() for t in lines), dim)
