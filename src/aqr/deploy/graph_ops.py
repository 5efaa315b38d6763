"""The operations of AQR's maps written for a graph exporter: pure torch, no data-dependent Python branch,
no operator that ONNX lacks (``searchsorted`` and ``cummax`` are spelled out here).

Each function computes what its counterpart in :mod:`aqr.core.qmap` (the per-batch map) or
:mod:`aqr.adapt.stream.torch_kernels` (the streaming state) computes, with the same float32 and float64
operations, so an exported graph agrees with eager AQR to rounding.
"""

from __future__ import annotations

import torch

from aqr.adapt.stream.torch_kernels import count_bins, index_of, line, saturate


def count_sorted(knots: torch.Tensor, v: torch.Tensor, right: bool = True) -> torch.Tensor:
    """``torch.searchsorted(knots, v, right=right)`` for rows ``knots`` ``(C, n)`` sorted ascending and ``v``
    ``(C, M)``, as an unrolled binary search (``ceil(log2(n + 1))`` gathers): the number of knots ``<= v``
    (``right``) or ``< v`` in each row."""
    n = int(knots.shape[1])
    pos = torch.zeros(v.shape, dtype=torch.int64, device=v.device)
    step = 1 << n.bit_length()
    while step > 1:
        step //= 2
        cand = pos + step
        idx = torch.clamp(cand - 1, max=n - 1)
        at = knots.gather(1, idx)
        ok = (cand <= n) & ((at <= v) if right else (at < v))
        pos = torch.where(ok, cand, pos)
    return pos


def running_max(x: torch.Tensor) -> torch.Tensor:
    """``torch.cummax(x, dim=1).values`` of ``(C, L)`` rows (a Hillis-Steele scan, ``log2 L`` steps)."""
    length = int(x.shape[1])
    shift = 1
    while shift < length:
        pad = x[:, :1].expand(-1, shift)  # the row's first value: never above the running max
        x = torch.maximum(x, torch.cat([pad, x[:, : length - shift]], dim=1))
        shift *= 2
    return x


def exact_quantiles(rows: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``(C, K)`` type-7 quantiles of each row of ``rows`` ``(C, M)`` at ``levels`` (float64 ``(K,)``), as
    :func:`aqr.core.qmap.channel_quantiles` computes them (sort, then linear interpolation)."""
    m = rows.shape[1]
    s = torch.sort(rows, dim=1).values
    pos = levels * (m - 1)
    lo = pos.floor()
    frac = (pos - lo).to(rows.dtype)
    a = s.index_select(1, lo.long())
    b = s.index_select(1, pos.ceil().long())  # = lo + 1 where frac > 0, lo where it is 0 (then a + 0)
    return a + (b - a) * frac


def interp_levels(rows: torch.Tensor, target_q: torch.Tensor) -> torch.Tensor:
    """:func:`aqr.core.qmap.interp_levels` (its branch-free form): each value's fractional knot index."""
    k = int(target_q.shape[1])
    hi = count_sorted(target_q, rows, right=True)
    j = torch.clamp(hi - 1, 0, k - 2)
    lo_knot = target_q.gather(1, j)
    width = target_q.gather(1, j + 1) - lo_knot
    safe = torch.where(width > 0, width, torch.ones_like(width))
    t = torch.where(width > 0, (rows - lo_knot) / safe, (rows > lo_knot).to(rows.dtype))
    u = j.to(rows.dtype) + t
    last = torch.clamp(hi - 1, min=0)
    tie = (hi > 0) & (rows == target_q.gather(1, last))
    run_start = count_sorted(target_q, target_q, right=False)
    return torch.where(tie, (run_start.gather(1, last) + last).to(rows.dtype) / 2, u)


def eval_levels(u: torch.Tensor, source_q: torch.Tensor) -> torch.Tensor:
    """:func:`aqr.core.qmap.eval_levels`: the source knots interpolated at the fractional indices ``u``."""
    k = int(source_q.shape[1])
    i = torch.clamp(torch.nan_to_num(u.floor(), nan=0.0), 0, k - 2).long()
    frac = u - i.to(u.dtype)
    a = source_q.gather(1, i)
    return a + (source_q.gather(1, i + 1) - a) * frac


# ---------------------------------------------------------------------------------- the stream's table


def table_lines(knots: torch.Tensor, source: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor, torch.Tensor]:
    """The lookup table of the map from ``knots`` onto ``source`` (both ``(C, K)`` float32), as
    :meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.tables` builds it: ``(slopes, intercepts)``
    ``(C, grid + 2)`` and the grid's start and inverse cell width ``(C,)``."""
    k = int(knots.shape[1])
    kd, sd = knots.double(), source.double()
    lo = kd[:, 1:2]
    span = kd[:, k - 2 : k - 1] - lo
    width = torch.where(span > 0, span / grid, torch.zeros_like(span))
    inv = torch.where(width > 0, 1.0 / torch.where(width > 0, width, torch.ones_like(width)), torch.zeros_like(width))
    al, bl = line(kd[:, 0], sd[:, 0], kd[:, 1], sd[:, 1], sd[:, 1])
    ah, bh = line(kd[:, k - 2], sd[:, k - 2], kd[:, k - 1], sd[:, k - 1], sd[:, k - 2])
    steps = torch.arange(1, grid, dtype=torch.float64, device=kd.device)
    gx = torch.cat([lo + width * steps, kd[:, k - 2 : k - 1]], dim=1)
    q = torch.clamp(count_sorted(kd, gx, right=True) - 1, 1, k - 2)
    top = q >= k - 2
    q0 = torch.clamp(q, max=k - 3) if k > 3 else q
    q1 = torch.clamp(q0 + 1, max=k - 1)
    kq, kq1, sq, sq1 = kd.gather(1, q0), kd.gather(1, q1), sd.gather(1, q0), sd.gather(1, q1)
    run = kq1 - kq
    rise = torch.where(run > 0, (sq1 - sq) / torch.where(run > 0, run, torch.ones_like(run)), torch.zeros_like(run))
    yv = torch.where(top, sd[:, k - 2 : k - 1].expand_as(gx), sq + (gx - kq) * rise)
    gprev = torch.cat([lo, gx[:, :-1]], dim=1)
    yprev = torch.cat([sd[:, 1:2], yv[:, :-1]], dim=1)
    rising = width > 0
    slope = torch.where(rising, saturate((yv - yprev) * inv), torch.zeros_like(yv, dtype=torch.float32))
    icpt = saturate(torch.where(rising, yprev - slope.double() * gprev, yv))
    slopes = torch.cat([al[:, None], slope, ah[:, None]], dim=1)
    intercepts = torch.cat([bl[:, None], icpt, bh[:, None]], dim=1)
    return slopes, intercepts, knots[:, 1].contiguous(), saturate(inv[:, 0])


def table_map(v: torch.Tensor, knots: torch.Tensor, source: torch.Tensor, slopes: torch.Tensor,
              intercepts: torch.Tensor, glo: torch.Tensor, ginv: torch.Tensor) -> torch.Tensor:
    """``v`` ``(C, M)`` mapped by the stream's table (:func:`table_lines` of ``knots``), its edge lines stretched
    out to the values' extremes where they pass the knots' ends: the ``MAP`` of
    :meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.scan`, on channel rows."""
    k = int(knots.shape[1])
    g = int(slopes.shape[1]) - 2
    k0, k1, kb, kl = (knots[:, j : j + 1] for j in (0, 1, k - 2, k - 1))
    cell = index_of((v - glo[:, None]) * ginv[:, None] + 1.0, g + 1)
    cell = torch.where(v >= kb, torch.full_like(cell, g + 1), cell)
    cell = torch.where(v < k1, torch.zeros_like(cell), cell)
    y = slopes.gather(1, cell) * v + intercepts.gather(1, cell)
    bmin, bmax = v.amin(dim=1), v.amax(dim=1)
    d = lambda t: t.double()  # noqa: E731
    s = source
    al, bl = line(d(torch.minimum(bmin, knots[:, 0])), d(s[:, 0]), d(knots[:, 1]), d(s[:, 1]), d(s[:, 1]))
    ah, bh = line(d(knots[:, k - 2]), d(s[:, k - 2]), d(torch.maximum(bmax, knots[:, k - 1])), d(s[:, k - 1]),
                  d(s[:, k - 2]))
    low = (v < k1) & (bmin < knots[:, 0])[:, None]
    high = (v >= kb) & ~(v < k1) & (bmax > knots[:, k - 1])[:, None]
    y = torch.where(low, al[:, None] * v + bl[:, None], y)
    return torch.where(high, ah[:, None] * v + bh[:, None], y)


# ---------------------------------------------------------------------------------- the stream's merge


def cdf_at(z: torch.Tensor, h: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`aqr.adapt.stream.torch_kernels.cdf_at`: ``F(v-)`` and ``F(v)`` of the piecewise-linear CDFs
    through ``(z, h)``."""
    n = int(z.shape[1])
    lt = count_sorted(z, v, right=False)
    le = count_sorted(z, v, right=True)
    lo = torch.clamp(lt - 1, 0, n - 1)
    hi = torch.clamp(lt, 0, n - 1)
    z0, z1, h0, h1 = z.gather(1, lo), z.gather(1, hi), h.gather(1, lo), h.gather(1, hi)
    run = z1 - z0
    t = torch.where(run > 0, (v - z0) / torch.where(run > 0, run, torch.ones_like(run)), torch.ones_like(run))
    f = h0 + torch.clamp(t, 0, 1) * (h1 - h0)
    f = torch.where(lt == 0, torch.zeros_like(f), torch.where(lt >= n, torch.ones_like(f), f))
    point = lt < le
    left = torch.where(point, torch.where(lt == 0, torch.zeros_like(f), h.gather(1, hi)), f)
    right = torch.where(point, h.gather(1, torch.clamp(le - 1, 0, n - 1)), f)
    return left, right


def curve_quantiles(z: torch.Tensor, hl: torch.Tensor, hr: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`aqr.adapt.stream.torch_kernels.curve_quantiles`: the inner quantiles of a CDF given at its
    sorted breakpoints."""
    points = torch.cat([z[:, :1], torch.stack([z, z], dim=2).flatten(1)], dim=1)
    levels = torch.cat([torch.zeros_like(z[:, :1]), torch.stack([hl, hr], dim=2).flatten(1)], dim=1)
    levels = running_max(levels)
    u = (torch.arange(1, k - 1, dtype=z.dtype, device=z.device) / (k - 1)).expand(int(z.shape[0]), -1)
    n = int(points.shape[1])
    i = count_sorted(levels, u, right=False)
    past = i >= n
    i = torch.clamp(i, 1, n - 1)
    z0, z1, h0, h1 = points.gather(1, i - 1), points.gather(1, i), levels.gather(1, i - 1), levels.gather(1, i)
    rise = h1 - h0
    f = torch.where(rise > 0, (u - h0) / torch.where(rise > 0, rise, torch.ones_like(rise)), torch.ones_like(rise))
    q = z0 + torch.clamp(f, 0, 1) * (z1 - z0)
    q = torch.minimum(torch.maximum(q, z0), z1)
    return saturate(torch.where(past, points[:, n - 1 :].expand_as(q), q))


def merged_knots(knots: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor, gmax: torch.Tensor,
                 weight: torch.Tensor, p0: torch.Tensor, p100: torch.Tensor) -> torch.Tensor:
    """``knots`` ``(C, K)`` after :meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.merge` of the pending
    histogram ``counts`` ``(C, cells + 4)`` (on the knots' own bins, spanning ``gmin``/``gmax``) at ``weight``
    (a float64 0-d tensor, > 0), the ends set to ``p0``/``p100``."""
    c, k = knots.shape
    cells = int(counts.shape[1]) - 4
    counts = torch.clamp(counts.double(), min=0)
    total = counts.sum(dim=1, keepdim=True)
    kd = knots.double()
    k0, k1, kb, kl = (kd[:, j : j + 1] for j in (0, 1, k - 2, k - 1))
    lo = torch.minimum(gmin.double()[:, None], k0)
    hi = torch.maximum(gmax.double()[:, None], kl)
    steps = torch.arange(1, cells, dtype=torch.float64, device=kd.device)
    zb = torch.cat([lo, k0, k1, k1 + (kb - k1) * steps / cells, kb, kl, hi], dim=1)
    cum = counts.cumsum(dim=1)[:, : cells + 3] / torch.where(total > 0, total, torch.ones_like(total))
    hb = torch.cat([torch.zeros_like(lo), cum, torch.ones_like(lo)], dim=1)
    ha = (torch.arange(k, dtype=torch.float64, device=kd.device) / (k - 1)).expand(c, -1)
    z = torch.sort(torch.cat([kd, zb], dim=1), dim=1).values
    fal, far = cdf_at(kd, ha, z)
    fbl, fbr = cdf_at(zb, hb, z)
    fresh = curve_quantiles(z, (1 - weight) * fal + weight * fbl, (1 - weight) * far + weight * fbr, k)
    inner = torch.where((total > 0).expand(-1, k - 2), fresh, knots[:, 1 : k - 1])
    first = torch.minimum(p0.to(knots.dtype), inner[:, :1].squeeze(1))
    last = torch.maximum(p100.to(knots.dtype), inner[:, -1:].squeeze(1))
    return torch.cat([first[:, None], inner, last[:, None]], dim=1)


def histogram(values: torch.Tensor, knots: torch.Tensor, cells: int) -> torch.Tensor:
    """``(C, cells + 4)`` int64: the histogram of ``values`` ``(C, M)`` on the bins of ``knots`` (the
    ``COUNT`` of :meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.scan`)."""
    bins = count_bins(values, knots, cells)
    counts = torch.zeros(int(values.shape[0]), cells + 4, dtype=torch.int64, device=values.device)
    return counts.scatter_add(1, bins, torch.ones_like(bins))
