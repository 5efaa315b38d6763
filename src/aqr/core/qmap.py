"""The AQR quantile map (paper Eq. 1) and its tail strategies, on plain tensors.

Conventions used throughout:

* A quantile tensor has shape ``(C, K)``: ``C`` channels on dim 0, ``K`` knots at the uniform levels
  ``u_j = j / (K - 1)`` (``K = 101`` gives the percentiles ``p0 .. p100``).
* Values to map have their channels on ``dim`` (default 0); every other dim is pooled.

The map sends a value ``x`` of channel ``c`` to the source value at the same quantile level:
``u(x)`` is found by piecewise-linear interpolation of the target knots, the result by
piecewise-linear interpolation of the source knots at ``u(x)``. Inside ``[p_j^T, p_{j+1}^T)`` this
is exactly ``p_j^S + (x - p_j^T) / (p_{j+1}^T - p_j^T) * (p_{j+1}^S - p_j^S)``.

Zero-width target intervals (constant channels, repeated quantiles, dead units): a value equal to a
run of tied knots ``p_a^T = ... = p_b^T`` is sent to the source at the middle level ``(a + b) / 2``,
so a constant channel maps to the source median; no division by zero occurs. Values outside
``[p_0^T, p_{K-1}^T]`` (possible only when the target knots come from a subsample) are extrapolated
with the slope of the edge interval, or clamped to the source edge when that interval has zero width.
"""

from __future__ import annotations

import numbers
from statistics import NormalDist


import numpy as np
import torch

from aqr.core.tails import PARAMETRIC_TAILS, TAILS, Tail, check_tail  # noqa: F401  (the map's names, kept here too)
from aqr.util.memory import check_memory

# Default probability that stands in for p0 / p100 in the Gaussian tail (the probit of 0 and 1 is
# infinite). With the same p on both sides the tail map does not depend on it (see `_gaussian_tails`).
DEFAULT_GAUSSIAN_P = 1e-3


def check_num_quantiles(num_quantiles: object) -> int:
    """``num_quantiles`` when it is an integer ``K >= 3`` (p0, an inner knot, p100): ``TypeError`` for
    another type (``3.5``, ``'101'``, ``True``), ``ValueError`` below 3."""
    if isinstance(num_quantiles, bool) or not isinstance(num_quantiles, numbers.Integral):
        raise TypeError(f"num_quantiles must be an integer >= 3, got {num_quantiles!r} ({type(num_quantiles).__name__})")
    if num_quantiles < 3:
        raise ValueError(f"num_quantiles must be >= 3 (p0, at least one inner knot, p100), got {num_quantiles}")
    return int(num_quantiles)


def quantile_levels(num_quantiles: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``K`` uniform levels ``0, 1/(K-1), ..., 1`` in float64 (``K`` checked by :func:`check_num_quantiles`)."""
    num_quantiles = check_num_quantiles(num_quantiles)
    return torch.linspace(0.0, 1.0, num_quantiles, dtype=torch.float64, device=device)


def sorted_quantiles(sorted_values: torch.Tensor, num_quantiles: int) -> torch.Tensor:
    """Quantiles of each row of an already sorted ``(C, M)`` tensor, linear interpolation ("type 7").

    Matches ``numpy.quantile(..., method="linear")``; returns ``(C, K)`` in the input dtype.
    """
    m = sorted_values.shape[-1]
    if m == 0:
        raise ValueError("cannot compute quantiles of an empty channel")
    pos = quantile_levels(num_quantiles, sorted_values.device) * (m - 1)
    lo = pos.floor().long().clamp_(0, m - 1)
    hi = (lo + 1).clamp_(max=m - 1)
    frac = (pos - lo.to(pos.dtype)).to(sorted_values.dtype)
    return lerp_knots(sorted_values[..., lo], sorted_values[..., hi], frac)


def lerp_knots(a: torch.Tensor, b: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """``a + (b - a) * frac`` for ``a <= b`` (exact when ``a == b``: tied knots stay tied), without
    overflow between finite values.

    ``b - a`` overflows float32 for ``a = -b = 3e38``: there (only) it is computed in float64, as
    aqr's C kernels do; float64 values fall back to ``a * (1 - frac) + b * frac``.
    """
    out = a + (b - a) * frac
    if a.dtype != torch.float64:
        wide = (a.double() + (b.double() - a.double()) * frac.double()).to(a.dtype)
    else:
        wide = a * (1 - frac) + b * frac
    return torch.where(torch.isfinite(out) | ~torch.isfinite(a) | ~torch.isfinite(b), out, wide)


def sort_rows(x: torch.Tensor) -> torch.Tensor:
    """Sort each row of a 2-D float tensor ascending.

    On CPU this goes through numpy, whose SIMD sort is an order of magnitude faster than
    ``torch.sort`` (8 ms vs 125 ms for 16 x 32,768 float32 values on a 2-core machine).
    """
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(np.sort(x.numpy(), axis=-1))
    return torch.sort(x, dim=-1).values


def channel_quantiles(x: torch.Tensor, num_quantiles: int, dim: int = 0) -> torch.Tensor:
    """Exact per-channel quantiles ``(C, K)`` of ``x`` with channels on ``dim`` (float32 or wider).

    ``num_quantiles`` is checked (:func:`check_num_quantiles`) and a ``K`` whose knots would not fit in
    memory is a ``MemoryError`` before anything is allocated.
    """
    num_quantiles = check_num_quantiles(num_quantiles)
    flat = to_channel_rows(x, dim)
    # the levels (float64), two index rows (int64) and three (C, K) gathers of the values' dtype; read
    # against /proc only when large, so the per-batch calls stay free of file reads
    needed = num_quantiles * (24 + 3 * flat.shape[0] * max(flat.element_size(), 4))
    if needed > 1 << 28:
        check_memory(needed, f"channel_quantiles with num_quantiles={num_quantiles} for {flat.shape[0]} channels")
    if not flat.dtype.is_floating_point or flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return sorted_quantiles(sort_rows(flat), num_quantiles)


def to_channel_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """View/copy ``x`` as ``(C, M)`` with the channel dim first."""
    if x.ndim == 0:
        raise ValueError("expected a tensor with a channel dimension, got a scalar")
    return x.movedim(dim, 0).reshape(x.shape[dim], -1)


def interp_levels(x: torch.Tensor, target_q: torch.Tensor, branch_free: bool = False) -> torch.Tensor:
    """Fractional knot index ``u`` in ``[0, K-1]`` (extrapolated outside) of each value of ``x`` (C, M).

    ``branch_free`` computes the tied-knot correction for every value instead of only where a tie
    occurs: the same result without reading a flag back from the device (no GPU synchronisation).
    """
    k = target_q.shape[1]
    hi = torch.searchsorted(target_q, x, right=True)  # number of knots <= x, in [0, K]
    j = (hi - 1).clamp_(0, k - 2)
    lo_knot = target_q.gather(1, j)
    width = target_q.gather(1, j + 1) - lo_knot
    # Inside the range width > 0 by construction (lo_knot <= x < next knot). At the edges, where x
    # falls outside, a zero width means "clamp"; guard the division and zero the slope instead.
    safe = torch.where(width > 0, width, torch.ones_like(width))
    t = torch.where(width > 0, (x - lo_knot) / safe, (x > lo_knot).to(x.dtype))
    u = j.to(x.dtype) + t
    # A value equal to a knot may sit in a run of tied knots p_a = ... = p_b: use the middle level.
    last = (hi - 1).clamp_(min=0)
    tie = (hi > 0) & (x == target_q.gather(1, last))
    if branch_free:
        run_start = torch.searchsorted(target_q, target_q)  # first index of each knot's value
        return torch.where(tie, (run_start.gather(1, last) + last).to(x.dtype) / 2, u)
    if bool(tie.any()):
        run_start = torch.searchsorted(target_q, target_q)
        rows, cols = tie.nonzero(as_tuple=True)
        last = last[rows, cols]
        u[rows, cols] = (run_start[rows, last] + last).to(x.dtype) / 2
    return u


def eval_levels(u: torch.Tensor, source_q: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of the source knots at fractional indices ``u`` (linear beyond)."""
    k = source_q.shape[1]
    # clamped as a float first: converting floor(+-inf) or NaN to an integer is undefined (x86 gives
    # INT64_MIN, which the clamp would turn into interval 0 for +inf); NaN takes interval 0
    i = torch.nan_to_num(u.floor(), nan=0.0).clamp_(0, k - 2).long()
    frac = u - i.to(u.dtype)
    a = source_q.gather(1, i)
    return a + (source_q.gather(1, i + 1) - a) * frac


def gaussian_z(num_quantiles: int, gaussian_p: float) -> tuple[float, float]:
    """Standard normal quantiles at the two anchors of Gaussian Estimation: p0 (``gaussian_p``) and p_{K-2}.

    (The slopes need no probits: their differences cancel, see :func:`tail_lines`.)
    """
    q = NormalDist().inv_cdf
    return q(gaussian_p), q((num_quantiles - 2) / (num_quantiles - 1))


def quantile_map(
    x: torch.Tensor,
    source_q: torch.Tensor,
    target_q: torch.Tensor | None = None,
    tail: Tail = "standard",
    *,
    dim: int = 0,
    source_loc: torch.Tensor | None = None,
    source_scale: torch.Tensor | None = None,
    gaussian_p: float = DEFAULT_GAUSSIAN_P,
) -> torch.Tensor:
    """Map ``x`` (channels on ``dim``) from the target quantiles onto the source quantiles.

    Args:
        x: values to recalibrate; channel ``c`` is ``x.select(dim, c)``.
        source_q: ``(C, K)`` source knots (non-decreasing along K).
        target_q: ``(C, K)`` knots of ``x`` itself; computed exactly from ``x`` when ``None``.
        tail: how the two edge intervals ``[p0, p1)`` and ``[p_{K-2}, p_{K-1}]`` are treated:

            * ``"standard"``/``"average"``: Eq. 1 everywhere. They differ only in the *source*
              ``p0``/``p100`` the caller passes (empirical extremes vs. averaged small-sample
              extremes, see :class:`aqr.SourceStats`).
            * ``"none"`` ("Not Calibrated", paper Eq. 5): values below ``p1^T`` or at/above
              ``p_{K-2}^T`` are returned unchanged.
            * ``"clip"`` (paper Eq. 6, literally): such values are set to ``p1^T`` / ``p_{K-2}^T``
              (the *target* knots, as printed in the paper).
            * ``"clip-source"`` (the other reading of Eq. 6): set to the *source* knots ``p1^S`` /
              ``p_{K-2}^S``, where the map sends ``p1^T`` and ``p_{K-2}^T``, so the map stays continuous.
            * ``"interval"`` (paper Eq. 7): ``(x - p0^T) / std(X) * gamma + p0^S`` below ``p1^T`` and
              ``(x - p_{K-2}^T) / std(X) * gamma + p_{K-2}^S`` above, ``X`` the channel's values in
              this batch and ``gamma = source_scale``.
            * ``"gaussian"`` (paper App., Eq. 8): the edge intervals use Gaussian quantile functions
              ``Q^S(p) = source_loc + source_scale * probit(p)`` and ``Q^T(p) = mean(X) + std(X) *
              probit(p)``, with ``p = gaussian_p`` standing in for ``p0`` and ``1 - gaussian_p`` for
              ``p100`` (their probits are infinite). The lower tail is anchored at ``Q^S(p0)``, the
              upper one at the empirical ``p_{K-2}^S``, exactly as the paper prints it. Because both
              sides use the same ``p``, the result does not depend on ``gaussian_p``: the lower
              tail is ``source_loc + (x - mean) * source_scale / std`` and the upper one
              ``p_{K-2}^S + (x - Q^T(u_{K-2})) * source_scale / std``.
        source_loc: ``(C,)`` location of the source channel's Gaussian/affine description (the
            normalization layer's ``beta`` in the paper); needed by ``"gaussian"``.
        source_scale: ``(C,)`` its scale (the layer's ``gamma``); needed by ``"interval"`` and
            ``"gaussian"``.
        gaussian_p: the level used for ``p0`` (and ``1 - gaussian_p`` for ``p100``) by ``"gaussian"``.

    Returns:
        A tensor shaped like ``x``, in ``x``'s dtype (computed in float32 or wider).
    """
    check_tail(tail)
    if source_q.ndim != 2:
        raise ValueError(f"source_q must be (channels, quantiles), got shape {tuple(source_q.shape)}")
    c, k = source_q.shape
    if x.ndim == 0 or x.shape[dim] != c:
        raise ValueError(f"x has {x.shape[dim] if x.ndim else 0} channels on dim {dim}, source_q has {c}")
    if k < 3:
        raise ValueError(f"need at least 3 quantiles (p0, an inner knot, p100), got {k}")
    out_dtype = x.dtype
    work = torch.promote_types(x.dtype, torch.float32)
    rows = to_channel_rows(x, dim).to(work)
    sq = source_q.to(device=rows.device, dtype=work)
    tq = channel_quantiles(rows, k) if target_q is None else target_q.to(device=rows.device, dtype=work)
    if tq.shape != (c, k):
        raise ValueError(f"target_q has shape {tuple(tq.shape)}, expected {(c, k)}")
    _refuse_nonfinite(rows, tq if target_q is None else None, dim)
    for name, knots in (("source_q", sq), ("target_q", tq)):
        if not bool(torch.isfinite(knots).all()):
            raise ValueError(f"{name} holds NaN or Inf; quantile_map needs finite knots")

    y = map_rows(rows, sq, tq, tail, source_loc, source_scale, gaussian_p)
    shape = list(x.shape)
    shape.insert(0, shape.pop(dim))
    return y.reshape(shape).movedim(0, dim).to(out_dtype)


def _refuse_nonfinite(rows: torch.Tensor, own_knots: torch.Tensor | None, dim: int) -> None:
    """Raise ``ValueError`` naming the first channel of ``rows`` (C, M) that holds NaN or Inf. With
    ``own_knots``, the rows' exact knots, only their ends are read: NaN sorts last and +-Inf sit at the ends."""
    if own_knots is not None:
        bad = ~(torch.isfinite(own_knots[:, 0]) & torch.isfinite(own_knots[:, -1]))
    else:
        bad = ~torch.isfinite(rows).all(dim=1)
    if not bool(bad.any()):
        return
    channel = int(bad.nonzero()[0, 0])
    count = int((~torch.isfinite(rows[channel])).sum())
    raise ValueError(f"x holds NaN or Inf: {count} of the {rows.shape[1]} values of channel {channel} (on dim {dim}); "
                     "quantile_map maps finite values only (aqr.AQR refuses them the same way)")


def map_rows(
    rows: torch.Tensor,
    source_q: torch.Tensor,
    target_q: torch.Tensor,
    tail: str = "standard",
    source_loc: torch.Tensor | None = None,
    source_scale: torch.Tensor | None = None,
    gaussian_p: float = DEFAULT_GAUSSIAN_P,
) -> torch.Tensor:
    """:func:`quantile_map` on ``(C, M)`` rows with ``(C, K)`` knots, all of one float dtype and device."""
    lines = None
    if tail in ("none", "clip", "clip-source", "interval", "gaussian"):
        mean = std = None
        if tail in PARAMETRIC_TAILS:  # in float64: squares of float32 values above 1.8e19 overflow
            var, mean = torch.var_mean(rows.double(), dim=1, correction=0, keepdim=True)
            mean, std = mean.to(rows.dtype), var.sqrt().to(rows.dtype)
        lines = tail_lines(source_q, target_q, tail, mean, std, source_loc, source_scale, gaussian_p)
    return map_rows_with_lines(rows, source_q, target_q, lines)


def map_rows_with_lines(
    rows: torch.Tensor,
    source_q: torch.Tensor,
    target_q: torch.Tensor,
    lines: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Eq. 1 with the tie rule on ``(C, M)`` rows, then, unless ``lines`` is ``None`` (the Eq. 1
    tails), the tail lines of :func:`tail_lines` below ``p1^T`` and at or above ``p_{K-2}^T``."""
    rows, target_q = rows.contiguous(), target_q.contiguous()
    y = eval_levels(interp_levels(rows, target_q), source_q)
    if lines is None:
        return y
    k = target_q.shape[1]
    a_lo, b_lo, a_hi, b_hi = lines
    y = torch.where(rows < target_q[:, 1:2], a_lo * rows + b_lo, y)
    return torch.where(rows >= target_q[:, k - 2 : k - 1], a_hi * rows + b_hi, y)


def tail_lines(
    sq: torch.Tensor,
    tq: torch.Tensor,
    tail: str,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    source_loc: torch.Tensor | None = None,
    source_scale: torch.Tensor | None = None,
    gaussian_p: float = DEFAULT_GAUSSIAN_P,
    z: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every tail strategy is affine on each edge region: ``(a_lo, b_lo, a_hi, b_hi)``, each ``(C, 1)``.

    ``z`` is :func:`gaussian_z` computed ahead (outside ``torch.compile``, which cannot trace it).

    Below ``p1^T`` the map is ``a_lo * x + b_lo``; at or above ``p_{K-2}^T`` it is ``a_hi * x + b_hi``.
    ``mean``/``std`` (``(C, 1)``) are the batch moments of the channel, needed by the parametric tails.
    """
    k = tq.shape[1]
    t0, t1, t98, t99 = tq[:, :1], tq[:, 1:2], tq[:, k - 2 : k - 1], tq[:, k - 1 :]
    s0, s1, s98, s99 = sq[:, :1], sq[:, 1:2], sq[:, k - 2 : k - 1], sq[:, k - 1 :]
    if tail in ("standard", "average"):  # Eq. 1 on the edge intervals, extended linearly beyond
        a_lo = _slope(s1 - s0, t1 - t0)
        a_hi = _slope(s99 - s98, t99 - t98)
        return a_lo, s0 - a_lo * t0, a_hi, s98 - a_hi * t98
    if tail == "none":
        one, zero = torch.ones_like(t0), torch.zeros_like(t0)
        return one, zero, one, zero
    if tail == "clip":
        zero = torch.zeros_like(t0)
        return zero, t1, zero, t98
    if tail == "clip-source":
        zero = torch.zeros_like(t0)
        return zero, s1, zero, s98
    if mean is None or std is None:
        raise ValueError(f'tail="{tail}" needs the batch mean and std of each channel')
    std = torch.where(std > 0, std, torch.ones_like(std))  # constant channel: no spread to rescale
    scale = _per_channel(source_scale, "source_scale", tail, sq)
    if tail == "interval":
        a = scale / std
        return a, s0 - a * t0, a, s98 - a * t98
    loc = _per_channel(source_loc, "source_loc", tail, sq)
    z0, z98 = z if z is not None else gaussian_z(k, gaussian_p)
    # Q^T(p) = mean + std z(p), Q^S(p) = loc + scale z(p); lower anchored at Q^S(p0), upper at p_{K-2}^S.
    # Both slopes, (Q^S(p1) - Q^S(p0)) / (Q^T(p1) - Q^T(p0)) and the upper one, are scale / std: the
    # probit differences cancel (computing them would give 0 / 0 when gaussian_p = 1 / (K - 1)).
    a = scale / std
    return a, (loc + scale * z0) - a * (mean + std * z0), a, s98 - a * (mean + std * z98)


def _slope(rise: torch.Tensor, run: torch.Tensor) -> torch.Tensor:
    return torch.where(run > 0, rise / torch.where(run > 0, run, torch.ones_like(run)), torch.zeros_like(run))


def _per_channel(v: torch.Tensor | None, name: str, tail: str, like: torch.Tensor) -> torch.Tensor:
    if v is None:
        raise ValueError(f'tail="{tail}" needs {name} (one value per channel)')
    v = torch.as_tensor(v).to(device=like.device, dtype=like.dtype).reshape(-1, 1)
    if v.shape[0] != like.shape[0]:
        raise ValueError(f"{name} has {v.shape[0]} values, expected one per channel ({like.shape[0]})")
    return v
