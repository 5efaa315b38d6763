"""Streaming AQR's operations in torch, on any device: the reference for the C kernels.

Each method computes what its counterpart in ``_stream_kernels.c`` computes, with the same float32
and float64 operations in the same order where the result depends on it, so the two agree to
rounding (``tests/stream_fuzz.py`` holds them to it). Only the sums of the tails and the sorting of
the window differ in order, not in value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from aqr.adapt.layer_maps import host_reads_are_cheap
from aqr.backends.base import Affine
from aqr.adapt.stream.base import (COUNT, EDGE_BINS, IMAGE_COUNT, MAP, PAIRED, ClusterScan, PendingGroup,
                                   ScanResult, StreamKernels, StreamTable, TailWindow, check_clusters,
                                   check_mixture_weights, check_scan, on_device, settled)

FLT_MAX = torch.finfo(torch.float32).max


def saturate(v: torch.Tensor) -> torch.Tensor:
    """float32 of a float64 tensor, NaN to 0 and beyond +-FLT_MAX to +-FLT_MAX (``stream_float``)."""
    return torch.nan_to_num(v, nan=0.0).clamp(-FLT_MAX, FLT_MAX).float()


def index_of(f: torch.Tensor, top: int) -> torch.Tensor:
    """``f`` clamped to ``[0, top]``, NaN to 0, as int64 (``stream_index``)."""
    f = torch.where(f > 0, f, torch.zeros_like(f))
    return torch.where(f < top, f, torch.full_like(f, top)).long()


def line(x0: torch.Tensor, y0: torch.Tensor, x1: torch.Tensor, y1: torch.Tensor,
         flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The line through ``(x0, y0)`` and ``(x1, y1)`` (float64 in), flat at ``flat`` where ``x1 <= x0``
    (``stream_line``): float32 slope and intercept."""
    run = x1 - x0
    rising = run > 0
    slope = saturate(torch.where(rising, (y1 - y0) / torch.where(rising, run, torch.ones_like(run)),
                                 torch.zeros_like(run)))
    icpt = saturate(torch.where(rising, y0 - slope.double() * x0, flat))
    return slope, icpt


def cdf_at(z: torch.Tensor, h: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``F(v-)`` and ``F(v)`` ``(C, M)`` of the piecewise-linear CDFs through points ``(z, h)`` ``(C, n)``
    (nondecreasing rows; tied points are atoms) at ``v`` ``(C, M)`` (``stream_cdf_at``)."""
    n = z.shape[1]
    lt = torch.searchsorted(z, v, right=False)
    le = torch.searchsorted(z, v, right=True)
    lo = (lt - 1).clamp(0, n - 1)
    hi = lt.clamp(0, n - 1)
    z0, z1, h0, h1 = z.gather(1, lo), z.gather(1, hi), h.gather(1, lo), h.gather(1, hi)
    run = z1 - z0
    t = torch.where(run > 0, (v - z0) / torch.where(run > 0, run, torch.ones_like(run)), torch.ones_like(run))
    f = h0 + t.clamp(0, 1) * (h1 - h0)
    f = torch.where(lt == 0, torch.zeros_like(f), torch.where(lt >= n, torch.ones_like(f), f))
    point = lt < le
    left = torch.where(point, torch.where(lt == 0, torch.zeros_like(f), h.gather(1, hi)), f)
    right = torch.where(point, h.gather(1, (le - 1).clamp(0, n - 1)), f)
    return left, right


def mix_quantiles(za: torch.Tensor, ha: torch.Tensor, zb: torch.Tensor, hb: torch.Tensor,
                  w: "float | torch.Tensor", k: int) -> torch.Tensor:
    """``(C, K - 2)``: the quantiles at levels ``j / (K - 1)``, ``j = 1..K-2``, of ``(1 - w) F_a + w F_b``
    (float64 points ``(C, n)``; ``w`` a number or a ``(C, 1)`` tensor; ``stream_mix_quantiles``)."""
    z = torch.sort(torch.cat([za, zb], dim=1), dim=1).values
    fal, far = cdf_at(za, ha, z)
    fbl, fbr = cdf_at(zb, hb, z)
    return curve_quantiles(z, (1 - w) * fal + w * fbl, (1 - w) * far + w * fbr, k)


def curve_quantiles(z: torch.Tensor, hl: torch.Tensor, hr: torch.Tensor, k: int) -> torch.Tensor:
    """``(C, K - 2)``: the inner quantiles (levels ``j / (K - 1)``) of the CDF that is ``hl`` just left of and
    ``hr`` at each sorted breakpoint ``z`` ``(C, M)`` (float64). The quantile curve runs through
    ``(z, H(z-))`` and ``(z, H(z))`` at every breakpoint, linearly in between."""
    c = z.shape[0]
    points = torch.cat([z[:, :1], torch.stack([z, z], dim=2).flatten(1)], dim=1)
    levels = torch.cat([torch.zeros(c, 1, dtype=z.dtype, device=z.device), torch.stack([hl, hr], dim=2).flatten(1)],
                       dim=1)
    levels = torch.cummax(levels, dim=1).values  # rounding must not make the curve go down
    u = (torch.arange(1, k - 1, dtype=z.dtype, device=z.device) / (k - 1)).expand(c, -1).contiguous()
    i = torch.searchsorted(levels, u, right=False)
    past = i >= points.shape[1]  # rounding left the top levels unreached: the last point
    i = i.clamp(1, points.shape[1] - 1)
    z0, z1, h0, h1 = points.gather(1, i - 1), points.gather(1, i), levels.gather(1, i - 1), levels.gather(1, i)
    rise = h1 - h0
    f = torch.where(rise > 0, (u - h0) / torch.where(rise > 0, rise, torch.ones_like(rise)), torch.ones_like(rise))
    q = z0 + f.clamp(0, 1) * (z1 - z0)
    q = torch.minimum(torch.maximum(q, z0), z1)
    return saturate(torch.where(past, points[:, -1:].expand_as(q), q))


def histogram_points(knots: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                     gmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The piecewise-linear CDF of a histogram ``counts`` ``(C, cells + 4)`` taken on the bins of ``knots``
    ``(C, K)`` (:meth:`~aqr.adapt.stream.base.StreamKernels.scan`), whose values span ``gmin``/``gmax``
    ``(C,)``: its points ``(z, h)`` ``(C, cells + 5)`` (float64) and each row's total count ``(C, 1)``."""
    k = knots.shape[1]
    cells = counts.shape[1] - EDGE_BINS
    counts = counts.double().clamp(min=0)
    total = counts.sum(dim=1, keepdim=True)
    kd = knots.double()
    k0, k1, kb, kl = (kd[:, j : j + 1] for j in (0, 1, k - 2, k - 1))
    lo = torch.minimum(gmin.double()[:, None], k0)
    hi = torch.maximum(gmax.double()[:, None], kl)
    inner = k1 + (kb - k1) * torch.arange(1, cells + 1, dtype=torch.float64, device=kd.device) / cells
    inner[:, -1:] = kb
    zb = torch.cat([lo, k0, k1, inner, kl, hi], dim=1)
    cum = counts.cumsum(dim=1)[:, : cells + 3] / torch.where(total > 0, total, torch.ones_like(total))
    hb = torch.cat([torch.zeros_like(lo), cum, torch.ones_like(lo)], dim=1)
    return zb, hb, total


def merged_inner(knots: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor, gmax: torch.Tensor,
                 w: "float | torch.Tensor") -> torch.Tensor:
    """``(C, K - 2)``: the inner quantiles of ``(1 - w) F_knots + w F_hist``, ``F_hist`` the histogram
    ``counts`` taken on the bins of ``bins`` (:func:`histogram_points`); a row without counts keeps its
    inner knots (``stream_merge_histogram``)."""
    c, k = knots.shape
    zb, hb, total = histogram_points(bins, counts, gmin, gmax)
    fresh = mix_quantiles(knots.double(), knot_levels(k, c, knots.device), zb, hb, w, k)
    return torch.where((total > 0).expand(-1, k - 2), fresh, knots[:, 1 : k - 1])


def knot_levels(k: int, rows: int, device: torch.device | str) -> torch.Tensor:
    """``(rows, K)`` float64: the levels ``j / (K - 1)`` of K knots, one row per channel (contiguous, as
    :func:`cdf_at` reads them)."""
    return (torch.arange(k, dtype=torch.float64, device=device) / (k - 1)).expand(rows, -1).contiguous()


def count_bins(values: torch.Tensor, knots: torch.Tensor, cells: int) -> torch.Tensor:
    """Each value's bin (int64) of :meth:`~aqr.adapt.stream.base.StreamKernels.scan`'s histogram on the
    knots ``(C, K)`` (or one set per leading index, ``(..., C, K)``): ``values`` ``(..., C, M)``, channel ``c``'s
    values in row ``c`` of the last two dims."""
    k = knots.shape[-1]
    k0, k1, kb, kl = (knots[..., j : j + 1] for j in (0, 1, k - 2, k - 1))
    span = kb.double() - k1.double()
    cinv = torch.where(span > 0, saturate(cells / torch.where(span > 0, span, torch.ones_like(span))),
                       torch.zeros_like(k1))
    inner = 2 + index_of((values - k1) * cinv, cells - 1)
    edge_hi = torch.where(values >= kl, cells + 3, cells + 2)
    return torch.where(values < k1, (values >= k0).long(), torch.where(values >= kb, edge_hi, inner))


def mixture_quantiles(knots: torch.Tensor, k: int, grid: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``(C, K - 2)``: the inner quantiles, at levels ``j / (K - 1)``, of the mixture (``weights`` ``(M,)``,
    normalized; ``None``: equal) of the
    piecewise-linear CDFs through ``knots`` ``(M, C, K)`` (float64), the mixture evaluated at ``grid``
    points spread over the groups' inner knots and at every group's first two and last two knots
    (exact at those; linear in between, where the mixture bends within a cell; ``aqr_stream_mixture``)."""
    m, c, _ = knots.shape
    lo, hi = knots[:, :, 1].amin(0), knots[:, :, k - 2].amax(0)
    steps = torch.arange(grid, dtype=knots.dtype, device=knots.device) / (grid - 1)
    spread = lo[:, None] + (hi - lo)[:, None] * steps
    ends = knots[:, :, [0, 1, k - 2, k - 1]].permute(1, 0, 2).reshape(c, -1)
    z = torch.sort(torch.cat([spread, ends], dim=1), dim=1).values
    levels = knot_levels(k, c, knots.device)
    w = [1.0] * m if weights is None else weights.double().cpu().tolist()
    hl = torch.zeros_like(z)
    hr = torch.zeros_like(z)
    for g in range(m):  # one group at a time: memory C * (grid + 4 M), not M times that
        left, right = cdf_at(knots[g].contiguous(), levels, z)
        hl += w[g] * left
        hr += w[g] * right
    total = sum(w)  # (divided once, at the end: equal weights give the plain mean)
    return curve_quantiles(z, hl / total, hr / total, k)


def shift_distances(counts: torch.Tensor, knots: torch.Tensor) -> tuple[float, float]:
    """:meth:`~aqr.adapt.stream.base.StreamKernels.shift_distances` (``aqr_stream_shift_distances``)."""
    to_target, between = shift_distance_tensors(counts, knots)
    return float(to_target), float(between)


def shift_distance_tensors(counts: torch.Tensor, knots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`shift_distances` as 0-d float64 tensors on ``counts``' device (no host read)."""
    c, k = knots.shape
    counts = counts.clamp(min=0)  # (as the merges read a histogram)
    ends = knots[:, 0], knots[:, k - 1]
    # each half's CDF at the bins' edges (the points' first and last are the extremes: not edges)
    (z, even, n_even), (_, odd, n_odd) = (histogram_points(knots, counts[h::2].sum(0, dtype=torch.int64), *ends)
                                          for h in (0, 1))
    counted = ((n_even > 0) & (n_odd > 0))[:, 0]
    m = counted.sum().double()
    edges, even, odd = z[:, 1:-1].contiguous(), even[:, 1:-1], odd[:, 1:-1]
    pooled = (even * n_even + odd * n_odd) / (n_even + n_odd).clamp(min=1)
    _, target = cdf_at(knots.double().contiguous(), knot_levels(k, c, knots.device), edges)
    weight = counted.double()
    zero = torch.zeros((), dtype=torch.float64, device=m.device)
    mean = lambda d: torch.where(m > 0, (d * weight).sum() / m.clamp(min=1), zero)  # noqa: E731  (0 where none counted)
    return mean((pooled - target).abs().amax(1)), mean((even - odd).abs().amax(1))


class TorchStreamKernels(StreamKernels):
    """:class:`~aqr.adapt.stream.base.StreamKernels` in torch (any device, float32 state)."""

    name = "torch"

    def takes(self, x: torch.Tensor) -> bool:
        return True

    def scan(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor, source: torch.Tensor,
             table: StreamTable, mode: int, stride: int, cells: int) -> ScanResult:
        check_scan(x, images, knots, source, table, mode)
        a, c, b = x.shape
        v = x.float()
        if pre is not None:
            v = v * pre[0].view(1, c, 1) + pre[1].view(1, c, 1)
        per_image = v.reshape(images, a // images, c, b)
        lo, hi = per_image.amin(dim=(1, 3)), per_image.amax(dim=(1, 3))
        finite = settled(torch.isfinite(v).all())  # read on CPU only: a GPU's queue would wait at every layer
        if finite is False:
            return ScanResult(None, lo, hi, None, False)
        col = lambda t: t.view(1, c, 1)  # noqa: E731
        k0, k1, kb, kl = (col(knots[:, j]) for j in (0, 1, -2, -1))
        y = counts = None
        if mode & MAP:
            g = table.grid
            cell = index_of((v - col(table.glo)) * col(table.ginv) + 1.0, g + 1)
            cell = torch.where(v >= kb, torch.full_like(cell, g + 1), cell)
            cell = torch.where(v < k1, torch.zeros_like(cell), cell)
            flat = cell + col(torch.arange(c, device=v.device) * (g + 2))
            y = table.pairs[..., 0].reshape(-1)[flat] * v + table.pairs[..., 1].reshape(-1)[flat]
            bmin, bmax = lo.amin(0), hi.amax(0)
            d = lambda t: t.double()  # noqa: E731
            s = source
            al, bl = line(d(torch.minimum(bmin, knots[:, 0])), d(s[:, 0]), d(knots[:, 1]), d(s[:, 1]), d(s[:, 1]))
            ah, bh = line(d(knots[:, -2]), d(s[:, -2]), d(torch.maximum(bmax, knots[:, -1])), d(s[:, -1]),
                          d(s[:, -2]))
            low = (v < k1) & col(bmin < knots[:, 0])
            high = (v >= kb) & ~(v < k1) & col(bmax > knots[:, -1])
            y = torch.where(low, col(al) * v + col(bl), y)
            y = torch.where(high, col(ah) * v + col(bh), y)
        if mode & COUNT:
            bins = count_bins(v.permute(1, 0, 2).reshape(c, a * b)[:, ::stride], knots, cells)
            counts = torch.zeros(c, cells + EDGE_BINS, dtype=torch.int32, device=v.device)
            counts.scatter_add_(1, bins, torch.ones_like(bins, dtype=torch.int32))
        elif mode & IMAGE_COUNT:
            values = per_image.permute(0, 2, 1, 3).reshape(images, c, -1)[:, :, ::stride]
            bins = count_bins(values, knots, cells)
            counts = torch.zeros(images, c, cells + EDGE_BINS, dtype=torch.int32, device=v.device)
            counts.scatter_add_(2, bins, torch.ones_like(bins, dtype=torch.int32))
            if mode & PAIRED:  # the even images' histograms summed, then the odd images'
                halves = torch.zeros(2, c, cells + EDGE_BINS, dtype=torch.int32, device=v.device)
                counts = halves.index_add_(0, torch.arange(images, device=v.device) % 2, counts)
        return ScanResult(None if y is None else y.to(x.dtype), lo, hi, counts, finite)

    def cluster_scan(self, x: torch.Tensor, images: int, pre: Affine | None, source: torch.Tensor,
                     of: torch.Tensor, states: Sequence[tuple[torch.Tensor, StreamTable]], maps: Sequence[bool],
                     blend: float, y: torch.Tensor, stride: int, cells: int) -> ClusterScan:
        # every image at once, each on its cluster's state gathered by ``of`` on the device (the reference,
        # StreamKernels.cluster_scan, reads ``of`` on the host): the same operations per value, so the same bits
        check_clusters(x, images, source, of, states, maps, blend, y)
        a, c, b = x.shape
        rows = a // images
        v = x.float()
        if pre is not None:
            v = v * pre[0].view(1, c, 1) + pre[1].view(1, c, 1)
        v = v.reshape(images, rows, c, b)
        lo, hi = v.amin(dim=(1, 3)), v.amax(dim=(1, 3))
        member = of >= 0
        at = of.clamp(min=0)  # an image of no cluster reads cluster 0's state; what it gives is dropped
        counts = torch.zeros(len(states), c, cells + EDGE_BINS, dtype=torch.int32, device=x.device)
        finite = settled((torch.isfinite(v).all(dim=(1, 2, 3)) | ~member).all())
        if finite is False:
            return ClusterScan(lo, hi, counts, False)
        knots = torch.stack([k for k, _ in states])[at]  # (N, C, K)
        values = v.permute(0, 2, 1, 3).reshape(images, c, -1)[:, :, ::stride]
        bins = count_bins(values, knots, cells)
        own = torch.zeros(images, c, cells + EDGE_BINS, dtype=torch.int32, device=x.device)
        own.scatter_add_(2, bins, member.view(-1, 1, 1).to(torch.int32).expand_as(bins))
        counts.index_add_(0, at, own)
        if any(maps):
            self._cluster_map(v, lo, hi, knots, source, [t for _, t in states], at,
                              member & on_device(torch.tensor(list(maps)), x.device)[at], blend, y, x.dtype)
        return ClusterScan(lo, hi, counts, finite)

    @staticmethod
    def _cluster_map(v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, knots: torch.Tensor, source: torch.Tensor,
                     tables: list[StreamTable], at: torch.Tensor, mapped: torch.Tensor, blend: float,
                     y: torch.Tensor, dtype: torch.dtype) -> None:
        """:meth:`cluster_scan`'s maps: each image ``v`` ``(N, rows, C, B)`` mapped by its cluster's table (its
        edge lines stretched to its own extremes ``lo``/``hi``, as :meth:`scan` of it alone), and the rows of
        ``y`` of the ``mapped`` images moved ``blend`` of the way to it (the map rounded to ``dtype`` first, the
        input's, as :meth:`scan` gives it)."""
        n, _, c, _ = v.shape
        col = lambda t: t.view(n, 1, c, 1)  # noqa: E731
        k0, k1, kb, kl = (col(knots[:, :, j]) for j in (0, 1, -2, -1))
        pairs = torch.stack([t.pairs for t in tables])[at]  # (N, C, G + 2, 2)
        glo, ginv = torch.stack([t.glo for t in tables])[at], torch.stack([t.ginv for t in tables])[at]
        g = pairs.shape[2] - 2
        cell = index_of((v - col(glo)) * col(ginv) + 1.0, g + 1)
        cell = torch.where(v >= kb, torch.full_like(cell, g + 1), cell)
        cell = torch.where(v < k1, torch.zeros_like(cell), cell)
        flat = cell + (torch.arange(n * c, device=v.device) * (g + 2)).view(n, 1, c, 1)
        m = pairs[..., 0].reshape(-1)[flat] * v + pairs[..., 1].reshape(-1)[flat]
        d = lambda t: t.double()  # noqa: E731
        s = source
        al, bl = line(d(torch.minimum(lo, knots[:, :, 0])), d(s[:, 0]), d(knots[:, :, 1]), d(s[:, 1]), d(s[:, 1]))
        ah, bh = line(d(knots[:, :, -2]), d(s[:, -2]), d(torch.maximum(hi, knots[:, :, -1])), d(s[:, -1]),
                      d(s[:, -2]))
        low = (v < k1) & col(lo < knots[:, :, 0])
        high = (v >= kb) & ~(v < k1) & col(hi > knots[:, :, -1])
        m = torch.where(low, col(al) * v + col(bl), m)
        m = torch.where(high, col(ah) * v + col(bh), m).to(dtype).to(y.dtype)
        weight = torch.full((), blend, dtype=torch.float32, device=v.device)  # filled there: no copy to wait on
        shared = y.view(n, -1, c, v.shape[3])
        shared.copy_(torch.where(mapped.view(n, 1, 1, 1), shared + weight * (m - shared), shared))

    def push(self, window: TailWindow, group: PendingGroup | None, counts: torch.Tensor | None,
             lo: torch.Tensor, hi: torch.Tensor) -> None:
        n = lo.shape[0]
        size = window.size
        if group is not None:
            if counts is not None:
                group.counts += counts.to(group.counts)
            if n:
                torch.minimum(group.gmin, lo.amin(0), out=group.gmin)
                torch.maximum(group.gmax, hi.amax(0), out=group.gmax)
        if n:  # image i into row (head + i) % size; of more than size images, the last size ones stay
            first = max(0, n - size)
            rows = (window.head + torch.arange(first, n, device=window.ring_lo.device)) % size
            window.ring_lo.index_copy_(0, rows, lo[first:].to(window.ring_lo))
            window.ring_hi.index_copy_(0, rows, hi[first:].to(window.ring_hi))
        window.filled = min(window.filled + n, size)
        window.head = (window.head + n) % size
        f = window.filled
        window.sorted_lo[:, :f] = window.ring_lo[:f].t().sort(dim=1).values
        window.sorted_hi[:, :f] = (-window.ring_hi[:f].t()).sort(dim=1).values

    def tails(self, window: TailWindow, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(weights)
        if k > window.filled:
            raise ValueError(f"{k} tail weights for a window holding {window.filled} images")
        w = on_device(weights, window.sorted_lo.device).double()
        return saturate(window.sorted_lo[:, :k].double() @ w), saturate(-(window.sorted_hi[:, :k].double() @ w))

    def merge(self, knots: torch.Tensor, group: PendingGroup | None, weight: float, p0: torch.Tensor,
              p100: torch.Tensor) -> None:
        k = knots.shape[1]
        if isinstance(weight, torch.Tensor):  # decided on the device: merged, then kept where the weight is > 0
            if group is not None:
                fresh = merged_inner(knots, knots, group.counts, group.gmin, group.gmax, weight.double())
                knots[:, 1 : k - 1] = torch.where(weight > 0, fresh, knots[:, 1 : k - 1])
        elif group is not None and weight > 0:
            knots[:, 1 : k - 1] = merged_inner(knots, knots, group.counts, group.gmin, group.gmax, float(weight))
        knots[:, 0] = torch.minimum(p0.to(knots), knots[:, 1])
        knots[:, -1] = torch.maximum(p100.to(knots), knots[:, -2])

    def tables(self, knots: torch.Tensor, source: torch.Tensor, table: StreamTable) -> None:
        c, k = knots.shape
        g = table.grid
        kd, sd = knots.double(), source.double()
        lo = kd[:, 1:2]
        span = kd[:, k - 2 : k - 1] - lo
        width = torch.where(span > 0, span / g, torch.zeros_like(span))
        inv = torch.where(width > 0, 1.0 / torch.where(width > 0, width, torch.ones_like(width)), torch.zeros_like(width))
        table.glo.copy_(knots[:, 1])
        table.ginv.copy_(saturate(inv[:, 0]))
        low = line(kd[:, 0], sd[:, 0], kd[:, 1], sd[:, 1], sd[:, 1])
        high = line(kd[:, k - 2], sd[:, k - 2], kd[:, k - 1], sd[:, k - 1], sd[:, k - 2])
        steps = torch.arange(1, g + 1, dtype=torch.float64, device=kd.device)
        gx = lo + width * steps
        gx[:, -1:] = kd[:, k - 2 : k - 1]
        q = (torch.searchsorted(kd.contiguous(), gx.contiguous(), right=True) - 1).clamp(1, k - 2)
        top = q >= k - 2
        q0 = q.clamp(max=k - 3) if k > 3 else q
        kq, kq1 = kd.gather(1, q0), kd.gather(1, (q0 + 1).clamp(max=k - 1))
        sq, sq1 = sd.gather(1, q0), sd.gather(1, (q0 + 1).clamp(max=k - 1))
        run = kq1 - kq
        rise = torch.where(run > 0, (sq1 - sq) / torch.where(run > 0, run, torch.ones_like(run)), torch.zeros_like(run))
        yv = torch.where(top, sd[:, k - 2 : k - 1].expand_as(gx), sq + (gx - kq) * rise)
        gprev = torch.cat([lo, gx[:, :-1]], dim=1)
        yprev = torch.cat([sd[:, 1:2], yv[:, :-1]], dim=1)
        rising = width > 0
        slope = torch.where(rising, saturate((yv - yprev) * inv), torch.zeros_like(yv, dtype=torch.float32))
        icpt = saturate(torch.where(rising, yprev - slope.double() * gprev, yv))
        table.pairs[:, 0] = torch.stack(low, dim=1)
        table.pairs[:, 1 : g + 1] = torch.stack([slope, icpt], dim=2)
        table.pairs[:, g + 1] = torch.stack(high, dim=1)

    def group_merge(self, knots: torch.Tensor, bins: torch.Tensor, counts: torch.Tensor, gmin: torch.Tensor,
                    gmax: torch.Tensor, weights: torch.Tensor) -> None:
        k = knots.shape[1]
        w = on_device(weights, knots.device).double()[:, None]
        old = knots.double()
        new = knots.clone()
        new[:, 1 : k - 1] = merged_inner(knots, bins, counts, gmin, gmax, w)
        lo = saturate(torch.lerp(old[:, 0], gmin.double(), w[:, 0]))
        hi = saturate(torch.lerp(old[:, -1], gmax.double(), w[:, 0]))
        new[:, 0] = torch.minimum(lo, new[:, 1])
        new[:, -1] = torch.maximum(hi, new[:, -2])
        knots.copy_(torch.where(w == 0, knots, new))  # a row of weight 0 stays as it is

    def mixture(self, groups: torch.Tensor, knots: torch.Tensor, grid: int,
                weights: torch.Tensor | None = None) -> None:
        m, _, k = groups.shape
        check_mixture_weights(weights, m)
        if weights is not None and not bool(torch.isfinite(weights).all() and (weights >= 0).all()
                                            and weights.sum() > 0):
            raise ValueError("mixture: the weights must be finite, >= 0 and not all 0")
        knots[:, 1 : k - 1] = mixture_quantiles(groups.double(), k, grid, weights)

    def shift_test(self, counts: torch.Tensor, knots: torch.Tensor,
                   small: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
        """As :meth:`StreamKernels.shift_test`; off the CPU the distances stay 0-d float64 tensors on the device
        (:func:`shift_distance_tensors`), read by no one here."""
        distances = shift_distance_tensors(counts, knots)
        if host_reads_are_cheap(counts.device):
            distances = (float(distances[0]), float(distances[1]))  # type: ignore[assignment]
        return distances, counts.sum(0, dtype=torch.int32), counts.to(torch.int16) if small else counts

    def shift_distances(self, counts: torch.Tensor, knots: torch.Tensor) -> tuple[float, float]:
        return shift_distances(counts, knots)
