"""The fast AQR path on a GPU, in Triton: no host synchronisation, every value read a bounded number of times.

A layer output is viewed as ``x`` (A, C, B), channel in the middle, with any strides (NCHW,
channels_last, tokens): nothing is copied. Per layer, for a channel of ``n = A * B`` values:

1. ``extremes`` (grid: channel blocks x ``split`` parts): min, max, a NaN flag and the sums of
   ``v - v0`` and its square (``v0`` the channel's first value) of every value, one partial per part
   (exact or summed in a fixed order, so deterministic). Program (0, 0) sets the layer's ``finite``
   flag. For a large channel (``n > TritonConfig.sort_max``) the same pass also counts every value
   into a *coarse* histogram: 64 buckets of ``sign(z) log2(1 + |z|)``, ``z`` the distance to the
   median of 64 sampled values in units of their robust scale, so the buckets are linear near the
   centre and logarithmic far from it (outliers cannot stretch them). Counts are added atomically
   (integers: any order gives one sum).
2. large channels: ``fine`` (same grid as 1): the coarse counts locate exactly the buckets of the
   lowest and highest inner knot's ranks; the values in that window are counted into ``bins`` fine
   buckets (and those below it); then ``knots`` (one program per channel): each type-7 inner knot
   is read off the fine histogram (its bucket found exactly by the cumulative counts, the value
   placed linearly among the bucket's), so it lies within one fine bucket of the exact quantile of
   every value; p0/p100 exact; the mean and std of every value.
   Small channels: ``targets`` (one program per channel): the channel's ``S`` values at the
   sampled positions of :class:`aqr.backends.subsets.SubsetCache`, sorted in registers, their
   type-7 knots and moments, exactly as the torch path computes them.
   A channel with a NaN or an infinite value gets NaN knots and clears ``finite``.
3. ``table`` (one program per channel): the ``cells + 2``-cell slope/intercept table of
   ``aqr.backends.torch_backend.table_map``: cell 0 the lower tail line, cells 1..cells the exact map at the
   ``cells + 1`` grid points between p1 and p_{K-2} (the tie rule included), cell cells+1 the upper
   tail line (all six tails, as ``aqr.core.qmap.tail_lines``). NaN knots give a NaN table.
4. ``map`` (tiles of one channel, or of positions x channels when the channel is fastest):
   ``y = slope[cell] * v + icpt[cell]`` (one 64-bit load of the pair) with ``v = x`` or
   ``v = scale * x + shift`` (``pre``: an eval-mode BatchNorm folded in), computed in float32,
   written in ``x``'s dtype. NaN goes to cell 0, so it stays NaN.

With ``pre`` the map reads the BatchNorm's input, so (4) replaces the BatchNorm's own pass. Memory
traffic per value: reads in (1), (2) for large channels and (4), one write in (4).

Offsets: per-position and per-row bases are int64 (a layer output may exceed 2**31 values); the
offsets inside a tile are int32. Under ``torch.compile`` the two host functions are
``torch.library.triton_op`` custom ops (torch >= 2.6), so the compiled graph calls the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


try:
    import triton
    import triton.language as tl
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(f"aqr's Triton backend needs triton ({err})") from err

if not hasattr(tl, "gather"):  # pragma: no cover - depends on the environment
    raise ImportError(f"aqr's Triton backend needs tl.gather (triton >= 3.3); found triton {triton.__version__}")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HIST_BUCKETS_MAX = 4096  # buckets of one tl.histogram call (channels x bins) in channel-fastest layouts
COARSE_BUCKETS = 64  # the coarse histogram's buckets: sign(z) log2(1 + |z|) in [-COARSE_RANGE, COARSE_RANGE]
COARSE_RANGE = 24.0  # |z| up to 2**24 robust scales from the centre before the edge buckets
CENTRE_SAMPLES = 64  # sampled values whose median and quartiles centre the coarse histogram


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes, warps and the histogram's resolution of the kernels.

    Attributes:
        map_tile / map_warps: values per program of the map kernel, and its warps.
        stats_tile / stats_warps: values per loop step of the extremes and histogram kernels, and their warps.
        stats_programs: about how many programs the extremes kernel runs (parts per channel follow).
        sort_warps: warps of the knots kernels (the histogram's, or the sort of S values in registers).
        table_warps: warps of the table kernel.
        sort_max: channels of at most this many values (per batch) take their knots from the sorted
            sample, as the torch path does; larger ones from a histogram of every value.
        bins: buckets of the fine histogram (a power of two). A coarse histogram of every value
            (64 buckets, logarithmic beyond a robust scale of the channel, so outliers cannot
            widen it) finds the window that holds the inner knots; the fine one cuts that window
            into ``bins`` buckets, and each inner knot lies within one of them of the exact
            quantile of every value.
    """

    map_tile: int = 2048
    map_warps: int = 4
    stats_tile: int = 4096
    stats_warps: int = 4
    stats_programs: int = 1024
    sort_warps: int = 8
    table_warps: int = 4
    sort_max: int = 1024
    bins: int = 128

    def __post_init__(self) -> None:
        for name in ("map_tile", "stats_tile", "map_warps", "stats_warps", "sort_warps", "table_warps", "bins"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.stats_programs < 1:
            raise ValueError(f"stats_programs must be >= 1, got {self.stats_programs}")
        if not 2 <= self.bins <= HIST_BUCKETS_MAX:
            raise ValueError(f"bins must be between 2 and {HIST_BUCKETS_MAX}, got {self.bins}")
        if self.sort_max < 0:
            raise ValueError(f"sort_max must be >= 0, got {self.sort_max}")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------
# (1) extremes: partial min / max / NaN flag / shifted sums per (channel, part), and with HIST the
# coarse histogram of every value around a robust centre
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _ref_value(x_ptr, off):
    """The value at ``off`` (a channel's first value) as float32, 0 if not finite: the shift of the
    sums, so that their variance does not cancel when the mean is far from 0."""
    r = tl.load(x_ptr + off).to(tl.float32)
    return tl.where((r == r) & (tl.abs(r) < float("inf")), r, 0.0)


@triton.jit
def _row_tile(x_ptr, cbase, t, n_tb, A, B, sxa, sxb, ia, ib):
    """Tile ``t`` of a channel's (A, B) plane in channel-major layouts (``n_tb`` tiles across B, rows
    ``ia``, positions ``ib``): its values as float32 (0 where masked) and the mask."""
    ta = t // n_tb
    tb = t - ta * n_tb
    a = ta * ia.shape[0] + ia
    b = tb * ib.shape[0] + ib
    m = (a < A)[:, None] & (b < B)[None, :]
    off = cbase + (a.to(tl.int64) * sxa)[:, None] + (b.to(tl.int64) * sxb)[None, :]
    return tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32), m


@triton.jit
def _col_tile(x_ptr, coff, cm, t, P, B, sxa, sxb, ip):
    """Tile ``t`` of positions (``ip``) x channels (element offsets ``coff``, mask ``cm``) in
    channel-fastest layouts: its values as float32 (0 where masked) and the mask."""
    p = t * ip.shape[0] + ip
    a = p // B
    b = p - a * B
    m = (p < P)[:, None] & cm[None, :]
    off = (a.to(tl.int64) * sxa + b.to(tl.int64) * sxb)[:, None] + coff[None, :]
    return tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32), m


@triton.jit
def _pick(srt, i, S_PAD: tl.constexpr):
    """Row-wise element ``i`` (one index per row) of the 2-D register array ``srt``."""
    j = tl.arange(0, S_PAD)
    return tl.sum(tl.where(j[None, :] == i[:, None], srt, 0.0), axis=1)


@triton.jit
def _centre(x_ptr, spos_ptr, coff, cm, pa, pb, S, HAS_PRE: tl.constexpr, S_PAD: tl.constexpr):
    """Median and scale ((p75 - p25) / 1.349, never 0) of channels ``coff`` (element offsets,
    ``cm`` their mask) from the sorted values at the ``S`` sampled offsets: where the coarse
    histogram is centred. Non-finite values read as 0 (such a channel's knots are NaN anyway)."""
    j = tl.arange(0, S_PAD)
    jm = j < S
    off = tl.load(spos_ptr + j, mask=jm, other=0)
    m = cm[:, None] & jm[None, :]
    v = tl.load(x_ptr + coff[:, None] + off[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_PRE:
        v = v * pa[:, None] + pb[:, None]
    v = tl.where((v == v) & (tl.abs(v) < float("inf")), v, 0.0)
    srt = tl.sort(tl.where(jm[None, :], v, float("inf")), dim=1)
    half = (S - 1) // 2
    med = (_pick(srt, tl.zeros_like(coff).to(tl.int32) + half, S_PAD)
           + _pick(srt, tl.zeros_like(coff).to(tl.int32) + (S - 1 - half), S_PAD)) * 0.5
    q1 = _pick(srt, tl.zeros_like(coff).to(tl.int32) + (S - 1) // 4, S_PAD)
    q3 = _pick(srt, tl.zeros_like(coff).to(tl.int32) + (3 * (S - 1)) // 4, S_PAD)
    lo = _pick(srt, tl.zeros_like(coff).to(tl.int32), S_PAD)
    hi = _pick(srt, tl.zeros_like(coff).to(tl.int32) + (S - 1), S_PAD)
    scale = tl.maximum((q3 - q1) / 1.349, (hi - lo) / 256.0)
    scale = tl.maximum(scale, tl.abs(med) * 1e-6 + 1e-30)
    scale = tl.where(scale < float("inf"), scale, 3e38)
    return med, scale


@triton.jit
def _coarse_bucket(v, med, inv_scale, ok, NC: tl.constexpr, T: tl.constexpr):
    """Coarse bucket in [0, NC) of float32 ``v``: ``t = sign(z) log2(1 + |z|)``, ``z = (v - med) / scale``,
    cut into NC equal parts of [-T, T] (linear near the centre, logarithmic far from it, so one
    histogram of a few buckets spans any range). NaN and masked values go to 0."""
    z = (v - med) * inv_scale
    t = tl.log2(1.0 + tl.abs(z))
    t = tl.where(z < 0, -t, t)
    t = (t + T) * (NC / (2.0 * T))
    t = tl.where(ok & (t == t), t, 0.0)
    t = tl.minimum(tl.maximum(t, 0.0), NC - 1.0)
    return t.to(tl.int32)


@triton.jit(do_not_specialize=["A", "split", "n_tb", "per", "S"])
def _extremes_rows_kernel(x_ptr, part_ptr, finite_ptr, pre_scale_ptr, pre_shift_ptr, spos_ptr, centre_ptr,
                          hist_ptr, A, C, B, sxa, sxc, sxb, split, n_tb, per, S,
                          HAS_PRE: tl.constexpr, HIST: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr,
                          T: tl.constexpr, S_PAD: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr):
    """Channel-major layouts: program (c, s) reduces tiles s*per .. s*per + per - 1 of channel c's
    (A, B) plane, each TA rows x TB positions (tiles past the last one are masked out)."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    tl.store(finite_ptr, True, mask=(c == 0) & (s == 0))  # cleared by the knots kernels if need be
    ia = tl.arange(0, TA)
    ib = tl.arange(0, TB)
    mn = tl.full([TA, TB], float("inf"), tl.float32)
    mx = tl.full([TA, TB], -float("inf"), tl.float32)
    bad = tl.zeros([TA, TB], tl.int32)
    s1 = tl.zeros([TA, TB], tl.float32)
    s2 = tl.zeros([TA, TB], tl.float32)
    cbase = c.to(tl.int64) * sxc
    ref = _ref_value(x_ptr, cbase)
    if HIST:
        cv = c + tl.arange(0, 1)
        pa = tl.full([1], 1.0, tl.float32)
        pb = tl.full([1], 0.0, tl.float32)
        if HAS_PRE:
            pa = tl.load(pre_scale_ptr + cv)
            pb = tl.load(pre_shift_ptr + cv)
        med, scale = _centre(x_ptr, spos_ptr, cv.to(tl.int64) * sxc, cv < C, pa, pb, S, HAS_PRE, S_PAD)
        if s == 0:
            tl.store(centre_ptr + 2 * cv, med)
            tl.store(centre_ptr + 2 * cv + 1, scale)
        med = tl.sum(med, axis=0)
        inv_scale = 1.0 / tl.sum(scale, axis=0)
        pa = tl.sum(pa, axis=0)
        pb = tl.sum(pb, axis=0)
        acc = tl.zeros([NC], tl.int32)
        pad = tl.full([], 0, tl.int32)
    for i in range(0, per):  # an argument as the bound: older interpreters take no computed bounds
        v, m = _row_tile(x_ptr, cbase, s * per + i, n_tb, A, B, sxa, sxb, ia, ib)
        ok = m & (v == v)
        mn = tl.minimum(mn, tl.where(ok, v, float("inf")))
        mx = tl.maximum(mx, tl.where(ok, v, -float("inf")))
        bad = tl.maximum(bad, (m & (v != v)).to(tl.int32))
        d = tl.where(ok, v - ref, 0.0)
        s1 += d
        s2 += d * d
        if HIST:
            if HAS_PRE:
                v = v * pa + pb
            idx = _coarse_bucket(v, med, inv_scale, m, NC, T)
            acc += tl.histogram(tl.reshape(idx, [TA * TB]), NC)
            pad += TA * TB - tl.sum(m.to(tl.int32))
    at = c * split + s
    plane = C * split
    tl.store(part_ptr + at, tl.min(tl.min(mn, axis=1), axis=0))
    tl.store(part_ptr + plane + at, tl.max(tl.max(mx, axis=1), axis=0))
    tl.store(part_ptr + 2 * plane + at, tl.max(tl.max(bad, axis=1), axis=0).to(tl.float32))
    tl.store(part_ptr + 3 * plane + at, tl.sum(tl.sum(s1, axis=1), axis=0))
    tl.store(part_ptr + 4 * plane + at, tl.sum(tl.sum(s2, axis=1), axis=0))
    if HIST:
        j = tl.arange(0, NC)
        acc = tl.where(j == 0, acc - pad, acc)  # the masked positions went to bucket 0
        tl.atomic_add(hist_ptr + c.to(tl.int64) * (NC + NF + 1) + j, acc)  # integers: any order, one sum


@triton.jit(do_not_specialize=["P", "split", "per", "S"])
def _extremes_cols_kernel(x_ptr, part_ptr, finite_ptr, pre_scale_ptr, pre_shift_ptr, spos_ptr, centre_ptr,
                          hist_ptr, C, B, P, sxa, sxc, sxb, split, per, S,
                          HAS_PRE: tl.constexpr, HIST: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr,
                          T: tl.constexpr, S_PAD: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    """Channel-fastest layouts (channels_last, tokens): program (cb, s) reduces position tiles
    s*per .. s*per + per - 1 of BP positions for the BC channels of block cb (with HIST, one
    histogram of BC * NC buckets)."""
    cb = tl.program_id(0)
    s = tl.program_id(1)
    tl.store(finite_ptr, True, mask=(cb == 0) & (s == 0))
    c = cb * BC + tl.arange(0, BC)
    cm = c < C
    coff = c.to(tl.int64) * sxc
    ip = tl.arange(0, BP)
    mn = tl.full([BP, BC], float("inf"), tl.float32)
    mx = tl.full([BP, BC], -float("inf"), tl.float32)
    bad = tl.zeros([BP, BC], tl.int32)
    s1 = tl.zeros([BP, BC], tl.float32)
    s2 = tl.zeros([BP, BC], tl.float32)
    ref = _ref_value(x_ptr, tl.where(cm, coff, 0))
    if HIST:
        pa = tl.full([BC], 1.0, tl.float32)
        pb = tl.full([BC], 0.0, tl.float32)
        if HAS_PRE:
            pa = tl.load(pre_scale_ptr + c, mask=cm, other=1.0)
            pb = tl.load(pre_shift_ptr + c, mask=cm, other=0.0)
        med, scale = _centre(x_ptr, spos_ptr, tl.where(cm, coff, 0), cm, pa, pb, S, HAS_PRE, S_PAD)
        if s == 0:
            tl.store(centre_ptr + 2 * c, med, mask=cm)
            tl.store(centre_ptr + 2 * c + 1, scale, mask=cm)
        inv_scale = 1.0 / scale
        slot = (tl.arange(0, BC) * NC)[None, :]
        acc = tl.zeros([BC * NC], tl.int32)
        pad = tl.zeros([BC], tl.int32)
    for i in range(0, per):
        v, m = _col_tile(x_ptr, coff, cm, s * per + i, P, B, sxa, sxb, ip)
        ok = m & (v == v)
        mn = tl.minimum(mn, tl.where(ok, v, float("inf")))
        mx = tl.maximum(mx, tl.where(ok, v, -float("inf")))
        bad = tl.maximum(bad, (m & (v != v)).to(tl.int32))
        d = tl.where(ok, v - ref[None, :], 0.0)
        s1 += d
        s2 += d * d
        if HIST:
            if HAS_PRE:
                v = v * pa[None, :] + pb[None, :]
            idx = _coarse_bucket(v, med[None, :], inv_scale[None, :], m, NC, T) + slot
            acc += tl.histogram(tl.reshape(idx, [BP * BC]), BC * NC)
            pad += BP - tl.sum(m.to(tl.int32), axis=0)
    at = c * split + s
    plane = C * split
    tl.store(part_ptr + at, tl.min(mn, axis=0), mask=cm)
    tl.store(part_ptr + plane + at, tl.max(mx, axis=0), mask=cm)
    tl.store(part_ptr + 2 * plane + at, tl.max(bad, axis=0).to(tl.float32), mask=cm)
    tl.store(part_ptr + 3 * plane + at, tl.sum(s1, axis=0), mask=cm)
    tl.store(part_ptr + 4 * plane + at, tl.sum(s2, axis=0), mask=cm)
    if HIST:
        acc2 = tl.reshape(acc, [BC, NC])
        j = tl.arange(0, NC)
        acc2 = tl.where(j[None, :] == 0, acc2 - pad[:, None], acc2)
        tl.atomic_add(hist_ptr + c.to(tl.int64)[:, None] * (NC + NF + 1) + j[None, :], acc2, mask=cm[:, None])


# ---------------------------------------------------------------------------------------------------
# (2a) knots of large channels (more than TritonConfig.sort_max values): the window of the inner
# knots from the coarse histogram, a fine histogram of the window, the knots read off it
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _summary(x_ptr, part_ptr, pre_scale_ptr, pre_shift_ptr, c, cm, C, sxc, split, n,
             HAS_PRE: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Channels ``c`` (a vector, ``cm`` its mask): min, max, whether finite, mean and (population)
    std of every value ``v`` (``v = x``, or ``pre_scale * x + pre_shift``), from the partials of
    the extremes kernel."""
    plane = C * split
    mn = tl.full(c.shape, float("inf"), tl.float32)
    mx = tl.full(c.shape, -float("inf"), tl.float32)
    bad = tl.zeros(c.shape, tl.float32)
    s1 = tl.zeros(c.shape, tl.float64)
    s2 = tl.zeros(c.shape, tl.float64)
    for s0 in range(0, split, SPLIT_BLOCK):
        si = s0 + tl.arange(0, SPLIT_BLOCK)
        m = cm[:, None] & (si < split)[None, :]
        at = (c * split)[:, None] + si[None, :]
        mn = tl.minimum(mn, tl.min(tl.load(part_ptr + at, mask=m, other=float("inf")), axis=1))
        mx = tl.maximum(mx, tl.max(tl.load(part_ptr + plane + at, mask=m, other=-float("inf")), axis=1))
        bad = tl.maximum(bad, tl.max(tl.load(part_ptr + 2 * plane + at, mask=m, other=0.0), axis=1))
        s1 += tl.sum(tl.load(part_ptr + 3 * plane + at, mask=m, other=0.0).to(tl.float64), axis=1)
        s2 += tl.sum(tl.load(part_ptr + 4 * plane + at, mask=m, other=0.0).to(tl.float64), axis=1)
    ref = _ref_value(x_ptr, tl.where(cm, c, 0).to(tl.int64) * sxc)
    mean_d = s1 / n
    sd = tl.sqrt(tl.maximum(s2 / n - mean_d * mean_d, 0.0))
    # values beyond ~1e19 from the first one overflow the float32 squares: then half the range
    # stands in for the std (finite and of the right order; only the parametric tails read it)
    half = (mx.to(tl.float64) - mn.to(tl.float64)) * 0.5
    sd = tl.where(sd < float("inf"), sd, tl.minimum(half, 3.4e38)).to(tl.float32)
    mean = tl.where(mean_d == mean_d, ref.to(tl.float64) + mean_d, 0.0)
    mean = tl.where(tl.abs(mean) < float("inf"), mean, (mx.to(tl.float64) + mn.to(tl.float64)) * 0.5).to(tl.float32)
    lo_all = mn
    hi_all = mx
    if HAS_PRE:
        a = tl.load(pre_scale_ptr + c, mask=cm, other=1.0)
        b = tl.load(pre_shift_ptr + c, mask=cm, other=0.0)
        # monotone in x, so the extremes of a * x + b are those of x mapped (swapped when a < 0)
        e0 = mn * a + b
        e1 = mx * a + b
        swap = e0 > e1
        lo_all = tl.where(swap, e1, e0)
        hi_all = tl.where(swap, e0, e1)
        mean = mean * a + b
        sd = sd * tl.abs(a)
    finite = (bad == 0.0) & (tl.abs(lo_all) < float("inf")) & (tl.abs(hi_all) < float("inf"))
    return lo_all, hi_all, finite, mean, sd


@triton.jit
def _coarse_edge(j, med, scale, NC: tl.constexpr, T: tl.constexpr):
    """The lower edge of coarse bucket ``j`` (float64): the inverse of :func:`_coarse_bucket`."""
    t = -T + j.to(tl.float64) * (2.0 * T / NC)
    z = tl.exp2(tl.abs(t)) - 1.0
    z = tl.where(t < 0, -z, z)
    return med.to(tl.float64) + scale.to(tl.float64) * z


@triton.jit
def _window(centre_ptr, hist_ptr, rank_ptr, c, cm, lo_all, hi_all, K, N,
            NC: tl.constexpr, NF: tl.constexpr, T: tl.constexpr):
    """Per channel ``c`` (vector): the value window [lo, hi] (float32) that holds every inner knot
    (the coarse buckets of the lowest and highest inner rank, found exactly by the cumulative
    counts), its span (float64) and the fine buckets per unit for NF buckets (returned per unit
    bucket; the caller multiplies)."""
    j = tl.arange(0, NC)
    row = tl.where(cm, c, 0).to(tl.int64) * (NC + NF + 1)
    cum = tl.cumsum(tl.load(hist_ptr + row[:, None] + j[None, :], mask=cm[:, None], other=0), 1)
    r_lo = tl.load(rank_ptr + 1)
    r_hi = tl.minimum(tl.load(rank_ptr + K - 2) + 1, N - 1)
    b_lo = tl.sum((cum <= r_lo).to(tl.int32), axis=1)
    b_hi = tl.sum((cum <= r_hi).to(tl.int32), axis=1)
    med = tl.load(centre_ptr + 2 * c, mask=cm, other=0.0)
    scale = tl.load(centre_ptr + 2 * c + 1, mask=cm, other=1.0)
    e_lo = _coarse_edge(b_lo, med, scale, NC, T)
    e_hi = _coarse_edge(b_hi + 1, med, scale, NC, T)
    lo = tl.where(b_lo == 0, lo_all.to(tl.float64), tl.maximum(e_lo, lo_all.to(tl.float64)))
    hi = tl.where(b_hi >= NC - 1, hi_all.to(tl.float64), tl.minimum(e_hi, hi_all.to(tl.float64)))
    lo32 = lo.to(tl.float32)
    hi32 = tl.maximum(hi.to(tl.float32), lo32)
    lo32 = tl.where(lo32 == lo32, lo32, 0.0)
    hi32 = tl.where(hi32 == hi32, hi32, lo32)
    span = hi32.to(tl.float64) - lo32.to(tl.float64)
    ok = (span > 0) & (span < float("inf"))
    return lo32, hi32, tl.where(ok, span, 0.0), ok


@triton.jit(do_not_specialize=["A", "split", "n_tb", "per", "K", "N"])
def _fine_rows_kernel(x_ptr, part_ptr, centre_ptr, hist_ptr, pre_scale_ptr, pre_shift_ptr,
                      rank_ptr, A, C, B, sxa, sxc, sxb, split, n_tb, per, K, N, n,
                      HAS_PRE: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr, T: tl.constexpr,
                      TA: tl.constexpr, TB: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Channel-major layouts: program (c, s) counts the values of tiles s*per .. s*per + per - 1 of
    channel c's plane that fall in the window into NF buckets, and those below it."""
    c = tl.program_id(0)
    s = tl.program_id(1)
    cv = c + tl.arange(0, 1)
    cm = cv < C
    lo_all, hi_all, _, _, _ = _summary(x_ptr, part_ptr, pre_scale_ptr, pre_shift_ptr, cv, cm, C, sxc, split, n,
                                       HAS_PRE, SPLIT_BLOCK)
    lo, hi, span, ok = _window(centre_ptr, hist_ptr, rank_ptr, cv, cm, lo_all, hi_all, K, N, NC, NF, T)
    inv = tl.sum(tl.where(ok, NF / tl.where(ok, span, 1.0), 0.0), axis=0).to(tl.float32)
    lo = tl.sum(lo, axis=0)
    hi = tl.sum(hi, axis=0)
    if HAS_PRE:
        pa = tl.load(pre_scale_ptr + c)
        pb = tl.load(pre_shift_ptr + c)
    ia = tl.arange(0, TA)
    ib = tl.arange(0, TB)
    acc = tl.zeros([NF], tl.int32)
    pad = tl.full([], 0, tl.int32)
    below = tl.full([], 0, tl.int32)
    cbase = c.to(tl.int64) * sxc
    for i in range(0, per):
        v, m = _row_tile(x_ptr, cbase, s * per + i, n_tb, A, B, sxa, sxb, ia, ib)
        if HAS_PRE:
            v = v * pa + pb
        inside = m & (v >= lo) & (v <= hi)
        u = (v - lo) * inv
        u = tl.where(inside, u, 0.0)
        u = tl.minimum(tl.maximum(u, 0.0), NF - 1.0)
        acc += tl.histogram(tl.reshape(u.to(tl.int32), [TA * TB]), NF)
        pad += TA * TB - tl.sum(inside.to(tl.int32))
        below += tl.sum((m & (v < lo)).to(tl.int32))
    j = tl.arange(0, NF)
    acc = tl.where(j == 0, acc - pad, acc)  # values outside the window went to bucket 0
    row = hist_ptr + c.to(tl.int64) * (NC + NF + 1) + NC
    tl.atomic_add(row + j, acc)
    tl.atomic_add(row + NF, below)


@triton.jit(do_not_specialize=["P", "split", "per", "K", "N"])
def _fine_cols_kernel(x_ptr, part_ptr, centre_ptr, hist_ptr, pre_scale_ptr, pre_shift_ptr,
                      rank_ptr, C, B, P, sxa, sxc, sxb, split, per, K, N, n,
                      HAS_PRE: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr, T: tl.constexpr,
                      BP: tl.constexpr, BC: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Channel-fastest layouts: as :func:`_fine_rows_kernel` for the BC channels of block cb, in one
    histogram of BC * NF buckets."""
    cb = tl.program_id(0)
    s = tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    cm = c < C
    lo_all, hi_all, _, _, _ = _summary(x_ptr, part_ptr, pre_scale_ptr, pre_shift_ptr, c, cm, C, sxc, split, n,
                                       HAS_PRE, SPLIT_BLOCK)
    lo, hi, span, ok = _window(centre_ptr, hist_ptr, rank_ptr, c, cm, lo_all, hi_all, K, N, NC, NF, T)
    inv = tl.where(ok, NF / tl.where(ok, span, 1.0), 0.0).to(tl.float32)
    if HAS_PRE:
        pa = tl.load(pre_scale_ptr + c, mask=cm, other=1.0)
        pb = tl.load(pre_shift_ptr + c, mask=cm, other=0.0)
    coff = c.to(tl.int64) * sxc
    ip = tl.arange(0, BP)
    slot = (tl.arange(0, BC) * NF)[None, :]
    acc = tl.zeros([BC * NF], tl.int32)
    pad = tl.zeros([BC], tl.int32)
    below = tl.zeros([BC], tl.int32)
    for i in range(0, per):
        v, m = _col_tile(x_ptr, coff, cm, s * per + i, P, B, sxa, sxb, ip)
        if HAS_PRE:
            v = v * pa[None, :] + pb[None, :]
        inside = m & (v >= lo[None, :]) & (v <= hi[None, :])
        u = (v - lo[None, :]) * inv[None, :]
        u = tl.where(inside, u, 0.0)
        u = tl.minimum(tl.maximum(u, 0.0), NF - 1.0)
        acc += tl.histogram(tl.reshape(u.to(tl.int32) + slot, [BP * BC]), BC * NF)
        pad += BP - tl.sum(inside.to(tl.int32), axis=0)
        below += tl.sum((m & (v < lo[None, :])).to(tl.int32), axis=0)
    acc2 = tl.reshape(acc, [BC, NF])
    j = tl.arange(0, NF)
    acc2 = tl.where(j[None, :] == 0, acc2 - pad[:, None], acc2)
    row = hist_ptr + c.to(tl.int64) * (NC + NF + 1) + NC
    tl.atomic_add(row[:, None] + j[None, :], acc2, mask=cm[:, None])
    tl.atomic_add(row + NF, below, mask=cm)


@triton.jit
def _fine_value(cum, h, r, lo, span, NF: tl.constexpr):
    """The value of window rank ``r`` (int32 vector) read off the fine histogram: its bucket found
    exactly by the cumulative counts, then placed linearly among the bucket's values (ranks
    outside the window, possible only through rounding at its edges, take the edge)."""
    b = tl.sum((cum[None, :] <= r[:, None]).to(tl.int32), axis=1)
    b = tl.minimum(b, NF - 1)
    cnt = tl.gather(h, b, 0)
    start = tl.gather(cum, b, 0) - cnt
    u = ((r - start).to(tl.float64) + 0.5) / tl.maximum(cnt, 1).to(tl.float64)
    u = tl.minimum(tl.maximum(u, 0.0), 1.0)
    return (lo.to(tl.float64) + span * ((b.to(tl.float64) + u) / NF)).to(tl.float32)


@triton.jit(do_not_specialize=["C", "K", "split", "N"])
def _knots_kernel(x_ptr, part_ptr, centre_ptr, hist_ptr, pre_scale_ptr, pre_shift_ptr,
                  rank_ptr, frac_ptr, tq_ptr, mom_ptr, finite_ptr, C, sxc, K, split, N, n,
                  HAS_PRE: tl.constexpr, NC: tl.constexpr, NF: tl.constexpr, T: tl.constexpr,
                  K_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """One program per channel: the type-7 knots of every value (each inner knot within one fine
    bucket of the exact one), p0/p100 exact, mean and std of every value."""
    c = tl.program_id(0)
    cv = c + tl.arange(0, 1)
    cm = cv < C
    lo_all, hi_all, finite, mean, sd = _summary(x_ptr, part_ptr, pre_scale_ptr, pre_shift_ptr, cv, cm, C, sxc,
                                                split, n, HAS_PRE, SPLIT_BLOCK)
    lo, hi, span, _ = _window(centre_ptr, hist_ptr, rank_ptr, cv, cm, lo_all, hi_all, K, N, NC, NF, T)
    lo = tl.sum(lo, axis=0)
    hi = tl.sum(hi, axis=0)
    span = tl.sum(span, axis=0)
    lo_all = tl.sum(lo_all, axis=0)
    hi_all = tl.sum(hi_all, axis=0)
    mean = tl.sum(mean, axis=0)
    sd = tl.sum(sd, axis=0)
    finite = tl.sum(finite.to(tl.int32), axis=0) > 0
    j = tl.arange(0, NF)
    row = hist_ptr + c.to(tl.int64) * (NC + NF + 1) + NC
    h = tl.load(row + j)
    nb = tl.load(row + NF)
    cum = tl.cumsum(h, 0)
    k = tl.arange(0, K_PAD)
    km = k < K
    r0 = tl.load(rank_ptr + k, mask=km, other=0)
    f = tl.load(frac_ptr + k, mask=km, other=0.0)
    r1 = tl.minimum(r0 + 1, N - 1)
    qa = _fine_value(cum, h, r0 - nb, lo, span, NF)
    qb = _fine_value(cum, h, r1 - nb, lo, span, NF)
    q = qa + (qb - qa) * f
    q = tl.minimum(tl.maximum(q, lo), hi)
    q = tl.where(k == 0, lo_all, tl.where(k == K - 1, hi_all, q))
    nan = float("nan")
    q = tl.where(finite, q, nan)
    tl.store(tq_ptr + c * K + k, q, mask=km)
    tl.store(mom_ptr + 2 * c, tl.where(finite, mean, nan))
    tl.store(mom_ptr + 2 * c + 1, tl.where(finite, sd, nan))
    tl.store(finite_ptr, False, mask=finite == 0)


# ---------------------------------------------------------------------------------------------------
# (2b) targets of small layers: sampled values sorted in registers, type-7 knots, p0/p100 of every
# value, moments
# ---------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["C", "S", "K", "split"])
def _targets_kernel(x_ptr, pos_ptr, part_ptr, pre_scale_ptr, pre_shift_ptr, rank_ptr, frac_ptr,
                    tq_ptr, mom_ptr, finite_ptr, C, sxc, S, K, split,
                    HAS_PRE: tl.constexpr, S_PAD: tl.constexpr, K_PAD: tl.constexpr,
                    SPLIT_BLOCK: tl.constexpr):
    c = tl.program_id(0)
    # p0 and p100: the extremes of every value (the partials of _extremes_*_kernel)
    mn = tl.full([], float("inf"), tl.float32)
    mx = tl.full([], -float("inf"), tl.float32)
    bad = tl.full([], 0.0, tl.float32)
    plane = C * split
    for s0 in range(0, split, SPLIT_BLOCK):
        si = s0 + tl.arange(0, SPLIT_BLOCK)
        sm = si < split
        at = c * split + si
        mn = tl.minimum(mn, tl.min(tl.load(part_ptr + at, mask=sm, other=float("inf")), axis=0))
        mx = tl.maximum(mx, tl.max(tl.load(part_ptr + plane + at, mask=sm, other=-float("inf")), axis=0))
        bad = tl.maximum(bad, tl.max(tl.load(part_ptr + 2 * plane + at, mask=sm, other=0.0), axis=0))
    # the sample, gathered at the cached offsets of channel 0 plus c * sxc
    i = tl.arange(0, S_PAD)
    im = i < S
    off = tl.load(pos_ptr + i, mask=im, other=0)
    v = tl.load(x_ptr + c.to(tl.int64) * sxc + off, mask=im, other=0.0).to(tl.float32)
    lo_all = mn
    hi_all = mx
    if HAS_PRE:
        a = tl.load(pre_scale_ptr + c)
        b = tl.load(pre_shift_ptr + c)
        v = v * a + b
        # monotone in x, so the extremes of a * x + b are those of x mapped (swapped when a < 0)
        e0 = mn * a + b
        e1 = mx * a + b
        swap = e0 > e1
        lo_all = tl.where(swap, e1, e0)
        hi_all = tl.where(swap, e0, e1)
    finite = (bad == 0.0) & (tl.abs(lo_all) < float("inf")) & (tl.abs(hi_all) < float("inf"))
    # Sorted as int32 keys in float order (the sign bit kept, the other bits flipped for negative
    # values): triton <= 3.3 sorts floats through sums of x * 0, which turn +inf into NaN and lose
    # -0.0's sign, and no version orders NaN. Padding (and NaN, whose channel is not finite
    # anyway) gets the key of +inf and sorts last.
    bits = v.to(tl.int32, bitcast=True)
    key = tl.where(im & (v == v), bits ^ ((bits >> 31) & 0x7FFFFFFF), 0x7F800000)
    key = tl.sort(key)
    srt = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    vm = tl.where(im, v, 0.0)
    mean = tl.sum(vm, axis=0) / S
    d = tl.where(im, v - mean, 0.0)
    std = tl.sqrt_rn(tl.sum(d * d, axis=0) / S)
    k = tl.arange(0, K_PAD)
    km = k < K
    r0 = tl.load(rank_ptr + k, mask=km, other=0)
    f = tl.load(frac_ptr + k, mask=km, other=0.0)
    r1 = tl.minimum(r0 + 1, S - 1)
    qa = tl.gather(srt, r0, 0)
    qb = tl.gather(srt, r1, 0)
    q = qa + (qb - qa) * f
    q = tl.where(k == 0, lo_all, tl.where(k == K - 1, hi_all, q))
    nan = float("nan")
    q = tl.where(finite, q, nan)
    tl.store(tq_ptr + c * K + k, q, mask=km)
    tl.store(mom_ptr + 2 * c, tl.where(finite, mean, nan))
    tl.store(mom_ptr + 2 * c + 1, tl.where(finite, std, nan))
    tl.store(finite_ptr, False, mask=finite == 0)


# ---------------------------------------------------------------------------------------------------
# (3) table: tail lines and the exact map on the grid (aqr.backends.torch_backend.table_map, aqr.core.qmap)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _count(arr, x, N_PAD: tl.constexpr, LOG: tl.constexpr, STRICT: tl.constexpr):
    """How many entries of the ascending register array ``arr`` (N_PAD entries, at least one of
    them +inf padding) are <= x (< x when STRICT), for each x: a branch-free binary search."""
    pos = tl.zeros(x.shape, tl.int32)
    for step in tl.static_range(LOG):
        cand = pos + (N_PAD >> (step + 1))
        v = tl.gather(arr, cand - 1, 0)
        if STRICT:
            ok = v < x
        else:
            ok = v <= x
        pos = tl.where(ok, cand, pos)
    return pos


@triton.jit
def _exact_at(g, tq, sq, run_start, K, K_PAD: tl.constexpr, LOG_K: tl.constexpr):
    """The exact map at points g: aqr.core.qmap.interp_levels (branch_free) then eval_levels."""
    p = _count(tq, g, K_PAD, LOG_K, False)  # knots <= g
    j = tl.minimum(tl.maximum(p - 1, 0), K - 2)
    lo_knot = tl.gather(tq, j, 0)
    width = tl.gather(tq, j + 1, 0) - lo_knot
    pos = width > 0
    t = tl.where(pos, tl.math.div_rn(g - lo_knot, tl.where(pos, width, 1.0)), (g > lo_knot).to(tl.float32))
    u = j.to(tl.float32) + t
    last = tl.maximum(p - 1, 0)
    tie = (p > 0) & (g == tl.gather(tq, last, 0))
    u = tl.where(tie, (tl.gather(run_start, last, 0) + last).to(tl.float32) / 2, u)
    i = tl.minimum(tl.maximum(tl.floor(u).to(tl.int32), 0), K - 2)
    frac = u - i.to(tl.float32)
    a = tl.gather(sq, i, 0)
    return a + (tl.gather(sq, i + 1, 0) - a) * frac


@triton.jit
def _slope(rise, run):
    return tl.where(run > 0, tl.math.div_rn(rise, tl.where(run > 0, run, 1.0)), 0.0)


@triton.jit(do_not_specialize=["mstride", "tail", "K"])
def _table_kernel(tq_ptr, sq_ptr, mean_ptr, std_ptr, mstride, loc_ptr, scale_ptr, tab_ptr, lo_ptr,
                  inv_ptr, tail, z0, z98, K,
                  CELLS: tl.constexpr, CP: tl.constexpr, K_PAD: tl.constexpr, LOG_K: tl.constexpr):
    c = tl.program_id(0)
    k = tl.arange(0, K_PAD)
    km = k < K
    row = c * K
    tq = tl.load(tq_ptr + row + k, mask=km, other=float("inf"))
    sq = tl.load(sq_ptr + row + k, mask=km, other=0.0)
    finite = tl.sum((km & (tl.abs(tq) >= float("inf"))).to(tl.int32) + (km & (tq != tq)).to(tl.int32), axis=0) == 0
    run_start = _count(tq, tq, K_PAD, LOG_K, True)  # first index of each knot's run of ties
    t0 = tl.load(tq_ptr + row)
    t1 = tl.load(tq_ptr + row + 1)
    t98 = tl.load(tq_ptr + row + K - 2)
    t99 = tl.load(tq_ptr + row + K - 1)
    s0 = tl.load(sq_ptr + row)
    s1 = tl.load(sq_ptr + row + 1)
    s98 = tl.load(sq_ptr + row + K - 2)
    s99 = tl.load(sq_ptr + row + K - 1)
    # the grid: CELLS + 1 points between p1 and p_{K-2}
    lo = t1
    # knots spanning more than the float32 maximum: the grid in float64 there (as the torch path)
    wide = (t98 - t1) == float("inf")
    step = (t98.to(tl.float64) - t1.to(tl.float64)) / CELLS
    width = tl.where(wide, step.to(tl.float32), tl.math.div_rn(t98 - t1, CELLS * 1.0))
    inv = tl.where(width > 0, tl.math.div_rn(1.0, tl.where(width > 0, width, 1.0)), 0.0)
    inv = tl.where(inv < float("inf"), inv, 0.0)  # a subnormal width: every value to cell 1
    j = tl.arange(0, CP)
    g = tl.where(wide, (t1.to(tl.float64) + step * j.to(tl.float64)).to(tl.float32), lo + width * j.to(tl.float32))
    v0 = _exact_at(g, tq, sq, run_start, K, K_PAD, LOG_K)
    top = tl.full([2], CELLS, tl.int32)  # the point CELLS, beyond the CP registers when CELLS == CP
    g_top = tl.where(wide, (t1.to(tl.float64) + step * top.to(tl.float64)).to(tl.float32),
                     lo + width * top.to(tl.float32))
    v_top = tl.max(_exact_at(g_top, tq, sq, run_start, K, K_PAD, LOG_K), axis=0)
    j1 = j + 1
    v1 = tl.where(j1 < CP, tl.gather(v0, tl.minimum(j1, CP - 1), 0), v_top)
    slope = (v1 - v0) * inv
    icpt = v0 - slope * g
    base = tab_ptr + c.to(tl.int64) * (2 * (CELLS + 2))
    jm = j < CELLS
    tl.store(base + 2 * j1, slope, mask=jm)
    tl.store(base + 2 * j1 + 1, icpt, mask=jm)
    # tail lines (aqr.core.qmap.tail_lines), all six strategies, chosen by the runtime code `tail`
    a_lo = _slope(s1 - s0, t1 - t0)
    b_lo = s0 - a_lo * t0
    a_hi = _slope(s99 - s98, t99 - t98)
    b_hi = s98 - a_hi * t98
    mean = tl.load(mean_ptr + c * mstride)
    sd = tl.load(std_ptr + c * mstride)
    sd = tl.where(sd > 0, sd, 1.0)  # constant channel: no spread to rescale
    scale = tl.load(scale_ptr + c)
    loc = tl.load(loc_ptr + c)
    a_p = tl.math.div_rn(scale, sd)
    # none (1), clip (2), interval (3), gaussian (4); 0 keeps Eq. 1
    a_lo = tl.where(tail == 1, 1.0, tl.where(tail == 2, 0.0, tl.where(tail >= 3, a_p, a_lo)))
    a_hi = tl.where(tail == 1, 1.0, tl.where(tail == 2, 0.0, tl.where(tail >= 3, a_p, a_hi)))
    b_lo = tl.where(tail == 1, 0.0, tl.where(tail == 2, t1, tl.where(
        tail == 3, s0 - a_p * t0, tl.where(tail == 4, (loc + scale * z0) - a_p * (mean + sd * z0), b_lo))))
    b_hi = tl.where(tail == 1, 0.0, tl.where(tail == 2, t98, tl.where(
        tail == 3, s98 - a_p * t98, tl.where(tail == 4, s98 - a_p * (mean + sd * z98), b_hi))))
    nan = float("nan")
    # a channel with non-finite knots maps every value to NaN: lo = NaN sends all to cell 0
    tl.store(base, tl.where(finite, a_lo, nan))
    tl.store(base + 1, tl.where(finite, b_lo, nan))
    tl.store(base + 2 * (CELLS + 1), tl.where(finite, a_hi, nan))
    tl.store(base + 2 * (CELLS + 1) + 1, tl.where(finite, b_hi, nan))
    tl.store(lo_ptr + c, tl.where(finite, lo, nan))
    tl.store(inv_ptr + c, inv)


# ---------------------------------------------------------------------------------------------------
# (4) map: y = slope[cell] * v + icpt[cell], v = x or pre_scale * x + pre_shift
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _store_as(ptr, y, mask):
    """Store float32 ``y`` in ``ptr``'s dtype, rounding to nearest even. bfloat16 is rounded by
    hand: Triton's interpreter truncates in ``.to(tl.bfloat16)`` while GPUs round, and the tests
    run in the interpreter."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = tl.where(y == y, y.to(tl.uint32, bitcast=True), 0x7FC00000)  # NaN: a quiet NaN
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(ptr, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lookup(v, lo, inv, tab_row, mask, CELLS: tl.constexpr):
    """The table map of float32 ``v``; ``tab_row`` points at each value's channel table, read as
    int64 (slope, intercept) pairs: one load per value (read only where ``mask``: a tile's padding
    may lie beyond the last channel)."""
    t = (v - lo) * inv + 1.0
    t = tl.where(t == t, t, 0.0)  # NaN -> cell 0, where it stays NaN
    t = tl.minimum(tl.maximum(t, 0.0), CELLS + 1.0)
    cell = t.to(tl.int32)
    pair = tl.load(tab_row + cell, mask=mask, other=0)
    slope = (pair & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    icpt = (pair >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
    return slope * v + icpt


@triton.jit(do_not_specialize=["A", "tiles", "n_tb"])
def _map_rows_kernel(x_ptr, y_ptr, tab_ptr, lo_ptr, inv_ptr, pre_scale_ptr, pre_shift_ptr,
                     A, C, B, sxa, sxc, sxb, sya, syc, syb, tiles, n_tb,
                     CELLS: tl.constexpr, HAS_PRE: tl.constexpr, TA: tl.constexpr, TB: tl.constexpr):
    """Channel-major layouts: program c * tiles + t maps tile t (TA rows x TB positions) of channel
    c's (A, B) plane, so a program reads one channel's table (it stays in the L1 cache)."""
    pid = tl.program_id(0)
    c = pid // tiles
    t = pid - c * tiles
    ta = t // n_tb
    tb = t - ta * n_tb
    a = ta * TA + tl.arange(0, TA)
    b = tb * TB + tl.arange(0, TB)
    m = (a < A)[:, None] & (b < B)[None, :]
    c64 = c.to(tl.int64)
    a64 = a.to(tl.int64)
    b64 = b.to(tl.int64)
    xoff = c64 * sxc + (a64 * sxa)[:, None] + (b64 * sxb)[None, :]
    yoff = c64 * syc + (a64 * sya)[:, None] + (b64 * syb)[None, :]
    x = tl.load(x_ptr + xoff, mask=m, other=0.0)
    v = x.to(tl.float32)
    if HAS_PRE:
        v = v * tl.load(pre_scale_ptr + c) + tl.load(pre_shift_ptr + c)
    lo = tl.load(lo_ptr + c)
    inv = tl.load(inv_ptr + c)
    tab_row = tab_ptr.to(tl.pointer_type(tl.int64)) + c64 * (CELLS + 2)
    y = _lookup(v, lo, inv, tab_row, m, CELLS)
    _store_as(y_ptr + yoff, y, m)


@triton.jit(do_not_specialize=["P"])
def _map_cols_kernel(x_ptr, y_ptr, tab_ptr, lo_ptr, inv_ptr, pre_scale_ptr, pre_shift_ptr,
                     P, C, B, sxa, sxc, sxb, sya, syc, syb,
                     CELLS: tl.constexpr, HAS_PRE: tl.constexpr, BP: tl.constexpr, BC: tl.constexpr):
    """Channel-fastest layouts: a tile of BP positions (a, b) x BC channels."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    a = p // B
    b = p - a * B
    m = (p < P)[:, None] & cm[None, :]
    a64 = a.to(tl.int64)
    b64 = b.to(tl.int64)
    c64 = c.to(tl.int64)
    xoff = (a64 * sxa + b64 * sxb)[:, None] + (c64 * sxc)[None, :]
    yoff = (a64 * sya + b64 * syb)[:, None] + (c64 * syc)[None, :]
    x = tl.load(x_ptr + xoff, mask=m, other=0.0)
    v = x.to(tl.float32)
    if HAS_PRE:
        pa = tl.load(pre_scale_ptr + c, mask=cm, other=1.0)
        pb = tl.load(pre_shift_ptr + c, mask=cm, other=0.0)
        v = v * pa[None, :] + pb[None, :]
    lo = tl.load(lo_ptr + c, mask=cm, other=0.0)[None, :]
    inv = tl.load(inv_ptr + c, mask=cm, other=0.0)[None, :]
    tab_row = tab_ptr.to(tl.pointer_type(tl.int64)) + (c64 * (CELLS + 2))[None, :]
    y = _lookup(v, lo, inv, tab_row, m, CELLS)
    _store_as(y_ptr + yoff, y, m)


# ---------------------------------------------------------------------------------------------------
# host side: launches (no host synchronisation, no data-dependent shapes)
# ---------------------------------------------------------------------------------------------------


def _kernel(fn, x: torch.Tensor):
    """``fn``, wrapped for tracing when ``x`` is a traced tensor (inside the triton_op under
    torch.compile), else the plain kernel (wrap_triton's dispatch costs time in eager mode)."""
    if type(x) is torch.Tensor or _wrap_triton is None:
        return fn
    return _wrap_triton(fn)


def _channels_fastest(x: torch.Tensor) -> bool:
    """Whether the channel is the innermost dim in memory (channels_last, tokens)."""
    _, _, b = x.shape
    sa, sc, sb = x.stride()
    return sc == 1 and (b == 1 or sb != 1)


def _parts(tiles: int, programs: int) -> tuple[int, int]:
    """``(per, split)``: tiles per program and programs per channel (block) for about ``programs``."""
    per = _cdiv(tiles, max(1, min(tiles, programs)))
    return per, _cdiv(tiles, per)


def targets_impl(
    x: torch.Tensor,
    pre_scale: Optional[torch.Tensor],
    pre_shift: Optional[torch.Tensor],
    positions: torch.Tensor,
    ranks: torch.Tensor,
    fracs: torch.Tensor,
    histogram: bool,
    bins: int,
    stats_tile: int,
    stats_warps: int,
    stats_programs: int,
    sort_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Knots (C, K), moments (C, 2) and the finite flag of ``x`` (A, C, B); see the module doc.

    With ``histogram`` the knots come from every value (``ranks``/``fracs`` for ``A * B`` values,
    ``positions`` the few sampled offsets that centre the coarse histogram), else from the sorted
    sample at ``positions`` (``ranks``/``fracs`` for that sample).
    """
    a, c, b = x.shape
    k = ranks.shape[0]
    s = positions.shape[0]
    sxa, sxc, sxb = x.stride()
    dev = x.device
    n = a * b
    finite = torch.empty((), dtype=torch.bool, device=dev)
    has_pre = pre_scale is not None
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    ps = pre_scale if has_pre else dummy
    pb = pre_shift if has_pre else dummy
    centre = torch.empty(c, 2, dtype=torch.float32, device=dev) if histogram else dummy
    # per channel: coarse buckets, fine buckets, the count below the window (atomic integer sums)
    hist = torch.zeros(c, COARSE_BUCKETS + bins + 1, dtype=torch.int32, device=dev) if histogram else dummy
    cols = _channels_fastest(x)
    hc = COARSE_BUCKETS
    s_pad = max(2, _pow2(s))
    if cols:
        bc = min(_pow2(c), 128, HIST_BUCKETS_MAX // hc if histogram else 128)
        bp = max(1, min(_pow2(n), stats_tile // bc))
        per, split = _parts(_cdiv(n, bp), _cdiv(stats_programs, _cdiv(c, bc)))
        part = torch.empty(5, c, split, dtype=torch.float32, device=dev)
        _kernel(_extremes_cols_kernel, x)[(_cdiv(c, bc), split)](
            x, part, finite, ps, pb, positions, centre, hist, c, b, n, sxa, sxc, sxb, split, per, s,
            HAS_PRE=has_pre, HIST=histogram, NC=hc, NF=bins, T=COARSE_RANGE, S_PAD=s_pad, BP=bp, BC=bc,
            num_warps=stats_warps)
    else:
        tb = min(_pow2(b), 1024, stats_tile)
        ta = max(1, min(_pow2(a), stats_tile // tb))
        n_tb = _cdiv(b, tb)
        per, split = _parts(_cdiv(a, ta) * n_tb, _cdiv(stats_programs, c))
        part = torch.empty(5, c, split, dtype=torch.float32, device=dev)
        _kernel(_extremes_rows_kernel, x)[(c, split)](
            x, part, finite, ps, pb, positions, centre, hist, a, c, b, sxa, sxc, sxb, split, n_tb, per, s,
            HAS_PRE=has_pre, HIST=histogram, NC=hc, NF=bins, T=COARSE_RANGE, S_PAD=s_pad, TA=ta, TB=tb,
            num_warps=stats_warps)
    tq = torch.empty(c, k, dtype=torch.float32, device=dev)
    moments = torch.empty(c, 2, dtype=torch.float32, device=dev)
    if not histogram:
        _kernel(_targets_kernel, x)[(c,)](
            x, positions, part, ps, pb, ranks, fracs, tq, moments, finite, c, sxc, s, k, split,
            HAS_PRE=has_pre, S_PAD=s_pad, K_PAD=_pow2(k), SPLIT_BLOCK=64, num_warps=sort_warps)
        return tq, moments, finite
    if cols:
        fbc = max(1, min(_pow2(c), HIST_BUCKETS_MAX // bins))
        fbp = max(1, min(_pow2(n), stats_tile // fbc))
        fper, fsplit = _parts(_cdiv(n, fbp), _cdiv(stats_programs, _cdiv(c, fbc)))
        _kernel(_fine_cols_kernel, x)[(_cdiv(c, fbc), fsplit)](
            x, part, centre, hist, ps, pb, ranks, c, b, n, sxa, sxc, sxb, split, fper, k, n, float(n),
            HAS_PRE=has_pre, NC=hc, NF=bins, T=COARSE_RANGE, BP=fbp, BC=fbc, SPLIT_BLOCK=64, num_warps=stats_warps)
    else:
        _kernel(_fine_rows_kernel, x)[(c, split)](
            x, part, centre, hist, ps, pb, ranks, a, c, b, sxa, sxc, sxb, split, n_tb, per, k, n, float(n),
            HAS_PRE=has_pre, NC=hc, NF=bins, T=COARSE_RANGE, TA=ta, TB=tb, SPLIT_BLOCK=64, num_warps=stats_warps)
    _kernel(_knots_kernel, x)[(c,)](
        x, part, centre, hist, ps, pb, ranks, fracs, tq, moments, finite, c, sxc, k, split, n, float(n),
        HAS_PRE=has_pre, NC=hc, NF=bins, T=COARSE_RANGE, K_PAD=_pow2(k), SPLIT_BLOCK=64, num_warps=sort_warps)
    return tq, moments, finite


def apply_impl(
    x: torch.Tensor,
    tq: torch.Tensor,
    sq: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    pre_scale: Optional[torch.Tensor],
    pre_shift: Optional[torch.Tensor],
    tail: int,
    z0: float,
    z98: float,
    cells: int,
    map_tile: int,
    map_warps: int,
    table_warps: int,
) -> torch.Tensor:
    """The table map of ``x`` (A, C, B) with knots ``tq``/``sq`` (C, K); see the module doc.

    ``mean``/``std`` are (C, 1) views (any row stride); ``loc``/``scale`` (C,). The parametric
    values are read by the parametric tails only (callers pass any (C,)-sized tensors otherwise).
    """
    a, c, b = x.shape
    k = tq.shape[1]
    dev = x.device
    tab = torch.empty(c, cells + 2, 2, dtype=torch.float32, device=dev)
    lo = torch.empty(c, dtype=torch.float32, device=dev)
    inv = torch.empty(c, dtype=torch.float32, device=dev)
    k_pad = _pow2(k + 1)  # at least one +inf pad: the binary searches rely on it
    _kernel(_table_kernel, x)[(c,)](
        tq, sq, mean, std, mean.stride(0), loc, scale, tab, lo, inv, tail, z0, z98, k,
        CELLS=cells, CP=_pow2(cells), K_PAD=k_pad, LOG_K=k_pad.bit_length() - 1, num_warps=table_warps)
    # same strides as x when x is dense (NCHW, channels_last, tokens), else contiguous
    y = torch.empty_like(x)
    has_pre = pre_scale is not None
    ps = pre_scale if has_pre else lo
    pb = pre_shift if has_pre else lo
    sxa, sxc, sxb = x.stride()
    sya, syc, syb = y.stride()
    if _channels_fastest(x):
        bc = min(_pow2(c), 128)
        bp = max(1, map_tile // bc)
        grid = (_cdiv(a * b, bp), _cdiv(c, bc))
        _kernel(_map_cols_kernel, x)[grid](
            x, y, tab, lo, inv, ps, pb, a * b, c, b, sxa, sxc, sxb, sya, syc, syb,
            CELLS=cells, HAS_PRE=has_pre, BP=bp, BC=bc, num_warps=map_warps)
    else:
        tb = min(_pow2(b), 1024, map_tile)
        ta = max(1, min(_pow2(a), map_tile // tb))
        n_tb = _cdiv(b, tb)
        tiles = _cdiv(a, ta) * n_tb
        _kernel(_map_rows_kernel, x)[(c * tiles,)](
            x, y, tab, lo, inv, ps, pb, a, c, b, sxa, sxc, sxb, sya, syc, syb, tiles, n_tb,
            CELLS=cells, HAS_PRE=has_pre, TA=ta, TB=tb, num_warps=map_warps)
    return y


def _register() -> tuple[object, object, str]:
    """The two host functions as ``torch.library.triton_op`` custom ops (torch >= 2.6), so that
    torch.compile traces the kernels; otherwise functions that a compiled model runs eagerly
    (a graph break around each call). Also returns why the ops are missing ("" when present)."""
    triton_op = getattr(torch.library, "triton_op", None)
    if triton_op is None or _wrap_triton is None:
        why = f"torch {torch.__version__} has no torch.library.triton_op"
    else:
        try:
            return (triton_op("aqr_triton::targets", targets_impl, mutates_args=()),
                    triton_op("aqr_triton::apply", apply_impl, mutates_args=()), "")
        except Exception as err:  # noqa: BLE001 - e.g. registered twice, or a schema torch cannot infer
            why = f"triton_op registration failed: {type(err).__name__}: {err}"
    return torch.compiler.disable(targets_impl), torch.compiler.disable(apply_impl), why


_wrap_triton = getattr(torch.library, "wrap_triton", None)
targets_op, apply_op, CUSTOM_OPS_MISSING = _register()


def call(op, impl, *args):
    """The custom op while torch.compile traces (it sees the kernels), the plain function in eager
    mode (a custom op's dispatch costs tens of microseconds per call)."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


