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
(:func:`aqr.core.qmap.map_rows_with_lines`) with the knots the map used.
"""

from __future__ import annotations

import torch

from aqr.core.qmap import map_rows_with_lines, to_channel_rows

Lines = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def from_channel_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`aqr.core.qmap.to_channel_rows`: ``(C, M)`` rows back to the shape of ``like``."""
    shape = list(like.shape)
    shape.insert(0, shape.pop(dim))
    return rows.reshape(shape).movedim(0, dim)


def segment_slope_vjp(x: torch.Tensor, grad: torch.Tensor, source_q: torch.Tensor, target_q: torch.Tensor,
                      lines: Lines | None, dim: int) -> torch.Tensor:
    """``grad`` times the map's segment slope at each value of ``x`` (channels on ``dim``), knots constant."""
    work = torch.promote_types(x.dtype, torch.float32)
    rows = to_channel_rows(x.detach(), dim).to(work)
    sq, tq = source_q.to(rows), target_q.to(rows).contiguous()
    lines = None if lines is None else tuple(t.to(rows) for t in lines)  # type: ignore[assignment]
    with torch.enable_grad():
        rows = rows.requires_grad_(True)
        mapped = map_rows_with_lines(rows, sq, tq, lines)  # type: ignore[arg-type]
        (out,) = torch.autograd.grad(mapped, rows, to_channel_rows(grad, dim).to(work))
    return from_channel_rows(out, x, dim).to(grad.dtype)


class _SegmentSlopes(torch.autograd.Function):
    """Forward: the given mapped values; backward: :func:`segment_slope_vjp`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mapped: torch.Tensor, source_q: torch.Tensor,  # type: ignore[override]
                target_q: torch.Tensor, lines: Lines | None, dim: int) -> torch.Tensor:
        ctx.save_for_backward(x, source_q, target_q, *(lines or ()))
        ctx.dim, ctx.has_lines = dim, lines is not None
        return mapped.view_as(mapped)

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
    return _SegmentSlopes.apply(x, mapped.detach(), source_q.detach(), target_q.detach(),
                                None if lines is None else tuple(t.detach() for t in lines), dim)
