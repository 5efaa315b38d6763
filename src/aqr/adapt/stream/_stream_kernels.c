/* Streaming AQR's CPU kernels: a layer's running target state, updated and applied in one pass.
 *
 * A library of its own, linked with aqr/backends/_parallel.c (the thread team the per-batch kernels
 * use too) by aqr/backends/build.py; called through aqr/adapt/stream/native_kernels.py, mirrored
 * operation by operation in torch by aqr/adapt/stream/torch_kernels.py (the reference the fuzz
 * tests hold these kernels to).
 *
 * Per layer and channel the state is: K running knots kn (p0 and p100 the Average Sample Tails of
 * the tail window, the inner knots a piecewise-linear CDF), a lookup table of the map built from
 * them, the tail window (the last W images' minima and maxima, a ring in arrival order and a
 * sorted copy), and the pending group (a histogram of recent values on bins fixed by the knots,
 * and the group's extremes). See aqr/adapt/stream/running.py for the algorithm and why.
 *
 *   aqr_stream_scan     the per-batch pass: map through the table, per-image extremes, NaN/Inf
 *                       check and a strided histogram on the knots' bins
 *   aqr_stream_push     a batch into the pending group and the tail window
 *   aqr_stream_tails    Average Sample Tails of the window (weights given)
 *   aqr_stream_merge    the pending group into the knots: EMA of piecewise-linear CDFs
 *   aqr_stream_tables   the lookup table of the map from the knots onto the source knots
 *   aqr_stream_group_merge  target="robust": each group's pending histogram into its CDF
 *   aqr_stream_mixture  target="robust": the quantiles of the (weighted) mixture of the groups' CDFs
 *   aqr_stream_shift_distances  target="robust": how far a batch's histogram lies from the knots' CDF,
 *                       and its two halves from each other
 *   aqr_stream_merge_map  a counted batch pushed into copies of the group and window, merged into a
 *                       copy of the knots and mapped, in one call
 *   aqr_stream_large    a batch of rebuild_every images or more: counted, then aqr_stream_merge_map
 *   aqr_stream_idle_rebuild  target="robust": a batch alone into the marginal while the groups weigh
 *                       nothing, the knots from it and the window's tails
 *   aqr_stream_cluster_scan  target="mixed": each image scanned on its cluster's state, its map blended
 *                       into the shared state's, the clusters' histograms, in one call
 *   aqr_stream_cluster_push  target="mixed": each cluster's images pushed into its group and window
 *   aqr_stream_bound_scan, aqr_stream_bound_commit  a small batch on a layer's state bound once: the
 *                       scan (map and count), then its push and, every rebuild_every images, the knots
 *                       rebuilt from the group and the window and the table from the knots, in one call
 *
 * Every index computed from data (a table cell, a histogram bin, a position in the sorted window)
 * is clamped to its array before a float is converted; sizes and counters the caller passes are
 * checked first (STREAM_BAD_ARGUMENT). Arithmetic that can overflow float between two finite
 * floats (a range spanning +-3e38) runs in double.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "_shared.h"

enum { STREAM_OK = 0, STREAM_NONFINITE = 1, STREAM_NO_MEMORY = -1, STREAM_BAD_ARGUMENT = -2 };
enum { STREAM_MAP = 1, STREAM_COUNT = 2, STREAM_IMAGE_COUNT = 4, STREAM_PAIRED = 8 };
/* A layout flag beside the modes: x and y hold (A, B, C), each of the A * B positions' C values side by side
   (a channels-last output), instead of (A, C, B). */
enum { STREAM_ROWS = 16 };
enum { STREAM_EDGE_BINS = 4 }; /* below p0, [p0, p1), [p_{K-2}, p_{K-1}), from p_{K-1} on */

/* Layer outputs of more values than this are split over the thread team. */
enum { STREAM_PARALLEL_VALUES = 1 << 15 };

static int stream_parts(int64_t C, int64_t values, int nthreads) {
    return values < STREAM_PARALLEL_VALUES ? 1 : num_parts(C, nthreads);
}

static int stream_sizes_ok(int64_t C, int64_t K, int64_t G, int64_t GC) {
    return C >= 1 && K >= 3 && K < (1 << 24) && G >= 1 && G < (1 << 24) && GC >= 1 && GC < (1 << 24) &&
           C < INT64_MAX / (G + 2) / 8 && C < INT64_MAX / (GC + STREAM_EDGE_BINS) / 8;
}

/* Whether v is NaN or +-inf (on the bits, so fast-math could not fold it away). */
static inline int stream_nonfinite(float v) {
    union { float f; uint32_t u; } b = {v};
    return (b.u & 0x7f800000u) == 0x7f800000u;
}

/* f clamped to [0, top] as a float, NaN to 0, then converted: always a valid index. */
static inline int64_t stream_index(float f, int64_t top) {
    if (!(f > 0.0f)) return 0;
    return f < (float)top ? (int64_t)f : top;
}

/* float of a double, saturating at +-FLT_MAX (a slope of 1e300 would be inf). */
static inline float stream_float(double v) {
    if (v != v) return 0.0f;
    return v > FLT_MAX ? FLT_MAX : (v < -FLT_MAX ? -FLT_MAX : (float)v);
}

#ifdef __AVX2__
/* stream_float of four doubles: NaN to 0, saturated at +-FLT_MAX, rounded to float as the cast does. */
static inline __m128 stream_float4(__m256d v) {
    const __m256d top = _mm256_set1_pd(FLT_MAX), bottom = _mm256_set1_pd(-FLT_MAX);
    const __m256d nan = _mm256_cmp_pd(v, v, _CMP_UNORD_Q);
    v = _mm256_max_pd(_mm256_min_pd(v, top), bottom);
    return _mm256_cvtpd_ps(_mm256_andnot_pd(nan, v));
}
#endif

/* The line through (x0, y0) and (x1, y1) as (slope, intercept); flat at y_flat when x1 <= x0. */
static void stream_line(double x0, double y0, double x1, double y1, double y_flat, float *slope, float *icpt) {
    double run = x1 - x0;
    double s = run > 0 ? (y1 - y0) / run : 0.0;
    *slope = stream_float(s);
    *icpt = stream_float(run > 0 ? y0 - (double)*slope * x0 : y_flat);
}

/* ------------------------------------------------------------------------------------------------
 * The per-batch pass. x (A, C, B) holds N images of A / N rows each; pre_scale / pre_shift (C) or
 * NULL fold an eval BatchNorm (everything reads v = pre_scale * x + pre_shift). kn (C, K) the
 * knots, sq (C, K) the source knots, pairs (C, G + 2, 2) (slope, intercept per cell) and glo / ginv
 * (C) the table of aqr_stream_tables. mode & STREAM_MAP: y = the map; where the batch passes the knots' ends, the
 * edge lines are stretched out to the batch's own extremes (a value is never extrapolated beyond
 * them, as in per-batch AQR, whose ends are the batch's extremes). mode & STREAM_COUNT: counts
 * (C, GC + 4) = the histogram of every stride-th value of the channel (flat position r * B + b) on
 * the bins [.., p0), [p0, p1), GC equal cells of [p1, p_{K-2}), [p_{K-2}, p_{K-1}), [p_{K-1}, ..).
 * mode & STREAM_IMAGE_COUNT (not with STREAM_COUNT): counts (N, C, GC + 4) = each image's own
 * histogram on those bins, of every stride-th value by flat position within the image's rows; with
 * STREAM_PAIRED, counts (2, C, GC + 4) = those of the even images summed, then the odd images'.
 * Always lo / hi (N, C): each image's extremes. With STREAM_ROWS, x and y are laid out (A, B, C) (the
 * position r * B + b's C values side by side) and every output is the one of the (A, C, B) layout.
 * Returns STREAM_OK, STREAM_NONFINITE when a value v
 * is NaN or +-inf (y, counts, lo and hi are then partly written and meaningless), or
 * STREAM_BAD_ARGUMENT. */
typedef struct {
    const float *x;
    float *y;
    int64_t A, C, B, N, K, G, GC, stride;
    const float *pre_scale, *pre_shift, *kn, *sq, *pairs, *glo, *ginv;
    int32_t *counts;
    float *lo, *hi;
    int mode;
    int32_t *bad; /* (C): a non-finite value in the channel */
} stream_scan_args;

#ifdef __AVX2__
/* The eight lanes' extremes and non-finite flags folded into *mn, *mx, *bad. */
static inline void fold_lanes(__m256 vmn, __m256 vmx, __m256 vbad, float *mn, float *mx, int *bad) {
    float lanes[8];
    _mm256_storeu_ps(lanes, vmn);
    for (int j = 0; j < 8; j++) *mn = lanes[j] < *mn ? lanes[j] : *mn;
    _mm256_storeu_ps(lanes, vmx);
    for (int j = 0; j < 8; j++) *mx = lanes[j] > *mx ? lanes[j] : *mx;
    *bad |= _mm256_movemask_ps(vbad) != 0;
}

/* v = ps * x + pb on eight values at p; their extremes and non-finite flags folded into the running lanes. */
static inline __m256 affine_step(const float *p, __m256 vps, __m256 vpb, __m256 *vmn, __m256 *vmx, __m256 *vbad) {
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(p), vps), vpb);
    *vbad = _mm256_or_ps(*vbad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ)); /* NaN or +-inf */
    *vmn = _mm256_min_ps(*vmn, v);
    *vmx = _mm256_max_ps(*vmx, v);
    return v;
}
#endif

#ifdef AQR_WIDE_LOOKUP
/* stream_map_row's mapped rows 16 values at a time with AVX-512's gathers (where aqr_choose_lookup
   chose them): the same float operations lane by lane. Returns how many of the B values it mapped. */
AQR_WIDE static int64_t stream_map_row_wide(const float *xp, float *yp, int64_t B, float ps, float pb,
                                            const float *tab, float g0, float gi, int64_t G, float k1, float kb,
                                            float *mn_io, float *mx_io, int *bad_io) {
    const __m512 vps = _mm512_set1_ps(ps), vpb = _mm512_set1_ps(pb), vg0 = _mm512_set1_ps(g0);
    const __m512 vgi = _mm512_set1_ps(gi), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __m512 vtop = _mm512_set1_ps((float)(G + 1)), vk1 = _mm512_set1_ps(k1), vkb = _mm512_set1_ps(kb);
    const __m512i last = _mm512_set1_epi32((int)(G + 1)), first = _mm512_setzero_si512();
    __m512 vmn = _mm512_set1_ps(*mn_io), vmx = _mm512_set1_ps(*mx_io);
    __mmask16 bad = 0;
    int64_t b = 0;
    for (; b + 16 <= B; b += 16) {
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(xp + b), vps), vpb);
        bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), zero, _CMP_NEQ_UQ); /* NaN or +-inf */
        vmn = _mm512_min_ps(vmn, v);
        vmx = _mm512_max_ps(vmx, v);
        __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, vg0), vgi), one);
        t = _mm512_min_ps(_mm512_max_ps(t, zero), vtop); /* max(NaN, 0) is 0: its second operand */
        __m512i cell = _mm512_cvttps_epi32(t);
        cell = _mm512_mask_mov_epi32(cell, _mm512_cmp_ps_mask(v, vkb, _CMP_GE_OQ), last);
        cell = _mm512_mask_mov_epi32(cell, _mm512_cmp_ps_mask(v, vk1, _CMP_LT_OQ), first);
        _mm512_storeu_ps(yp + b, wide_pair_lookup(tab, cell, v));
    }
    *mn_io = _mm512_reduce_min_ps(vmn);
    *mx_io = _mm512_reduce_max_ps(vmx);
    *bad_io |= bad != 0;
    return b;
}
#endif

/* v mapped by the table tab of a channel (pairs of slope and intercept, G + 2 cells): cell 0 below k1, G + 1
   from kb on, the grid's cell between (origin g0, width 1 / gi). */
static inline float stream_map_value(const float *tab, float v, float g0, float gi, float k1, float kb, int64_t G) {
    int64_t cell = stream_index((v - g0) * gi + 1.0f, G + 1);
    cell = v >= kb ? G + 1 : cell;
    cell = v < k1 ? 0 : cell;
    return tab[2 * cell] * v + tab[2 * cell + 1];
}

#ifdef __AVX2__
/* The table cells of stream_map_value for eight values v at once (per-lane g0, gi, k1, kb; G grid cells). */
static inline __m256i stream_cells8(__m256 v, __m256 vg0, __m256 vgi, __m256 vk1, __m256 vkb, int64_t G) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps(), vtop = _mm256_set1_ps((float)(G + 1));
    const __m256i last = _mm256_set1_epi32((int)(G + 1)), first = _mm256_setzero_si256();
    __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, vg0), vgi), one);
    t = _mm256_min_ps(_mm256_max_ps(t, zero), vtop); /* max(NaN, 0) is 0: its second operand */
    __m256i cell = _mm256_cvttps_epi32(t);
    cell = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(cell), _mm256_castsi256_ps(last),
                                                _mm256_cmp_ps(v, vkb, _CMP_GE_OQ)));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(cell), _mm256_castsi256_ps(first),
                                                _mm256_cmp_ps(v, vk1, _CMP_LT_OQ)));
}
#endif

/* One row of B values: y = the table map of v = ps * x + pb (unless y is NULL), and the row's
   extremes and non-finite flag folded into *mn, *mx, *bad. tab: the channel's (G + 2) pairs
   (slope, intercept); cell 0 below k1, G + 1 from kb on, else the grid cell of v. */
static inline void stream_map_row(const float *xp, float *yp, int64_t B, float ps, float pb, const float *tab,
                                  float g0, float gi, int64_t G, float k1, float kb, float *mn_io, float *mx_io,
                                  int *bad_io) {
    float mn = *mn_io, mx = *mx_io;
    int bad = 0;
    int64_t b = 0;
#ifdef AQR_WIDE_LOOKUP
    if (yp && aqr_wide_lookup) b = stream_map_row_wide(xp, yp, B, ps, pb, tab, g0, gi, G, k1, kb, &mn, &mx, &bad);
#endif
#ifdef __AVX2__
    if (yp) {
        const __m256 vps = _mm256_set1_ps(ps), vpb = _mm256_set1_ps(pb), vg0 = _mm256_set1_ps(g0);
        const __m256 vgi = _mm256_set1_ps(gi), vk1 = _mm256_set1_ps(k1), vkb = _mm256_set1_ps(kb);
        __m256 vmn = _mm256_set1_ps(mn), vmx = _mm256_set1_ps(mx), vbad = _mm256_setzero_ps();
        for (; b + 8 <= B; b += 8) {
            const __m256 v = affine_step(xp + b, vps, vpb, &vmn, &vmx, &vbad);
            _mm256_storeu_ps(yp + b, pair_lookup(tab, stream_cells8(v, vg0, vgi, vk1, vkb, G), v));
        }
        fold_lanes(vmn, vmx, vbad, &mn, &mx, &bad);
    } else { /* no map: the extremes and the check alone */
        const __m256 vps = _mm256_set1_ps(ps), vpb = _mm256_set1_ps(pb);
        __m256 vmn = _mm256_set1_ps(mn), vmx = _mm256_set1_ps(mx), vbad = _mm256_setzero_ps();
        for (; b + 8 <= B; b += 8) (void)affine_step(xp + b, vps, vpb, &vmn, &vmx, &vbad);
        fold_lanes(vmn, vmx, vbad, &mn, &mx, &bad);
    }
#endif
    for (; b < B; b++) {
        const float v = xp[b] * ps + pb;
        bad |= stream_nonfinite(v);
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        if (yp) yp[b] = stream_map_value(tab, v, g0, gi, k1, kb, G);
    }
    *mn_io = mn, *mx_io = mx, *bad_io |= bad;
}

/* A channel's histogram bins (the layout of aqr_stream_scan's counts): below k0, [k0, k1), GC equal
   cells of [k1, kb) of inverse width cinv, [kb, kl), from kl on. */
typedef struct {
    float ps, pb, k0, k1, kb, kl, cinv;
    int64_t GC;
} stream_bins;

/* The bins of one channel's knots k (K of them), its values read as ps * x + pb. */
static stream_bins stream_knot_bins(const float *k, int64_t K, int64_t GC, float ps, float pb) {
    const double span = (double)k[K - 2] - (double)k[1];
    stream_bins q = {ps, pb, k[0], k[1], k[K - 2], k[K - 1], span > 0 ? stream_float((double)GC / span) : 0.0f, GC};
    return q;
}

static stream_bins stream_channel_bins(const stream_scan_args *a, int64_t c) {
    return stream_knot_bins(a->kn + c * a->K, a->K, a->GC, a->pre_scale ? a->pre_scale[c] : 1.0f,
                            a->pre_shift ? a->pre_shift[c] : 0.0f);
}

/* The edge lines of a map on the bins q onto the source knots s (K of them), stretched out to the extremes
   lo / hi where they pass the knots' ends: (slope, intercept) below k1 into line[0..1], from kb on into
   line[2..3]. */
static void stream_edge_lines(const stream_bins *q, const float *s, int64_t K, float lo, float hi, float line[4]) {
    stream_line(lo < q->k0 ? lo : q->k0, s[0], q->k1, s[1], s[1], &line[0], &line[1]);
    stream_line(q->kb, s[K - 2], hi > q->kl ? hi : q->kl, s[K - 1], s[K - 2], &line[2], &line[3]);
}

static inline int64_t stream_bin(const stream_bins *q, float v) {
    if (v < q->k1) return v < q->k0 ? 0 : 1;
    if (v >= q->kb) return v >= q->kl ? q->GC + 3 : q->GC + 2;
    return 2 + stream_index((v - q->k1) * q->cinv, q->GC - 1);
}

#ifdef __AVX2__
/* stream_bin of eight values v at once, on bins whose edges are k0, k1, kb, kl (per lane) and cells of width
   1 / cinv between k1 and kb; GC cells. */
static inline __m256i stream_bins8(__m256 v, __m256 k0, __m256 k1, __m256 kb, __m256 kl, __m256 cinv, int64_t GC) {
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps((float)(GC - 1));
    const __m256i two = _mm256_set1_epi32(2), one = _mm256_set1_epi32(1), first = _mm256_setzero_si256();
    const __m256i inner_top = _mm256_set1_epi32((int)(GC + 2)), last = _mm256_set1_epi32((int)(GC + 3));
    /* stream_index: max(NaN, 0) is 0 (its second operand), then at most GC - 1, truncated */
    __m256 t = _mm256_mul_ps(_mm256_sub_ps(v, k1), cinv);
    t = _mm256_min_ps(_mm256_max_ps(t, zero), top);
    __m256i bin = _mm256_add_epi32(_mm256_cvttps_epi32(t), two);
    const __m256i above = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(inner_top), _mm256_castsi256_ps(last), _mm256_cmp_ps(v, kl, _CMP_GE_OQ)));
    bin = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bin), _mm256_castsi256_ps(above),
                                               _mm256_cmp_ps(v, kb, _CMP_GE_OQ)));
    const __m256i below = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(one), _mm256_castsi256_ps(first), _mm256_cmp_ps(v, k0, _CMP_LT_OQ)));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bin), _mm256_castsi256_ps(below),
                                                _mm256_cmp_ps(v, k1, _CMP_LT_OQ)));
}
#endif

/* cnt += the histogram of xp[b], xp[b + stride], ... below B (v = ps * x + pb) on the bins q: every
   value lands in a bin, NaN in one of them too (its counts are then discarded with the batch). */
static void stream_count_row(const float *xp, int64_t b, int64_t B, int64_t stride, const stream_bins *q,
                             int32_t *cnt) {
#ifdef __AVX2__
    if (stride <= (INT32_MAX - 1) / 8) {
        const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)stride));
        const __m256 vps = _mm256_set1_ps(q->ps), vpb = _mm256_set1_ps(q->pb);
        const __m256 k0 = _mm256_set1_ps(q->k0), k1 = _mm256_set1_ps(q->k1), kb = _mm256_set1_ps(q->kb);
        const __m256 kl = _mm256_set1_ps(q->kl), cinv = _mm256_set1_ps(q->cinv);
        for (; b + 7 * stride < B; b += 8 * stride) {
            const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_i32gather_ps(xp + b, at, 4), vps), vpb);
            const __m256i bin = stream_bins8(v, k0, k1, kb, kl, cinv, q->GC);
            int32_t lane[8];
            _mm256_storeu_si256((__m256i *)lane, bin);
#if defined(__GNUC__) || defined(__clang__)
            __asm__("" : "+m"(lane)); /* read back by loads, not extracted one by one (as pair_lookup's indices) */
#endif
            for (int j = 0; j < 8; j++) cnt[lane[j]]++;
        }
    }
#endif
    for (; b < B; b += stride) cnt[stream_bin(q, xp[b] * q->ps + q->pb)]++;
}

/* The edge lines stretched over one row: y = al * v + bl where v < k1, ah * v + bh where v >= kb. */
static void stream_stretch_row(const float *xp, float *yp, int64_t B, float ps, float pb, float k1, float kb,
                               float al, float bl, float ah, float bh) {
    int64_t b = 0;
#ifdef __AVX2__
    const __m256 vps = _mm256_set1_ps(ps), vpb = _mm256_set1_ps(pb), vk1 = _mm256_set1_ps(k1);
    const __m256 vkb = _mm256_set1_ps(kb), val = _mm256_set1_ps(al), vbl = _mm256_set1_ps(bl);
    const __m256 vah = _mm256_set1_ps(ah), vbh = _mm256_set1_ps(bh);
    for (; b + 8 <= B; b += 8) {
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xp + b), vps), vpb);
        const __m256 low = _mm256_cmp_ps(v, vk1, _CMP_LT_OQ), high = _mm256_cmp_ps(v, vkb, _CMP_GE_OQ);
        if (_mm256_movemask_ps(_mm256_or_ps(low, high)) == 0) continue;
        __m256 y = _mm256_blendv_ps(_mm256_loadu_ps(yp + b), _mm256_add_ps(_mm256_mul_ps(vah, v), vbh), high);
        y = _mm256_blendv_ps(y, _mm256_add_ps(_mm256_mul_ps(val, v), vbl), low);
        _mm256_storeu_ps(yp + b, y);
    }
#endif
    for (; b < B; b++) {
        const float v = xp[b] * ps + pb;
        if (v < k1) yp[b] = al * v + bl;
        else if (v >= kb) yp[b] = ah * v + bh;
    }
}

/* Channel c: each row mapped (or only read) and, while it is in the cache, its strided values counted. */
static void stream_scan_channel(const stream_scan_args *a, int64_t c) {
    const int64_t K = a->K, G = a->G, B = a->B, rows = a->A / a->N, stride = a->stride;
    const int64_t bins = a->GC + STREAM_EDGE_BINS;
    const stream_bins q = stream_channel_bins(a, c);
    const float ps = q.ps, pb = q.pb;
    const float *s = a->sq + c * K;
    const float k0 = q.k0, k1 = q.k1, kb = q.kb, kl = q.kl;
    const float *tab = a->pairs + c * 2 * (G + 2);
    const float g0 = a->glo[c], gi = a->ginv[c];
    const int per_image = (a->mode & STREAM_IMAGE_COUNT) != 0, paired = (a->mode & STREAM_PAIRED) != 0;
    int32_t *cnt = (a->mode & STREAM_COUNT) ? a->counts + c * bins : NULL;
    if (cnt) memset(cnt, 0, sizeof(int32_t) * (size_t)bins);
    if (paired) /* both sums start at 0, the odd one too where there is one image */
        for (int64_t half = 0; half < 2; half++)
            memset(a->counts + (half * a->C + c) * bins, 0, sizeof(int32_t) * (size_t)bins);
    float bmin = INFINITY, bmax = -INFINITY;
    int bad = 0;
    for (int64_t n = 0; n < a->N; n++) {
        if (per_image) {
            cnt = a->counts + ((paired ? n & 1 : n) * a->C + c) * bins;
            if (!paired) memset(cnt, 0, sizeof(int32_t) * (size_t)bins);
        }
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t r = n * rows; r < (n + 1) * rows; r++) {
            const int64_t at = (r * a->C + c) * B;
            stream_map_row(a->x + at, a->y ? a->y + at : NULL, B, ps, pb, tab, g0, gi, G, k1, kb, &mn, &mx, &bad);
            if (cnt) { /* the values at flat positions (r - r0) * B + b, a multiple of stride, r0 the counted rows' first */
                const int64_t skip = ((per_image ? r - n * rows : r) * B) % stride;
                stream_count_row(a->x + at, skip ? stride - skip : 0, B, stride, &q, cnt);
            }
        }
        a->lo[n * a->C + c] = mn;
        a->hi[n * a->C + c] = mx;
        bmin = mn < bmin ? mn : bmin;
        bmax = mx > bmax ? mx : bmax;
    }
    a->bad[c] = bad;
    if (bad || !a->y || !(bmin < k0 || bmax > kl)) return;
    float line[4]; /* stretch the edge lines to the batch's extremes */
    stream_edge_lines(&q, s, K, bmin, bmax, line);
    for (int64_t r = 0; r < a->A; r++) {
        const int64_t at = (r * a->C + c) * B;
        stream_stretch_row(a->x + at, a->y + at, B, ps, pb, k1, kb, line[0], line[1], line[2], line[3]);
    }
}

/* Channel c's table asked for ahead of its lookups: between images (batch 1, streaming) the tables
   leave the caches, and the lookups, whose addresses come from the data, would wait on one cache line at a time
   (measured at batch 1 on the ResNet-20: the scan took 1.5 ms an image without, 0.8-0.9 with; asking
   for the knots too, or for several channels ahead, gained nothing more). */
static void stream_prefetch_table(const stream_scan_args *a, int64_t c) {
    const char *tab = (const char *)(a->pairs + c * 2 * (a->G + 2));
    for (int64_t at = 0; at < (int64_t)sizeof(float) * 2 * (a->G + 2); at += 64) __builtin_prefetch(tab + at, 0, 3);
}

static void stream_scan_part(void *p, int part, int64_t c0, int64_t c1) {
    (void)part;
    const stream_scan_args *a = (const stream_scan_args *)p;
    if (a->y && c0 < c1) stream_prefetch_table(a, c0);
    for (int64_t c = c0; c < c1; c++) {
        if (a->y && c + 1 < c1) stream_prefetch_table(a, c + 1);
        stream_scan_channel(a, c);
    }
}

/* Channels per block of stream_scan_rows_part: its per-channel state stays on the stack. */
enum { STREAM_ROWS_BLOCK = 64 };

/* A block's per-channel parameters (index j: channel c0 + j), as stream_scan_channel reads them. */
typedef struct {
    float ps[STREAM_ROWS_BLOCK], pb[STREAM_ROWS_BLOCK], g0[STREAM_ROWS_BLOCK], gi[STREAM_ROWS_BLOCK];
    float k0[STREAM_ROWS_BLOCK], k1[STREAM_ROWS_BLOCK], kb[STREAM_ROWS_BLOCK], kl[STREAM_ROWS_BLOCK];
    float cinv[STREAM_ROWS_BLOCK];
    int32_t base[STREAM_ROWS_BLOCK]; /* channel c0 + j's first pair in the table (C * (G + 2) fits in int32) */
    stream_bins q[STREAM_ROWS_BLOCK];
} stream_rows_params;

/* Channel j of the block over P positions C apart from x (y: NULL, or the map's, likewise): the map and the
   extremes of stream_map_row, value by value, folded into *mn, *mx, *bad. */
static void stream_rows_map1(const stream_scan_args *a, const stream_rows_params *r, int64_t j, const float *x,
                             float *y, int64_t P, float *mn, float *mx, int32_t *bad) {
    const int64_t C = a->C, G = a->G;
    const float ps = r->ps[j], pb = r->pb[j], g0 = r->g0[j], gi = r->gi[j], k1 = r->k1[j], kb = r->kb[j];
    const float *tab = a->pairs + 2 * (int64_t)r->base[j];
    float lo = *mn, hi = *mx;
    int nonfinite = 0;
    for (int64_t p = 0; p < P; p++) {
        const float v = x[p * C] * ps + pb;
        nonfinite |= stream_nonfinite(v);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        if (y) y[p * C] = stream_map_value(tab, v, g0, gi, k1, kb, G);
    }
    *mn = lo, *mx = hi, *bad |= nonfinite;
}

#ifdef __AVX2__
/* stream_rows_map1 on the eight channels j..j + 7 at once (a lane each): the same operations lane by lane. */
static void stream_rows_map8(const stream_scan_args *a, const stream_rows_params *r, int64_t j, const float *x,
                             float *y, int64_t P, float *mn, float *mx, int32_t *bad) {
    const int64_t C = a->C, G = a->G;
    const __m256 vps = _mm256_loadu_ps(r->ps + j), vpb = _mm256_loadu_ps(r->pb + j);
    const __m256 vg0 = _mm256_loadu_ps(r->g0 + j), vgi = _mm256_loadu_ps(r->gi + j);
    const __m256 vk1 = _mm256_loadu_ps(r->k1 + j), vkb = _mm256_loadu_ps(r->kb + j);
    const __m256i vbase = _mm256_loadu_si256((const __m256i *)(r->base + j));
    __m256 vmn = _mm256_loadu_ps(mn), vmx = _mm256_loadu_ps(mx), vbad = _mm256_setzero_ps();
    if (y) {
        for (int64_t p = 0; p < P; p++) {
            const __m256 v = affine_step(x + p * C, vps, vpb, &vmn, &vmx, &vbad);
            const __m256i cell = stream_cells8(v, vg0, vgi, vk1, vkb, G);
            _mm256_storeu_ps(y + p * C, pair_lookup(a->pairs, _mm256_add_epi32(cell, vbase), v));
        }
    } else {
        for (int64_t p = 0; p < P; p++) (void)affine_step(x + p * C, vps, vpb, &vmn, &vmx, &vbad);
    }
    _mm256_storeu_ps(mn, vmn);
    _mm256_storeu_ps(mx, vmx);
    const __m256i was = _mm256_loadu_si256((const __m256i *)bad);
    _mm256_storeu_si256((__m256i *)bad, _mm256_or_si256(was, _mm256_srli_epi32(_mm256_castps_si256(vbad), 31)));
}

/* The bins of stream_bin for the eight channels j..j + 7 of the values at x (v = ps * x + pb), as
   stream_count_row computes them. */
static inline __m256i stream_rows_bins8(const stream_rows_params *r, int64_t j, const float *x, int64_t GC) {
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(r->ps + j)),
                                   _mm256_loadu_ps(r->pb + j));
    return stream_bins8(v, _mm256_loadu_ps(r->k0 + j), _mm256_loadu_ps(r->k1 + j), _mm256_loadu_ps(r->kb + j),
                        _mm256_loadu_ps(r->kl + j), _mm256_loadu_ps(r->cinv + j), GC);
}
#endif

/* One block of w <= STREAM_ROWS_BLOCK channels from c0 of a channels-last x (STREAM_ROWS): per channel, the
   per-value operations of stream_scan_channel (stream_map_row, stream_count_row, stream_stretch_row) on
   the same values, so its outputs (an extreme of +0 and -0 may come out either way). Eight channels to a
   vector where the AVX2 build has them, over an image's positions (C values apart) at a time. */
static void stream_scan_rows_block(const stream_scan_args *a, int64_t c0, int64_t w) {
    const int64_t C = a->C, K = a->K, N = a->N, GC = a->GC, stride = a->stride;
    const int64_t P = a->A / N * a->B, bins = GC + STREAM_EDGE_BINS; /* positions per image */
    const int per_image = (a->mode & STREAM_IMAGE_COUNT) != 0, paired = (a->mode & STREAM_PAIRED) != 0;
    const int counting = (a->mode & (STREAM_COUNT | STREAM_IMAGE_COUNT)) != 0;
    stream_rows_params r;
    float mn[STREAM_ROWS_BLOCK], mx[STREAM_ROWS_BLOCK], bmin[STREAM_ROWS_BLOCK], bmax[STREAM_ROWS_BLOCK];
    float line[4][STREAM_ROWS_BLOCK]; /* per channel: (slope, intercept) below k1, from kb on */
    int32_t bad[STREAM_ROWS_BLOCK], stretches[STREAM_ROWS_BLOCK], *cnt[STREAM_ROWS_BLOCK];
    for (int64_t j = 0; j < w; j++) {
        const int64_t c = c0 + j;
        const stream_bins q = stream_channel_bins(a, c);
        r.q[j] = q;
        r.ps[j] = q.ps, r.pb[j] = q.pb, r.k0[j] = q.k0, r.k1[j] = q.k1, r.kb[j] = q.kb, r.kl[j] = q.kl;
        r.cinv[j] = q.cinv, r.g0[j] = a->glo[c], r.gi[j] = a->ginv[c];
        r.base[j] = (int32_t)(c * (a->G + 2));
        bmin[j] = INFINITY, bmax[j] = -INFINITY, bad[j] = 0;
        cnt[j] = (a->mode & STREAM_COUNT) ? a->counts + c * bins : NULL;
        if (cnt[j]) memset(cnt[j], 0, sizeof(int32_t) * (size_t)bins);
        if (paired)
            for (int64_t half = 0; half < 2; half++)
                memset(a->counts + (half * C + c) * bins, 0, sizeof(int32_t) * (size_t)bins);
    }
    for (int64_t n = 0; n < N; n++) {
        const float *x = a->x + n * P * C + c0;
        float *y = a->y ? a->y + n * P * C + c0 : NULL;
        for (int64_t j = 0; j < w; j++) {
            mn[j] = INFINITY, mx[j] = -INFINITY;
            if (per_image) {
                cnt[j] = a->counts + ((paired ? n & 1 : n) * C + c0 + j) * bins;
                if (!paired) memset(cnt[j], 0, sizeof(int32_t) * (size_t)bins);
            }
        }
        int64_t j = 0;
#ifdef __AVX2__
        for (; j + 8 <= w; j += 8) stream_rows_map8(a, &r, j, x + j, y ? y + j : NULL, P, mn + j, mx + j, bad + j);
#endif
        for (; j < w; j++) stream_rows_map1(a, &r, j, x + j, y ? y + j : NULL, P, mn + j, mx + j, bad + j);
        if (counting) { /* flat positions (per image or over the batch) a multiple of stride */
            const int64_t skip = per_image ? 0 : (n * P) % stride;
            for (int64_t p = skip ? stride - skip : 0; p < P; p += stride) {
                const float *xp = x + p * C;
                j = 0;
#ifdef __AVX2__
                for (; j + 8 <= w; j += 8) {
                    int32_t lane[8];
                    _mm256_storeu_si256((__m256i *)lane, stream_rows_bins8(&r, j, xp + j, GC));
                    for (int k = 0; k < 8; k++) cnt[j + k][lane[k]]++;
                }
#endif
                for (; j < w; j++) cnt[j][stream_bin(&r.q[j], xp[j] * r.ps[j] + r.pb[j])]++;
            }
        }
        for (j = 0; j < w; j++) {
            a->lo[n * C + c0 + j] = mn[j];
            a->hi[n * C + c0 + j] = mx[j];
            bmin[j] = mn[j] < bmin[j] ? mn[j] : bmin[j];
            bmax[j] = mx[j] > bmax[j] ? mx[j] : bmax[j];
        }
    }
    int stretch = 0; /* channels whose edge lines reach out to the batch's extremes */
    for (int64_t j = 0; j < w; j++) {
        a->bad[c0 + j] = bad[j];
        float l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        stretches[j] = !bad[j] && a->y && (bmin[j] < r.q[j].k0 || bmax[j] > r.q[j].kl);
        if (stretches[j]) {
            stream_edge_lines(&r.q[j], a->sq + (c0 + j) * K, K, bmin[j], bmax[j], l);
            stretch = 1;
        } else { /* a lane of the vectors below left as mapped: its finite values are none below or from */
            r.k1[j] = -INFINITY, r.kb[j] = INFINITY;
        }
        for (int k = 0; k < 4; k++) line[k][j] = l[k];
    }
    if (!stretch) return;
    const int64_t positions = N * P;
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= w; j += 8) {
        const __m256 vps = _mm256_loadu_ps(r.ps + j), vpb = _mm256_loadu_ps(r.pb + j);
        const __m256 vk1 = _mm256_loadu_ps(r.k1 + j), vkb = _mm256_loadu_ps(r.kb + j);
        const __m256 val = _mm256_loadu_ps(line[0] + j), vbl = _mm256_loadu_ps(line[1] + j);
        const __m256 vah = _mm256_loadu_ps(line[2] + j), vbh = _mm256_loadu_ps(line[3] + j);
        int any = 0;
        for (int k = 0; k < 8; k++) any |= stretches[j + k];
        if (!any) continue;
        for (int64_t p = 0; p < positions; p++) { /* as stream_stretch_row */
            const float *xp = a->x + p * C + c0 + j;
            float *yp = a->y + p * C + c0 + j;
            const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xp), vps), vpb);
            const __m256 low = _mm256_cmp_ps(v, vk1, _CMP_LT_OQ), high = _mm256_cmp_ps(v, vkb, _CMP_GE_OQ);
            if (_mm256_movemask_ps(_mm256_or_ps(low, high)) == 0) continue;
            __m256 out = _mm256_blendv_ps(_mm256_loadu_ps(yp), _mm256_add_ps(_mm256_mul_ps(vah, v), vbh), high);
            out = _mm256_blendv_ps(out, _mm256_add_ps(_mm256_mul_ps(val, v), vbl), low);
            _mm256_storeu_ps(yp, out);
        }
    }
#endif
    for (; j < w; j++) {
        if (!stretches[j]) continue;
        for (int64_t p = 0; p < positions; p++) {
            const float v = a->x[p * C + c0 + j] * r.ps[j] + r.pb[j];
            if (v < r.k1[j]) a->y[p * C + c0 + j] = line[0][j] * v + line[1][j];
            else if (v >= r.kb[j]) a->y[p * C + c0 + j] = line[2][j] * v + line[3][j];
        }
    }
}

static void stream_scan_rows_part(void *p, int part, int64_t c0, int64_t c1) {
    (void)part;
    for (int64_t c = c0; c < c1; c += STREAM_ROWS_BLOCK)
        stream_scan_rows_block((const stream_scan_args *)p, c, c + STREAM_ROWS_BLOCK < c1 ? STREAM_ROWS_BLOCK : c1 - c);
}

static int stream_scan(const float *x, float *y, int64_t A, int64_t C, int64_t B, int64_t N,
                       const float *pre_scale, const float *pre_shift, int64_t K, const float *kn,
                       const float *sq, const float *pairs, int64_t G, const float *glo, const float *ginv,
                       int64_t stride, int64_t GC, int32_t *counts, float *lo, float *hi, int mode, int nthreads) {
    if (!stream_sizes_ok(C, K, G, GC) || A < 1 || B < 1 || N < 1 || A % N || stride < 1 ||
        A > INT64_MAX / C / B || mode < 0 ||
        mode > (STREAM_MAP | STREAM_COUNT | STREAM_IMAGE_COUNT | STREAM_PAIRED | STREAM_ROWS) ||
        ((mode & STREAM_ROWS) && C > INT32_MAX / (G + 2)) || /* stream_scan_rows_block's int32 pair indices */
        ((mode & STREAM_COUNT) && (mode & STREAM_IMAGE_COUNT)) ||
        ((mode & STREAM_PAIRED) && !(mode & STREAM_IMAGE_COUNT)) ||
        !x || !kn || !sq || !pairs || !glo || !ginv || !lo || !hi || ((mode & STREAM_MAP) && !y) ||
        ((mode & (STREAM_COUNT | STREAM_IMAGE_COUNT)) && !counts))
        return STREAM_BAD_ARGUMENT;
    int32_t *bad = malloc(sizeof(int32_t) * (size_t)C);
    if (!bad) return STREAM_NO_MEMORY;
    stream_scan_args a = {x, (mode & STREAM_MAP) ? y : NULL, A, C, B, N, K, G, GC, stride, pre_scale, pre_shift,
                   kn, sq, pairs, glo, ginv, counts, lo, hi, mode, bad};
    parallel_for((mode & STREAM_ROWS) ? stream_scan_rows_part : stream_scan_part, &a, C,
                 stream_parts(C, A * C * B, nthreads));
    int status = STREAM_OK;
    for (int64_t c = 0; c < C; c++) status = bad[c] ? STREAM_NONFINITE : status;
    free(bad);
    return status;
}

/* ------------------------------------------------------------------------------------------------
 * The tail window: per channel, the last W images' minima in arrival order (ring_lo (W, C), row
 * head the oldest once full) and ascending (sorted_lo (C, W)); maxima likewise, negated in
 * sorted_hi so the most extreme come first in both. */

/* How many of row[0..len) (ascending) lie below x (at_most: at or below it), by halving without
   branches on the data; 0 for NaN. */
static inline int64_t stream_rank(const float *row, int64_t len, float x, int at_most) {
    if (len <= 0) return 0;
    const float *base = row;
    for (int64_t n = len; n > 1;) {
        const int64_t half = n / 2;
        base = (at_most ? base[half] <= x : base[half] < x) ? base + half : base;
        n -= half;
    }
    return (base - row) + (at_most ? *base <= x : *base < x);
}

/* Rows up to this long are ranked by counting (AVX2 compares over the row instead of a chain of dependent
   loads); longer ones by halving, whose cost grows with the log of the length. On an ascending row both
   give the same ranks. */
enum { STREAM_COUNT_RANK_MAX = 512 };

/* stream_rank(row, len, old, 0) and stream_rank(row, len, v, 1), counted (the same on an ascending row;
   on a row out of order, other ranks, which the caller clamps). */
static inline void stream_count_ranks(const float *row, int64_t len, float old, float v, int64_t *below_old,
                                      int64_t *upto_v) {
    int64_t a = 0, b = 0, i = 0;
#ifdef __AVX2__
    const __m256 vo = _mm256_set1_ps(old), vv = _mm256_set1_ps(v);
    for (; i + 8 <= len; i += 8) {
        const __m256 r = _mm256_loadu_ps(row + i);
        a += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(r, vo, _CMP_LT_OQ)));
        b += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(r, vv, _CMP_LE_OQ)));
    }
#endif
    for (; i < len; i++) {
        a += row[i] < old;
        b += row[i] <= v;
    }
    *below_old = a;
    *upto_v = b;
}

/* row[0..len) ascending: remove one copy of old (the entry found where old would go: a window
   whose copies disagree loses its nearest entry instead, never a size), then insert v after the
   entries equal to it; the entries between the two places move by one, in one move. */
static void stream_sorted_replace(float *row, int64_t len, int remove, float old, float v) {
    if (!remove || len <= 0) {
        const int64_t at = stream_rank(row, len, v, 1);
        memmove(row + at + 1, row + at, sizeof(float) * (size_t)(len - at));
        row[at] = v;
        return;
    }
    int64_t gone, at;
    if (len <= STREAM_COUNT_RANK_MAX) {
        stream_count_ranks(row, len, old, v, &gone, &at);
    } else {
        gone = stream_rank(row, len, old, 0);
        at = stream_rank(row, len, v, 1);
    }
    if (gone >= len) gone = len - 1;
    /* where v goes among the entries left: those at or below it, less the one removed if it was */
    at -= row[gone] <= v;
    at = at < 0 ? 0 : (at > len - 1 ? len - 1 : at); /* in bounds even where the row is out of order */
    if (at <= gone) memmove(row + at + 1, row + at, sizeof(float) * (size_t)(gone - at));
    else memmove(row + gone, row + gone + 1, sizeof(float) * (size_t)(at - gone));
    row[at] = v;
}

typedef struct {
    int64_t C, bins, W, N, filled, head;
    int32_t *pending;
    const int32_t *counts;
    float *gmin, *gmax;
    const float *lo, *hi;
    float *ring_lo, *sorted_lo, *ring_hi, *sorted_hi;
    float *scratch; /* per part: stream_push_scratch_floats, or NULL: one image at a time */
} stream_push_args;

/* A batch of at least this many images (and at most W) enters the sorted window in one merge per
   channel, O(W + N log N), instead of N binary searches and moves, O(N W). */
enum { STREAM_PUSH_MERGE_MIN = 4 };

static int64_t stream_push_scratch_floats(int64_t W, int64_t N) { return 2 * N + 2 * (W + N); }

/* stream_sort_<name>(v, n): v[0..n) of T ascending, insertion sort for a few values (a batch's, the
   knots of a handful of groups), else qsort; a NaN (never from these kernels) leaves the order
   unspecified but the values in place. */
#define STREAM_SORT(name, T)                                                \
    static int stream_cmp_##name(const void *x, const void *y) {            \
        const T a = *(const T *)x, b = *(const T *)y;                       \
        return (a > b) - (a < b);                                           \
    }                                                                       \
    static void stream_sort_##name(T *v, int64_t n) {                       \
        if (n > 64) {                                                       \
            qsort(v, (size_t)n, sizeof(T), stream_cmp_##name);              \
            return;                                                         \
        }                                                                   \
        for (int64_t i = 1; i < n; i++) {                                   \
            const T x = v[i];                                               \
            int64_t j = i;                                                  \
            for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];             \
            v[j] = x;                                                       \
        }                                                                   \
    }
STREAM_SORT(floats, float)
STREAM_SORT(doubles, double)

/* out = row (len, ascending) less one copy of each of rem (r, ascending) plus ins (m, ascending),
   ascending, each inserted value after the entries equal to it, as stream_sorted_replace leaves
   them one by one (the same multiset; equal entries are equal values). Returns the length
   (len - r + m), or -1 when some value of rem is not in row (a window whose copies disagree: the
   caller replaces one by one). out holds len + m floats. */
static int64_t stream_sorted_batch(const float *row, int64_t len, const float *rem, int64_t r, const float *ins,
                                   int64_t m, float *out) {
    int64_t j = 0, k = 0, o = 0;
    for (int64_t i = 0; i < len; i++) {
        const float s = row[i];
        if (j < r && s == rem[j]) {
            j++;
            continue;
        }
        if (j < r && !(rem[j] > s)) return -1; /* rem[j] below s (or NaN): not in row */
        while (k < m && ins[k] < s) out[o++] = ins[k++];
        out[o++] = s;
    }
    if (j < r) return -1;
    while (k < m) out[o++] = ins[k++];
    return o;
}

/* One channel's sorted copies take the batch in one merge per side (see STREAM_PUSH_MERGE_MIN),
   reading the ring before the caller overwrites it; 0 (nothing changed) when the ring and the
   sorted copies disagree. */
static int stream_push_merged(const stream_push_args *a, int64_t c, float *mem) {
    const int64_t C = a->C, W = a->W, N = a->N, filled = a->filled;
    float *rem = mem, *ins = mem + N, *out_lo = mem + 2 * N, *out_hi = out_lo + W + N;
    int64_t length = -1;
    for (int side = 0; side < 2; side++) {
        const float *ring = side ? a->ring_hi : a->ring_lo, *val = side ? a->hi : a->lo;
        const float sign = side ? -1.0f : 1.0f;
        int64_t r = 0;
        for (int64_t n = 0; n < N; n++) {
            ins[n] = sign * val[n * C + c];
            if (filled + n >= W) rem[r++] = sign * ring[((a->head + n) % W) * C + c];
        }
        stream_sort_floats(ins, N);
        stream_sort_floats(rem, r);
        length = stream_sorted_batch((side ? a->sorted_hi : a->sorted_lo) + c * W, filled, rem, r, ins, N,
                                     side ? out_hi : out_lo);
        if (length != (filled + N < W ? filled + N : W)) return 0;
    }
    memcpy(a->sorted_lo + c * W, out_lo, sizeof(float) * (size_t)length);
    memcpy(a->sorted_hi + c * W, out_hi, sizeof(float) * (size_t)length);
    return 1;
}

static void stream_push_part(void *p, int part, int64_t c0, int64_t c1) {
    const stream_push_args *a = (const stream_push_args *)p;
    const int64_t C = a->C, W = a->W;
    float *mem = a->scratch ? a->scratch + part * stream_push_scratch_floats(W, a->N) : NULL;
    for (int64_t c = c0; c < c1; c++) {
        if (a->counts) {
            for (int64_t j = 0; j < a->bins; j++) a->pending[c * a->bins + j] += a->counts[c * a->bins + j];
        }
        const int merged = mem && stream_push_merged(a, c, mem);
        int64_t filled = a->filled;
        for (int64_t n = 0; n < a->N; n++) {
            const int64_t row = (a->head + n) % W;
            const float l = a->lo[n * C + c], h = a->hi[n * C + c];
            if (a->gmin) {
                a->gmin[c] = l < a->gmin[c] ? l : a->gmin[c];
                a->gmax[c] = h > a->gmax[c] ? h : a->gmax[c];
            }
            const int full = filled >= W;
            if (!merged) {
                stream_sorted_replace(a->sorted_lo + c * W, full ? W : filled, full, a->ring_lo[row * C + c], l);
                stream_sorted_replace(a->sorted_hi + c * W, full ? W : filled, full, -a->ring_hi[row * C + c], -h);
            }
            a->ring_lo[row * C + c] = l;
            a->ring_hi[row * C + c] = h;
            if (!full) filled++;
        }
    }
}

/* A finite batch into the state: pending (C, bins) += counts (unless NULL), the group's extremes
   gmin / gmax (C) (unless NULL) and the window take each image's extremes lo / hi (N, C), in order.
   filled and head describe the window before the batch; the caller advances them. */
static int stream_push(int64_t C, int64_t bins, int64_t W, int32_t *pending, const int32_t *counts, float *gmin,
                       float *gmax, const float *lo, const float *hi, int64_t N, float *ring_lo, float *sorted_lo,
                       float *ring_hi, float *sorted_hi, int64_t filled, int64_t head, int nthreads) {
    if (C < 1 || W < 1 || N < 0 || filled < 0 || filled > W || head < 0 || head >= W || (filled < W && head != filled) ||
        bins < 0 || (counts && (!pending || bins < 1)) || !gmin != !gmax || (N > 0 && (!lo || !hi)) || !ring_lo || !sorted_lo ||
        !ring_hi || !sorted_hi || C > INT64_MAX / W / 8 || (bins && C > INT64_MAX / bins / 8))
        return STREAM_BAD_ARGUMENT;
    const int parts = stream_parts(C, C * W * (N + 1), nthreads);
    float *scratch = NULL; /* the merge's; without it (too few images, too many, no memory) one by one */
    if (N >= STREAM_PUSH_MERGE_MIN && N <= W)
        scratch = malloc(sizeof(float) * (size_t)(parts * stream_push_scratch_floats(W, N)));
    stream_push_args a = {C, bins, W, N, filled, head, pending, counts, gmin, gmax, lo, hi, ring_lo, sorted_lo, ring_hi,
                   sorted_hi, scratch};
    parallel_for(stream_push_part, &a, C, parts);
    free(scratch);
    return STREAM_OK;
}

/* p0 / p100 (C): sum over i < k of w[i] times the window's i-th smallest minimum (largest maximum). */
int aqr_stream_tails(int64_t C, int64_t W, const float *sorted_lo, const float *sorted_hi, const double *w,
                     int64_t k, float *p0, float *p100) {
    if (C < 1 || W < 1 || k < 1 || k > W) return STREAM_BAD_ARGUMENT;
    for (int64_t c = 0; c < C; c++) {
        double low = 0, high = 0;
        for (int64_t i = 0; i < k; i++) {
            low += w[i] * (double)sorted_lo[c * W + i];
            high += w[i] * (double)sorted_hi[c * W + i];
        }
        p0[c] = stream_float(low);
        p100[c] = stream_float(-high);
    }
    return STREAM_OK;
}

/* ------------------------------------------------------------------------------------------------
 * The EMA of CDFs. A piecewise-linear CDF is given by points (z[i], h[i]), z and h nondecreasing:
 * between points it is linear, points sharing a z make an atom. F(z-) and F(z) at any z, given
 * lt = #points below z and le = #points at or below it: */
static void stream_cdf_at(const double *z, const double *h, int64_t n, double v, int64_t lt, int64_t le, double *left,
                   double *right) {
    if (lt < le) { /* v is a point: no interpolation */
        *left = lt == 0 ? 0.0 : h[lt];
        *right = h[le - 1];
        return;
    }
    double f;
    if (lt == 0) f = 0.0;
    else if (lt >= n) f = 1.0;
    else { /* z[lt - 1] < v < z[lt] */
        double run = z[lt] - z[lt - 1];
        double t = run > 0 ? (v - z[lt - 1]) / run : 1.0;
        t = t < 0 ? 0 : (t > 1 ? 1 : t);
        f = h[lt - 1] + t * (h[lt] - h[lt - 1]);
    }
    *left = *right = f;
}

/* The quantile curve's step from (zp, hp) to the breakpoint v, where the CDF is hl just left of v and
   hr at it: out[t..] for the levels from t on that it reaches (the rising segment, then the atom at
   v); returns the first level left for later. */
static inline int64_t stream_emit_levels(const double *levels, int64_t K, int64_t t, double zp, double hp, double v,
                                         double hl, double hr, float *out) {
    for (; t < K - 1; t++) { /* levels on the rising segment (zp, hp) -> (v, hl) */
        const double u = levels[t];
        if (u > hl) break;
        double f = hl > hp ? (u - hp) / (hl - hp) : 1.0;
        f = f < 0 ? 0 : (f > 1 ? 1 : f);
        double q = zp + f * (v - zp);
        out[t] = stream_float(q < zp ? zp : (q > v ? v : q));
    }
    for (; t < K - 1; t++) { /* levels inside the atom at v */
        if (levels[t] > hr) break;
        out[t] = stream_float(v);
    }
    return t;
}

/* out[1..K-2] = the quantiles at levels j / (K - 1) of (1 - w) F_a + w F_b; exact for these
   piecewise-linear CDFs (their breakpoints are the union of the points; atoms are kept). The
   mixture's quantile curve passes through (z, H(z-)) and (z, H(z)) at every breakpoint z and is
   linear between breakpoints; one merge of the two point lists walks it. O(na + nb + K). levels (K): j / (K - 1). */
static void stream_mix_quantiles(const double *za, const double *ha, int64_t na, const double *zb, const double *hb,
                          int64_t nb, double w, int64_t K, const double *levels, float *out) {
    int64_t a_lt = 0, a_le = 0, b_lt = 0, b_le = 0, t = 1;
    double zp = 0, hp = 0;
    int first = 1;
    while ((a_le < na || b_le < nb) && t < K - 1) {
        const double v = (b_le >= nb || (a_le < na && za[a_le] <= zb[b_le])) ? za[a_le] : zb[b_le];
        const int64_t a_was = a_le, b_was = b_le;
        while (a_lt < na && za[a_lt] < v) a_lt++;
        while (a_le < na && za[a_le] <= v) a_le++;
        while (b_lt < nb && zb[b_lt] < v) b_lt++;
        while (b_le < nb && zb[b_le] <= v) b_le++;
        if (a_le == a_was && b_le == b_was) { /* a NaN point (never from these kernels): step over it */
            if (a_le < na) a_le++;
            else b_le++;
        }
        if (a_lt > a_le) a_lt = a_le; /* unsorted points (never from these kernels): stay consistent */
        if (b_lt > b_le) b_lt = b_le;
        double fal, far, fbl, fbr;
        stream_cdf_at(za, ha, na, v, a_lt, a_le, &fal, &far);
        stream_cdf_at(zb, hb, nb, v, b_lt, b_le, &fbl, &fbr);
        double hl = (1 - w) * fal + w * fbl, hr = (1 - w) * far + w * fbr;
        if (first) zp = v, hp = 0, first = 0;
        hl = hl < hp ? hp : hl; /* rounding must not make the curve go down */
        hr = hr < hl ? hl : hr;
        t = stream_emit_levels(levels, K, t, zp, hp, v, hl, hr, out);
        zp = v, hp = hr;
    }
    for (; t < K - 1; t++) out[t] = stream_float(zp); /* rounding left the top levels unreached */
}

/* A piecewise-linear CDF's points (z, h) (n of them) as distinct breakpoints: bz ascending, bl = F(z-)
   (h at the first point at z; 0 at the first breakpoint), br = F(z) (h at the last); the values
   stream_cdf_at gives at a point. Returns their number, or -1 when z is not ascending or not finite
   (the caller then walks the points themselves). */
static int64_t stream_breakpoints(const double *z, const double *h, int64_t n, double *bz, double *bl, double *br) {
    int64_t d = 0;
    for (int64_t i = 0; i < n;) {
        const double v = z[i];
        if (!(v > -INFINITY && v < INFINITY)) return -1;
        int64_t e = i + 1;
        while (e < n && z[e] == v) e++;
        if (e < n && !(z[e] > v)) return -1;
        bz[d] = v, bl[d] = i == 0 ? 0.0 : h[i], br[d] = h[e - 1];
        d++;
        i = e;
    }
    return d;
}

/* F at v strictly between breakpoints i - 1 and i (i = how many lie below v) of a CDF given as
   stream_breakpoints' (z, l, r) (n): stream_cdf_at's interpolation, operation for operation. */
static inline double stream_breakpoint_cdf(const double *z, const double *l, const double *r, int64_t n, int64_t i,
                                           double v) {
    if (i == 0) return 0.0;
    if (i >= n) return 1.0;
    const double run = z[i] - z[i - 1];
    double t = run > 0 ? (v - z[i - 1]) / run : 1.0;
    t = t < 0 ? 0 : (t > 1 ? 1 : t);
    return r[i - 1] + t * (l[i] - r[i - 1]);
}

/* stream_mix_quantiles of two CDFs given as breakpoints (stream_breakpoints): the same walk, the
   same values, with one breakpoint per step instead of four searches and two lookups. */
static void stream_mix_breakpoints(const double *az, const double *al, const double *ar, int64_t na, const double *bz,
                                   const double *bl, const double *br, int64_t nb, double w, int64_t K,
                                   const double *levels, float *out) {
    int64_t i = 0, j = 0, t = 1;
    double zp = 0, hp = 0;
    int first = 1;
    while ((i < na || j < nb) && t < K - 1) {
        const double za = i < na ? az[i] : INFINITY, zb = j < nb ? bz[j] : INFINITY;
        const int on_a = za <= zb, on_b = zb <= za;
        const double v = on_a ? za : zb;
        double fal, far, fbl, fbr;
        if (on_a) fal = al[i], far = ar[i];
        else fal = far = stream_breakpoint_cdf(az, al, ar, na, i, v);
        if (on_b) fbl = bl[j], fbr = br[j];
        else fbl = fbr = stream_breakpoint_cdf(bz, bl, br, nb, j, v);
        double hl = (1 - w) * fal + w * fbl, hr = (1 - w) * far + w * fbr;
        if (first) zp = v, hp = 0, first = 0;
        hl = hl < hp ? hp : hl;
        hr = hr < hl ? hl : hr;
        t = stream_emit_levels(levels, K, t, zp, hp, v, hl, hr, out);
        zp = v, hp = hr;
        i += on_a, j += on_b;
    }
    for (; t < K - 1; t++) out[t] = stream_float(zp);
}

/* The piecewise-linear CDF of a histogram cnt (GC + 4) taken on the bins of the knots k (K) (the
   layout of aqr_stream_scan's counts) over total counts, whose values span gmin / gmax: its points
   (zb, hb) (GC + 5 of them, returned): each bin's edges at their cumulative shares, the outer ends
   at the extremes (or the knots' ends, where those lie further out). */
static int64_t stream_histogram_points(const float *k, int64_t K, const int32_t *cnt, int64_t GC, float gmin,
                                       float gmax, double total, double *zb, double *hb) {
    const double k0 = k[0], k1 = k[1], kb = k[K - 2], kl = k[K - 1];
    const double lo = gmin < k0 ? gmin : k0, hi = gmax > kl ? gmax : kl;
    /* the cumulative counts first, in integers: every partial sum is below 2^53, so these are the sums
       in double, exactly; then the shares and the cells' edges, each point on its own */
    int64_t cum = 0;
    hb[0] = 0.0;
    for (int64_t j = 0; j < GC + 3; j++) {
        cum += cnt[j] > 0 ? cnt[j] : 0;
        hb[j + 1] = (double)cum;
    }
    zb[0] = lo, zb[1] = k0, zb[2] = k1;
    const double span = kb - k1, cells = (double)GC;
    int64_t g = 1;
#ifdef __AVX2__
    {
        const __m256d vk1 = _mm256_set1_pd(k1), vspan = _mm256_set1_pd(span), vcells = _mm256_set1_pd(cells);
        const __m256d four = _mm256_set1_pd(4.0);
        __m256d vg = _mm256_setr_pd(1.0, 2.0, 3.0, 4.0);
        for (; g + 4 <= GC; g += 4, vg = _mm256_add_pd(vg, four))
            _mm256_storeu_pd(zb + 2 + g, _mm256_add_pd(vk1, _mm256_div_pd(_mm256_mul_pd(vspan, vg), vcells)));
    }
#endif
    for (; g < GC; g++) zb[2 + g] = k1 + span * (double)g / cells;
    zb[GC + 2] = kb, zb[GC + 3] = kl, zb[GC + 4] = hi;
    int64_t j = 1;
#ifdef __AVX2__
    {
        const __m256d vtotal = _mm256_set1_pd(total);
        for (; j + 4 <= GC + 4; j += 4) _mm256_storeu_pd(hb + j, _mm256_div_pd(_mm256_loadu_pd(hb + j), vtotal));
    }
#endif
    for (; j < GC + 4; j++) hb[j] = hb[j] / total;
    hb[GC + 4] = 1.0;
    return GC + 5;
}

typedef struct {
    int64_t C, K, GC;
    float *kn;
    const int32_t *counts;
    const float *gmin, *gmax, *p0, *p100;
    double w;
    char *scratch; /* per part: stream_merge_scratch_bytes */
} stream_merge_args;

static int64_t stream_merge_scratch_bytes(int64_t K, int64_t GC) {
    return (int64_t)sizeof(double) * (2 * K + 2 * (GC + STREAM_EDGE_BINS + 2) + 2 * K + 3 * (GC + STREAM_EDGE_BINS + 2)) +
           (int64_t)sizeof(float) * K;
}

/* k (K), in place: the inner knots become the quantiles of (1 - w) F_k + w F_hist, F_hist the
   histogram cnt (GC + 4) taken on the bins of the knots bk (K) (k itself for the stream, the
   layer's knots for a group) and spread out to its extremes gmin / gmax; unchanged when cnt holds
   nothing. mem: stream_merge_scratch_bytes(K, GC), its first K doubles the levels j / (K - 1)
   (stream_merge_levels). The ends are the caller's. */
static void stream_merge_histogram(float *k, const float *bk, int64_t K, const int32_t *cnt, int64_t GC, float gmin,
                                   float gmax, double w, char *mem) {
    const int64_t bins = GC + STREAM_EDGE_BINS;
    int64_t counted = 0; /* below 2^53: the sum in double, exactly */
    for (int64_t j = 0; j < bins; j++) counted += cnt[j] > 0 ? cnt[j] : 0;
    const double total = (double)counted;
    if (!(total > 0)) return;
    const double *ha = (const double *)mem;
    double *za = (double *)mem + K, *zb = za + K, *hb = zb + bins + 2;
    double *al = hb + bins + 2, *ar = al + K, *cz = ar + K, *cl = cz + bins + 2, *cr = cl + bins + 2;
    float *fresh = (float *)(cr + bins + 2);
    for (int64_t j = 0; j < K; j++) za[j] = k[j];
    const int64_t nb = stream_histogram_points(bk, K, cnt, GC, gmin, gmax, total, zb, hb);
    /* the knots are their own breakpoints when strictly ascending (their levels start at 0) */
    int ascending = za[0] > -INFINITY && za[K - 1] < INFINITY;
    for (int64_t j = 1; j < K; j++) ascending &= za[j] > za[j - 1];
    const int64_t da = ascending ? K : stream_breakpoints(za, ha, K, za, al, ar);
    const int64_t db = stream_breakpoints(zb, hb, nb, cz, cl, cr);
    if (da >= 0 && db >= 0)
        stream_mix_breakpoints(za, ascending ? ha : al, ascending ? ha : ar, da, cz, cl, cr, db, w, K, ha, fresh);
    else {
        for (int64_t j = 0; j < K; j++) za[j] = k[j]; /* stream_breakpoints may have written over them */
        stream_mix_quantiles(za, ha, K, zb, hb, nb, w, K, ha, fresh);
    }
    for (int64_t j = 1; j < K - 1; j++) k[j] = fresh[j];
}

/* The levels j / (K - 1) into the first K doubles of a merge's scratch mem (once per part). */
static char *stream_merge_levels(char *mem, int64_t K) {
    double *levels = (double *)mem;
    for (int64_t j = 0; j < K; j++) levels[j] = (double)j / (double)(K - 1);
    return mem;
}

/* k (K): the ends become lo / hi, each kept outside the inner knots. */
static inline void stream_set_ends(float *k, int64_t K, float lo, float hi) {
    k[0] = lo < k[1] ? lo : k[1];
    k[K - 1] = hi > k[K - 2] ? hi : k[K - 2];
}

static void stream_merge_part(void *p, int part, int64_t c0, int64_t c1) {
    const stream_merge_args *a = (const stream_merge_args *)p;
    const int64_t K = a->K, GC = a->GC;
    char *mem = stream_merge_levels(a->scratch + part * stream_merge_scratch_bytes(K, GC), K);
    for (int64_t c = c0; c < c1; c++) {
        float *k = a->kn + c * K;
        if (a->counts && a->w > 0)
            stream_merge_histogram(k, k, K, a->counts + c * (GC + STREAM_EDGE_BINS), GC, a->gmin[c], a->gmax[c], a->w,
                                   mem);
        stream_set_ends(k, K, a->p0[c], a->p100[c]);
    }
}

/* kn (C, K), in place: the inner knots become the quantiles of (1 - w) F_kn + w F_group, where
   F_group is the pending group's histogram counts (C, GC + 4) (taken on the bins of these knots,
   aqr_stream_scan) spread linearly within each bin, its outer bins out to its extremes gmin /
   gmax (C); a channel without counts keeps its inner knots. The ends become p0 / p100 (C), kept
   outside the inner knots. */
static int stream_merge(int64_t C, int64_t K, float *kn, const int32_t *counts, int64_t GC, const float *gmin,
                        const float *gmax, double w, const float *p0, const float *p100, int nthreads) {
    if (!stream_sizes_ok(C, K, 1, GC) || !(w >= 0 && w <= 1) || (counts && (!gmin || !gmax))) return STREAM_BAD_ARGUMENT;
    const int parts = stream_parts(C, C * (K + GC) * 16, nthreads);
    char *scratch = malloc((size_t)(parts * stream_merge_scratch_bytes(K, GC)));
    if (!scratch) return STREAM_NO_MEMORY;
    stream_merge_args a = {C, K, GC, kn, counts, gmin, gmax, p0, p100, w, scratch};
    parallel_for(stream_merge_part, &a, C, parts);
    free(scratch);
    return STREAM_OK;
}

/* ------------------------------------------------------------------------------------------------
 * target="robust" (aqr/adapt/stream/robust.py): per group of predicted classes, a running CDF.
 *
 * torch.lerp(a, b, w) as torch computes it (so both backends round alike). */
static inline double stream_lerp(double a, double b, double w) {
    return w < 0.5 ? a + w * (b - a) : b - (b - a) * (1.0 - w);
}

typedef struct {
    int64_t R, K, GC;
    float *gk;
    const float *bk, *gmin, *gmax;
    const int32_t *counts;
    const double *w;
    char *scratch; /* per part: stream_merge_scratch_bytes */
} stream_group_merge_args;

static void stream_group_merge_part(void *p, int part, int64_t r0, int64_t r1) {
    const stream_group_merge_args *a = (const stream_group_merge_args *)p;
    const int64_t K = a->K, GC = a->GC;
    char *mem = stream_merge_levels(a->scratch + part * stream_merge_scratch_bytes(K, GC), K);
    for (int64_t r = r0; r < r1; r++) {
        float *k = a->gk + r * K;
        const double w = a->w[r], old0 = k[0], oldl = k[K - 1];
        if (w == 0) continue; /* a row of weight 0 (a group without images) stays as it is */
        stream_merge_histogram(k, a->bk + r * K, K, a->counts + r * (GC + STREAM_EDGE_BINS), GC, a->gmin[r], a->gmax[r],
                               w, mem);
        /* the ends: the images' extremes, averaged like the CDF, each outside the inner knots */
        stream_set_ends(k, K, stream_float(stream_lerp(old0, a->gmin[r], w)),
                        stream_float(stream_lerp(oldl, a->gmax[r], w)));
    }
}

/* gk (R, K), in place, row by row: the inner knots become the quantiles of (1 - w[r]) F_gk + w[r]
   F_hist, F_hist the histogram counts (R, GC + 4) taken on the bins of the knots bk (R, K) (not
   gk's own: a group's images are counted on the layer's knots), spread linearly within each bin
   out to its extremes gmin / gmax (R); a row without counts keeps its inner knots. The ends move
   to gmin / gmax by w[r] (each kept outside the inner knots); a row of weight 0 is left as it is. */
static int stream_group_merge(int64_t R, int64_t K, float *gk, const float *bk, const int32_t *counts, int64_t GC,
                              const float *gmin, const float *gmax, const double *w, int nthreads) {
    if (!stream_sizes_ok(R, K, 1, GC) || R > INT64_MAX / K / 8 || !gk || !bk || !counts || !gmin || !gmax || !w)
        return STREAM_BAD_ARGUMENT;
    for (int64_t r = 0; r < R; r++)
        if (!(w[r] >= 0 && w[r] <= 1)) return STREAM_BAD_ARGUMENT;
    const int parts = stream_parts(R, R * (K + GC) * 16, nthreads);
    char *scratch = malloc((size_t)(parts * stream_merge_scratch_bytes(K, GC)));
    if (!scratch) return STREAM_NO_MEMORY;
    stream_group_merge_args a = {R, K, GC, gk, bk, gmin, gmax, counts, w, scratch};
    parallel_for(stream_group_merge_part, &a, R, parts);
    free(scratch);
    return STREAM_OK;
}

typedef struct {
    int64_t M, C, K, grid;
    const float *gk;
    const double *w; /* (M) weights, >= 0; NULL: all 1 */
    double total;    /* their sum, > 0 */
    float *kn;
    char *scratch; /* per part: stream_mixture_scratch_bytes */
} stream_mixture_args;

static int64_t stream_mixture_points(int64_t M, int64_t grid) { return grid + 4 * M; }

static int64_t stream_mixture_scratch_bytes(int64_t M, int64_t K, int64_t grid) {
    const int64_t n = stream_mixture_points(M, grid);
    return (int64_t)sizeof(double) * (3 * n + 2 * K + 2 * (2 * n + 1));
}

/* out (na + nb) = the ascending a (na) and b (nb) merged; an a that is not ascending (a grid from
   hi < lo) is sorted first. The sorted multiset is unique, so this equals sorting the union. */
static void stream_merge_sorted(double *a, int64_t na, const double *b, int64_t nb, double *out) {
    for (int64_t i = 1; i < na; i++)
        if (a[i] < a[i - 1]) {
            stream_sort_doubles(a, na);
            break;
        }
    int64_t i = 0, j = 0, o = 0;
    while (i < na && j < nb) out[o++] = b[j] < a[i] ? b[j++] : a[i++];
    while (i < na) out[o++] = a[i++];
    while (j < nb) out[o++] = b[j++];
}

/* out[1..K-2] = the inner quantiles (levels j / (K - 1)) of the CDF that is hl[i] just left of and
   hr[i] at each sorted breakpoint z[i] (n of them), linear in between (the quantile curve runs
   through (z, H(z-)) and (z, H(z))); pts / lev: scratch of 2 n + 1 doubles each. */
static void stream_curve_quantiles(const double *z, const double *hl, const double *hr, int64_t n, int64_t K,
                                   const double *levels, double *pts, double *lev, float *out) {
    const int64_t np = 2 * n + 1;
    pts[0] = z[0], lev[0] = 0.0;
    for (int64_t i = 0; i < n; i++) {
        pts[1 + 2 * i] = pts[2 + 2 * i] = z[i];
        lev[1 + 2 * i] = hl[i], lev[2 + 2 * i] = hr[i];
    }
    for (int64_t i = 1; i < np; i++) lev[i] = lev[i] < lev[i - 1] ? lev[i - 1] : lev[i]; /* never down */
    int64_t i = 0; /* the first point whose level is at least u (levels nondecreasing, u increasing) */
    for (int64_t t = 1; t < K - 1; t++) {
        const double u = levels[t];
        while (i < np && lev[i] < u) i++;
        if (i >= np) { /* rounding left the top levels unreached: the last point */
            out[t] = stream_float(pts[np - 1]);
            continue;
        }
        const int64_t j = i < 1 ? 1 : i;
        const double z0 = pts[j - 1], z1 = pts[j], h0 = lev[j - 1], h1 = lev[j], rise = h1 - h0;
        double f = rise > 0 ? (u - h0) / rise : 1.0;
        f = f < 0 ? 0 : (f > 1 ? 1 : f);
        double q = z0 + f * (z1 - z0);
        q = q < z0 ? z0 : (q > z1 ? z1 : q);
        out[t] = stream_float(q);
    }
}

static void stream_mixture_part(void *p, int part, int64_t c0, int64_t c1) {
    const stream_mixture_args *a = (const stream_mixture_args *)p;
    const int64_t M = a->M, C = a->C, K = a->K, grid = a->grid, n = stream_mixture_points(M, grid);
    double *z = (double *)(a->scratch + part * stream_mixture_scratch_bytes(M, K, grid));
    double *hl = z + n, *hr = hl + n, *gz = hr + n, *levels = gz + K, *pts = levels + K, *lev = pts + 2 * n + 1;
    for (int64_t j = 0; j < K; j++) levels[j] = (double)j / (double)(K - 1);
    for (int64_t c = c0; c < c1; c++) {
        double lo = INFINITY, hi = -INFINITY;
        for (int64_t g = 0; g < M; g++) {
            const float *k = a->gk + (g * C + c) * K;
            lo = k[1] < lo ? k[1] : lo;
            hi = k[K - 2] > hi ? k[K - 2] : hi;
        }
        /* the grid (ascending) into pts, the groups' end knots into lev, sorted, then both merged into z */
        for (int64_t i = 0; i < grid; i++) pts[i] = lo + (hi - lo) * ((double)i / (double)(grid - 1));
        for (int64_t g = 0; g < M; g++) {
            const float *k = a->gk + (g * C + c) * K;
            lev[4 * g] = k[0], lev[4 * g + 1] = k[1], lev[4 * g + 2] = k[K - 2], lev[4 * g + 3] = k[K - 1];
        }
        stream_sort_doubles(lev, 4 * M);
        stream_merge_sorted(pts, grid, lev, 4 * M, z);
        for (int64_t i = 0; i < n; i++) hl[i] = hr[i] = 0.0;
        for (int64_t g = 0; g < M; g++) { /* each group's CDF at every point, in one walk (both sorted) */
            const float *k = a->gk + (g * C + c) * K;
            const double wg = a->w ? a->w[g] : 1.0;
            for (int64_t j = 0; j < K; j++) gz[j] = k[j];
            int64_t lt = 0, le = 0;
            for (int64_t i = 0; i < n; i++) {
                while (lt < K && gz[lt] < z[i]) lt++;
                if (le < lt) le = lt;
                while (le < K && gz[le] <= z[i]) le++;
                double left, right;
                stream_cdf_at(gz, levels, K, z[i], lt, le, &left, &right);
                hl[i] += wg * left, hr[i] += wg * right;
            }
        }
        for (int64_t i = 0; i < n; i++) hl[i] /= a->total, hr[i] /= a->total; /* once: equal weights, the mean */
        stream_curve_quantiles(z, hl, hr, n, K, levels, pts, lev, a->kn + c * K);
    }
}

/* kn (C, K): the inner knots kn[:, 1..K-2] become the inner quantiles of the mixture, with weights w
   (M; NULL: equal; finite, >= 0, not all 0), of the M piecewise-linear CDFs through the group knots
   gk (M, C, K) (at levels j / (K - 1)), the mixture evaluated at grid points spread over [min of the
   groups' k1, max of their k_{K-2}] and at every group's first two and last two knots, linear in
   between; kn's ends are not touched. */
int aqr_stream_mixture(int64_t M, int64_t C, int64_t K, const float *gk, const double *w, int64_t grid, float *kn,
                       int nthreads) {
    if (!stream_sizes_ok(C, K, 1, 1) || M < 1 || M >= (1 << 20) || grid < 2 || grid >= (1 << 20) ||
        C > INT64_MAX / M / (K + grid) / 8 || !gk || !kn)
        return STREAM_BAD_ARGUMENT;
    for (int64_t i = 0; i < M * C * K; i++)
        if (stream_nonfinite(gk[i])) return STREAM_BAD_ARGUMENT;
    double total = 0.0;
    for (int64_t g = 0; g < M; g++) {
        const double wg = w ? w[g] : 1.0;
        if (!(wg >= 0 && wg <= 1e300)) return STREAM_BAD_ARGUMENT; /* NaN, Inf and negatives */
        total += wg;
    }
    if (!(total > 0 && total <= 1e300)) return STREAM_BAD_ARGUMENT;
    const int parts = stream_parts(C, C * M * (K + grid) * 4, nthreads);
    char *scratch = malloc((size_t)(parts * stream_mixture_scratch_bytes(M, K, grid)));
    if (!scratch) return STREAM_NO_MEMORY;
    stream_mixture_args a = {M, C, K, grid, gk, w, total, kn, scratch};
    parallel_for(stream_mixture_part, &a, C, parts);
    free(scratch);
    return STREAM_OK;
}

/* ------------------------------------------------------------------------------------------------
 * The lookup table of the map from knots kn onto sq (both (C, K)), as (slope, intercept) pairs
 * (C, G + 2, 2): cell 0 the line through (p0, s0) and (p1, s1), cells 1..G the exact piecewise-
 * linear map between G + 1 equally spaced points of [p1, p_{K-2}] (the lines between them), cell
 * G + 1 the line through (p_{K-2}, s_{K-2}) and (p_{K-1}, s_{K-1}). glo / ginv (C): the grid's
 * start and inverse width. */
typedef struct {
    int64_t C, K, G;
    const float *kn, *sq;
    float *pairs, *glo, *ginv;
    double *scratch; /* per part stream_tables_scratch_doubles */
} stream_tables_args;

/* A part's scratch: the grid points and the map there (2 (G + 1 + STREAM_GRID_PAD)), each knot interval's
   slope (K), and each knot's first grid point (K int32s, as doubles). */
enum { STREAM_GRID_PAD = 8 }; /* the vector writes of stream_grid_direct run up to this far past a range's end */
static int64_t stream_tables_scratch_doubles(int64_t K, int64_t G) {
    return 2 * (G + 1 + STREAM_GRID_PAD) + K + (K + 1) / 2;
}

/* The slope of the map on knot interval q, (s[q+1] - s[q]) / (k[q+1] - k[q]); 0 on an empty one. */
static inline double stream_rise(const float *k, const float *s, int64_t q) {
    const double run = (double)k[q + 1] - (double)k[q];
    return run > 0 ? ((double)s[q + 1] - (double)s[q]) / run : 0.0;
}

/* The grid points gx (G + 1) and the map's values yv there, by the walk over the knot intervals:
   q, the interval [k[q], k[q+1]) holding the grid point, moves on while the point is at or past k[q+1]. */
static void stream_grid_walk(const float *k, const float *s, int64_t K, int64_t G, double lo, double width,
                             double *gxs, double *yvs) {
    int64_t q = 1;
    double rise = K > 3 ? stream_rise(k, s, 1) : 0.0;
    gxs[0] = lo, yvs[0] = s[1];
    for (int64_t g = 1; g <= G; g++) {
        const double gx = g == G ? (double)k[K - 2] : lo + width * (double)g;
        int moved = 0;
        while (q < K - 2 && gx >= (double)k[q + 1]) q++, moved = 1;
        if (moved && q < K - 2) rise = stream_rise(k, s, q);
        gxs[g] = gx;
        yvs[g] = q >= K - 2 ? (double)s[K - 2] : (double)s[q] + (gx - (double)k[q]) * rise;
    }
}

/* yv[g] = s + (gx[g] - k) * rise for g in [g0, g1), four at a time in eight-wide steps: writes reach up to
   STREAM_GRID_PAD - 1 values past g1 (the caller's later ranges, or the padding, take them). */
static inline void stream_grid_line(const double *gxs, double *yvs, int64_t g0, int64_t g1, double s, double k,
                                    double rise) {
#ifdef __AVX2__
    const __m256d vs = _mm256_set1_pd(s), vk = _mm256_set1_pd(k), vr = _mm256_set1_pd(rise);
    int64_t g = g0;
    do { /* most knot intervals hold at most eight grid points: one step, no branch to mispredict */
        _mm256_storeu_pd(yvs + g, _mm256_add_pd(vs, _mm256_mul_pd(_mm256_sub_pd(_mm256_loadu_pd(gxs + g), vk), vr)));
        _mm256_storeu_pd(yvs + g + 4,
                         _mm256_add_pd(vs, _mm256_mul_pd(_mm256_sub_pd(_mm256_loadu_pd(gxs + g + 4), vk), vr)));
        g += 8;
    } while (g < g1);
#else
    for (int64_t g = g0; g < g1; g++) yvs[g] = s + (gxs[g] - k) * rise;
#endif
}

/* stream_grid_walk's values without the walk, where the knots k[2..K-2] and the grid points ascend
   (every table the stream builds): grid point g lies in interval q(g) = 1 + #{j in [2, K-2]: k[j] <= gx[g]},
   which is where the walk stops (it moves on exactly past the knots at or below the point), so each
   knot's first grid point is found on its own, and each interval's values follow from its slope over
   its range of grid points, without a chain of comparisons. Returns 0 (nothing usable written) where
   they do not ascend. gxs and yvs: G + 1 + STREAM_GRID_PAD each. */
static int stream_grid_direct(const float *k, const float *s, int64_t K, int64_t G, double lo, double width,
                              double inv, double *gxs, double *yvs, double *rise, int32_t *first) {
    if (!(width > 0)) return 0;
    for (int64_t j = 3; j <= K - 2; j++)
        if (!(k[j] >= k[j - 1])) return 0;
    gxs[0] = lo, yvs[0] = s[1];
    int64_t g = 1;
#ifdef __AVX2__
    { /* (double)g exactly, then the same multiply and add as below */
        const __m256d vlo = _mm256_set1_pd(lo), vw = _mm256_set1_pd(width), four = _mm256_set1_pd(4.0);
        __m256d vg = _mm256_setr_pd(1.0, 2.0, 3.0, 4.0);
        for (; g + 4 <= G; g += 4, vg = _mm256_add_pd(vg, four))
            _mm256_storeu_pd(gxs + g, _mm256_add_pd(vlo, _mm256_mul_pd(vw, vg)));
    }
#endif
    for (; g < G; g++) gxs[g] = lo + width * (double)g;
    gxs[G] = k[K - 2];
    if (G > 1 && !(gxs[G] >= gxs[G - 1])) return 0; /* lo + width * g ascends by itself: rounding is monotone */
    for (int64_t p = G + 1; p < G + 1 + STREAM_GRID_PAD; p++) gxs[p] = gxs[G]; /* read, never used */
    rise[1] = 0.0; /* read (and not used) at the top when K is 3 */
    for (int64_t q = 1; q < K - 2; q++) rise[q] = stream_rise(k, s, q);
    first[1] = 1;
    for (int64_t j = 2; j <= K - 2; j++) { /* the first g in [1, G] with gx[g] >= k[j] (G + 1: none) */
        const double kj = k[j];
        const double guess = (kj - lo) * inv;
        int64_t e = guess > 0 ? (guess < (double)G ? (int64_t)guess + 1 : G) : 1; /* the point above the guess */
        while (e > 1 && gxs[e - 1] >= kj) e--;
        while (e <= G && gxs[e] < kj) e++;
        first[j] = (int32_t)e;
    }
    /* interval q (1 <= q <= K - 3) holds the grid points [first[q], first[q + 1]) (first[1] = 1), the top
       those from first[K - 2] on; ranges ascend, so each range's overhanging writes fall in a later range */
    for (int64_t q = 1; q < K - 2; q++)
        if (first[q + 1] > first[q])
            stream_grid_line(gxs, yvs, first[q], first[q + 1], (double)s[q], (double)k[q], rise[q]);
    const double top = s[K - 2];
    for (int64_t t = first[K - 2]; t <= G; t++) yvs[t] = top;
    return 1;
}

#ifdef AQR_WIDE_LOOKUP
/* stream_float4 of eight doubles. */
AQR_WIDE static inline __m256 stream_float8(__m512d v) {
    const __mmask8 nan = _mm512_cmp_pd_mask(v, v, _CMP_UNORD_Q);
    v = _mm512_max_pd(_mm512_min_pd(v, _mm512_set1_pd(FLT_MAX)), _mm512_set1_pd(-FLT_MAX));
    return _mm512_cvtpd_ps(_mm512_maskz_mov_pd((__mmask8)~nan, v));
}

/* The cells' lines of stream_tables_part eight at a time (where the lookups are AVX-512's): the same double
   operations and roundings, the pairs interleaved by one permute. Returns the first cell left. */
AQR_WIDE static int64_t stream_cells_wide(const double *gxs, const double *yvs, int64_t G, double inv, float *tab) {
    const __m512d vinv = _mm512_set1_pd(inv);
    const __m512i pairs = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    int64_t g = 1;
    for (; g + 8 <= G + 1; g += 8) {
        const __m512d y1 = _mm512_loadu_pd(yvs + g), y0 = _mm512_loadu_pd(yvs + g - 1);
        const __m256 slope = stream_float8(_mm512_mul_pd(_mm512_sub_pd(y1, y0), vinv));
        const __m512d x0 = _mm512_loadu_pd(gxs + g - 1);
        const __m256 icpt = stream_float8(_mm512_sub_pd(y0, _mm512_mul_pd(_mm512_cvtps_pd(slope), x0)));
        _mm512_storeu_ps(tab + 2 * g, _mm512_permutex2var_ps(_mm512_castps256_ps512(slope), pairs,
                                                             _mm512_castps256_ps512(icpt)));
    }
    return g;
}
#endif

static void stream_tables_part(void *p, int part, int64_t c0, int64_t c1) {
    const stream_tables_args *a = (const stream_tables_args *)p;
    const int64_t K = a->K, G = a->G;
    double *gxs = a->scratch + (int64_t)part * stream_tables_scratch_doubles(K, G), *yvs = gxs + G + 1 + STREAM_GRID_PAD;
    double *rise = yvs + G + 1 + STREAM_GRID_PAD;
    int32_t *first = (int32_t *)(rise + K);
    for (int64_t c = c0; c < c1; c++) {
        const float *k = a->kn + c * K, *s = a->sq + c * K;
        float *tab = a->pairs + c * 2 * (G + 2);
        const double lo = k[1], span = (double)k[K - 2] - lo, width = span > 0 ? span / (double)G : 0.0;
        const double inv = width > 0 ? 1.0 / width : 0.0;
        a->glo[c] = k[1];
        a->ginv[c] = stream_float(inv);
        stream_line(k[0], s[0], k[1], s[1], s[1], &tab[0], &tab[1]);
        stream_line(k[K - 2], s[K - 2], k[K - 1], s[K - 1], s[K - 2], &tab[2 * (G + 1)], &tab[2 * (G + 1) + 1]);
        /* the grid points gx and the map's values yv there (through the knots), then each cell's line */
        if (!stream_grid_direct(k, s, K, G, lo, width, inv, gxs, yvs, rise, first))
            stream_grid_walk(k, s, K, G, lo, width, gxs, yvs);
        /* the cell's line through (gx[g-1], yv[g-1]) and (gx[g], yv[g]): slope by the inverse width (the
           last cell ends exactly at k[K-2], within rounding of a width) */
        if (width > 0) {
            int64_t g = 1;
#ifdef AQR_WIDE_LOOKUP
            if (aqr_wide_lookup) g = stream_cells_wide(gxs, yvs, G, inv, tab);
#endif
#ifdef __AVX2__
            /* four cells at a time, the same double operations and stream_float's rounding */
            const __m256d vinv = _mm256_set1_pd(inv);
            for (; g + 4 <= G + 1; g += 4) {
                const __m256d y1 = _mm256_loadu_pd(yvs + g), y0 = _mm256_loadu_pd(yvs + g - 1);
                const __m128 slope = stream_float4(_mm256_mul_pd(_mm256_sub_pd(y1, y0), vinv));
                const __m256d x0 = _mm256_loadu_pd(gxs + g - 1);
                const __m128 icpt = stream_float4(_mm256_sub_pd(y0, _mm256_mul_pd(_mm256_cvtps_pd(slope), x0)));
                _mm_storeu_ps(tab + 2 * g, _mm_unpacklo_ps(slope, icpt));
                _mm_storeu_ps(tab + 2 * g + 4, _mm_unpackhi_ps(slope, icpt));
            }
#endif
            for (; g <= G; g++) {
                const float slope = stream_float((yvs[g] - yvs[g - 1]) * inv);
                tab[2 * g] = slope;
                tab[2 * g + 1] = stream_float(yvs[g - 1] - (double)slope * gxs[g - 1]);
            }
        } else {
            for (int64_t g = 1; g <= G; g++) {
                tab[2 * g] = 0.0f;
                tab[2 * g + 1] = stream_float(yvs[g]);
            }
        }
    }
}

static int stream_tables(int64_t C, int64_t K, const float *kn, const float *sq, int64_t G, float *pairs, float *glo,
                         float *ginv, int nthreads) {
    if (!stream_sizes_ok(C, K, G, 1) || !kn || !sq || !pairs || !glo || !ginv) return STREAM_BAD_ARGUMENT;
    const int parts = stream_parts(C, C * G * 8, nthreads);
    double *scratch = malloc(sizeof(double) * (size_t)(stream_tables_scratch_doubles(K, G) * parts));
    if (!scratch) return STREAM_NO_MEMORY;
    stream_tables_args a = {C, K, G, kn, sq, pairs, glo, ginv, scratch};
    parallel_for(stream_tables_part, &a, C, parts);
    free(scratch);
    return STREAM_OK;
}

/* A batch of fewer than rebuild_every images committed: aqr_stream_push of counts and the images'
   extremes lo / hi (N, C) into the pending group (pending (C, GC + 4), gmin / gmax) and the window
   (filled and head before the batch); then, where rebuild, the knots kn (C, K) rebuilt: aqr_stream_tails
   of the window by tail_w (ntail, at most the window's images after the push), aqr_stream_merge of the
   group at weight with those ends, aqr_stream_tables onto sq, and the group cleared (counts 0, extremes
   +inf / -inf). The same operations as those calls one after the other, so the same values; sizes are
   checked before anything changes. */
static int stream_commit(int64_t C, int64_t K, int64_t GC, int64_t W, int64_t G, float *kn, const float *sq,
                         float *pairs, float *glo, float *ginv, int32_t *pending, float *gmin, float *gmax,
                         float *ring_lo, float *sorted_lo, float *ring_hi, float *sorted_hi, int64_t filled,
                         int64_t head, const int32_t *counts, const float *lo, const float *hi, int64_t N, int rebuild,
                         double weight, const double *tail_w, int64_t ntail, int nthreads) {
    if (!stream_sizes_ok(C, K, G, GC) || W < 1 || N < 1 || filled < 0 || filled > W || !kn || !sq || !pairs ||
        !glo || !ginv || !pending || !gmin || !gmax || !counts)
        return STREAM_BAD_ARGUMENT;
    const int64_t after = N > W - filled ? W : filled + N;
    if (rebuild && (!(weight >= 0 && weight <= 1) || !tail_w || ntail < 1 || ntail > after)) return STREAM_BAD_ARGUMENT;
    float *ends = rebuild ? malloc(sizeof(float) * (size_t)(2 * C)) : NULL;
    if (rebuild && !ends) return STREAM_NO_MEMORY;
    int status = stream_push(C, GC + STREAM_EDGE_BINS, W, pending, counts, gmin, gmax, lo, hi, N, ring_lo,
                             sorted_lo, ring_hi, sorted_hi, filled, head, nthreads);
    if (status == STREAM_OK && rebuild) {
        status = aqr_stream_tails(C, W, sorted_lo, sorted_hi, tail_w, ntail, ends, ends + C);
        if (status == STREAM_OK)
            status = stream_merge(C, K, kn, pending, GC, gmin, gmax, weight, ends, ends + C, nthreads);
        if (status == STREAM_OK) status = stream_tables(C, K, kn, sq, G, pairs, glo, ginv, nthreads);
        if (status == STREAM_OK) {
            memset(pending, 0, sizeof(int32_t) * (size_t)(C * (GC + STREAM_EDGE_BINS)));
            for (int64_t c = 0; c < C; c++) gmin[c] = INFINITY, gmax[c] = -INFINITY;
        }
    }
    free(ends);
    return status;
}

/* target="robust"'s shift test. Over the channels c whose even and whose odd images both counted
   something: the mean Kolmogorov distance between the histogram of the N images' counts
   (N, C, GC + 4, aqr_stream_scan's IMAGE_COUNT layout, negative counts read as 0) and the piecewise-
   linear CDF through the knots kn (C, K) at the bins' upper edges (p0, p1, the GC cells' edges up to
   p_{K-2}, p_{K-1}) into out[0], the mean distance between the even and the odd images' histograms
   there into out[1] (0 when no channel counted). Returns the number of channels counted; refuses
   non-finite knots. aqr_stream_shift_test also sums the images' counts into total (C, GC + 4), and
   copies them as int16 into small (N, C, GC + 4) (the caller's to know they fit), each unless NULL. */
static int stream_shift_test(int64_t N, int64_t C, int64_t K, const float *kn, const int32_t *counts, int64_t GC,
                             double *out, int32_t *total, int16_t *small) {
    if (N < 1 || N >= (1 << 30) || !stream_sizes_ok(C, K, 1, GC) || C > INT64_MAX / N / (GC + STREAM_EDGE_BINS) / 8 ||
        !kn || !counts || !out)
        return STREAM_BAD_ARGUMENT;
    for (int64_t j = 0; j < C * K; j++)
        if (stream_nonfinite(kn[j])) return STREAM_BAD_ARGUMENT;
    const int64_t bins = GC + STREAM_EDGE_BINS, plane = C * bins, edges = GC + 3;
    int64_t *acc = calloc((size_t)(2 * plane), sizeof(int64_t)); /* the even, then the odd images' sums */
    /* per channel, at each edge: the running sums, the edge, its knot interval's start, width and index */
    double *at = malloc(sizeof(double) * (size_t)(7 * edges));
    if (!acc || !at) {
        free(acc);
        free(at);
        return STREAM_NO_MEMORY;
    }
    double *sum_even = at, *sum_odd = at + edges, *edge_at = at + 2 * edges, *start = at + 3 * edges;
    double *width = at + 4 * edges, *below = at + 5 * edges, *share = at + 6 * edges;
    for (int64_t j = 0; j < edges; j++) share[j] = (double)(j - 1) / (double)GC; /* the cells' edges, every channel's */
    if (total) memset(total, 0, sizeof(int32_t) * (size_t)plane);
    for (int64_t i = 0; i < N; i++) { /* image by image, in memory order: the counts read once */
        const int32_t *row = counts + i * plane;
        int64_t *dst = acc + (i & 1) * plane;
        for (int64_t j = 0; j < plane; j++) dst[j] += row[j] > 0 ? row[j] : 0;
        if (small) /* the caller has checked that every count fits */
            for (int64_t j = 0; j < plane; j++) small[i * plane + j] = (int16_t)row[j];
        if (total) /* summed as they are (negatives too), wrapping as int32 does */
            for (int64_t j = 0; j < plane; j++) total[j] = (int32_t)((uint32_t)total[j] + (uint32_t)row[j]);
    }
    double to_target = 0, between = 0;
    int64_t counted = 0;
    for (int64_t c = 0; c < C; c++) {
        const int64_t *even = acc + c * bins, *odd = acc + plane + c * bins;
        double te = 0, to = 0;
        for (int64_t j = 0; j < bins; j++) te += (double)even[j], to += (double)odd[j];
        if (!(te > 0 && to > 0)) continue;
        const float *k = kn + c * K;
        const double k1 = k[1], kb = k[K - 2];
        double ce = 0, co = 0, d_target = 0, d_halves = 0;
        int64_t above = 0; /* knots at or below the edge (edges ascend with sorted knots) */
        for (int64_t j = 0; j < edges; j++) { /* the sums and the knots' intervals: one chain */
            ce += (double)even[j], co += (double)odd[j];
            const double edge = j == 0 ? (double)k[0] : j == 1 ? k1 : j == GC + 1 ? kb : j == GC + 2 ? (double)k[K - 1]
                              : k1 + (kb - k1) * share[j];
            while (above < K && (double)k[above] <= edge) above++;
            const int64_t q = above < 1 ? 1 : (above > K - 1 ? K - 1 : above);
            sum_even[j] = ce, sum_odd[j] = co, edge_at[j] = edge;
            start[j] = k[q - 1], width[j] = (double)k[q] - start[j], below[j] = (double)(q - 1);
        }
        int64_t j = 0;
#ifdef __AVX2__
        { /* the distances at four edges at a time: the same double operations, no chain between edges */
            const __m256d zero = _mm256_setzero_pd(), one = _mm256_set1_pd(1.0), sign = _mm256_set1_pd(-0.0);
            const __m256d vte = _mm256_set1_pd(te), vto = _mm256_set1_pd(to), all = _mm256_set1_pd(te + to);
            const __m256d levels = _mm256_set1_pd((double)(K - 1));
            __m256d vt = zero, vh = zero;
            for (; j + 4 <= edges; j += 4) {
                const __m256d run = _mm256_loadu_pd(width + j), rising = _mm256_cmp_pd(run, zero, _CMP_GT_OQ);
                const __m256d z0 = _mm256_loadu_pd(start + j);
                __m256d t = _mm256_div_pd(_mm256_sub_pd(_mm256_loadu_pd(edge_at + j), z0), _mm256_blendv_pd(one, run, rising));
                t = _mm256_blendv_pd(one, t, rising);
                t = _mm256_blendv_pd(zero, _mm256_blendv_pd(one, t, _mm256_cmp_pd(t, one, _CMP_LT_OQ)),
                                     _mm256_cmp_pd(t, zero, _CMP_GT_OQ));
                const __m256d target = _mm256_div_pd(_mm256_add_pd(_mm256_loadu_pd(below + j), t), levels);
                const __m256d e = _mm256_loadu_pd(sum_even + j), o = _mm256_loadu_pd(sum_odd + j);
                const __m256d pooled = _mm256_div_pd(_mm256_add_pd(e, o), all);
                const __m256d apart = _mm256_andnot_pd(sign, _mm256_sub_pd(_mm256_div_pd(e, vte), _mm256_div_pd(o, vto)));
                const __m256d d = _mm256_andnot_pd(sign, _mm256_sub_pd(pooled, target));
                vt = _mm256_max_pd(vt, d), vh = _mm256_max_pd(vh, apart); /* finite: max is exact in any order */
            }
            double lanes[4];
            _mm256_storeu_pd(lanes, vt);
            for (int l = 0; l < 4; l++) d_target = lanes[l] > d_target ? lanes[l] : d_target;
            _mm256_storeu_pd(lanes, vh);
            for (int l = 0; l < 4; l++) d_halves = lanes[l] > d_halves ? lanes[l] : d_halves;
        }
#endif
        for (; j < edges; j++) {
            const double run = width[j];
            double t = run > 0 ? (edge_at[j] - start[j]) / run : 1.0;
            t = t > 0 ? (t < 1 ? t : 1.0) : 0.0;
            const double target = (below[j] + t) / (double)(K - 1);
            const double pooled = (sum_even[j] + sum_odd[j]) / (te + to);
            const double apart = fabs(sum_even[j] / te - sum_odd[j] / to);
            const double d = fabs(pooled - target);
            if (d > d_target) d_target = d;
            if (apart > d_halves) d_halves = apart;
        }
        to_target += d_target, between += d_halves, counted++;
    }
    free(at);
    free(acc);
    out[0] = counted ? to_target / (double)counted : 0.0;
    out[1] = counted ? between / (double)counted : 0.0;
    return (int)(counted < INT32_MAX ? counted : INT32_MAX);
}

int aqr_stream_shift_distances(int64_t N, int64_t C, int64_t K, const float *kn, const int32_t *counts, int64_t GC,
                               double *out) {
    return stream_shift_test(N, C, K, kn, counts, GC, out, NULL, NULL);
}

/* ------------------------------------------------------------------------------------------------
 * A batch of rebuild_every images or more, in one call: what aqr/adapt/stream/running.py's
 * LayerStream.step composes from the operations above, in the same order on the same values (so the
 * same bits), without leaving C between them.
 *
 * aqr_stream_merge_map: a batch already counted (counts (C, GC + 4), its images' extremes lo / hi
 * (N, C)) is pushed into copies of the pending group (pending, gmin, gmax, or NULL: an empty group;
 * the copy is scratch) and of the window (ring_lo .. sorted_hi, filled, head; copied into the *_out
 * buffers, (W, C) and (C, W)); the tails are the window copy's, weighted by w (nw of them, at most the
 * images it holds); kn_out (C, K) = kn merged with the group copy at weight with those tails; x (A, C,
 * B) of N images is mapped into y with the table of kn_out. Nothing passed in changes but y, kn_out and
 * the window copy. Returns STREAM_OK, STREAM_NONFINITE (x holds NaN or +-inf: the outputs are
 * meaningless), STREAM_NO_MEMORY or STREAM_BAD_ARGUMENT.
 *
 * aqr_stream_large: x counted on the bins of the knots kn first (aqr_stream_scan, STREAM_COUNT; pairs /
 * glo / ginv the committed table, not read), then aqr_stream_merge_map with those counts.
 *
 * Both read x and write y laid out (A, B, C) where rows is nonzero (aqr_stream_scan's STREAM_ROWS). */
static int stream_merge_map(const float *x, float *y, int64_t A, int64_t C, int64_t B, int64_t N, const float *pre_scale,
                            const float *pre_shift, int64_t K, const float *kn, const float *sq, int64_t G, int64_t stride,
                            int64_t GC, const int32_t *counts, const float *lo, const float *hi, const int32_t *pending,
                            const float *gmin, const float *gmax, int64_t W, const float *ring_lo, const float *sorted_lo,
                            const float *ring_hi, const float *sorted_hi, int64_t filled, int64_t head, const double *w,
                            int64_t nw, double weight, float *kn_out, float *ring_lo_out, float *sorted_lo_out,
                            float *ring_hi_out, float *sorted_hi_out, int rows, int nthreads) {
    if (!stream_sizes_ok(C, K, G, GC) || N < 1 || W < 1 || W > (1 << 24) || filled < 0 || filled > W ||
        nw < 1 || nw > (filled + N < W ? filled + N : W) || !counts || !lo || !hi || !pending != !gmin ||
        !gmin != !gmax || !w || !kn || !kn_out || !y || !ring_lo || !sorted_lo || !ring_hi || !sorted_hi ||
        !ring_lo_out || !sorted_lo_out || !ring_hi_out || !sorted_hi_out || C > INT64_MAX / W / 8 ||
        N > INT64_MAX / C / 8)
        return STREAM_BAD_ARGUMENT;
    const int64_t bins = GC + STREAM_EDGE_BINS;
    /* the group's copy (C, bins) int32, its extremes, the tails, the map's extremes (N, C) twice (unused),
       the new table's glo / ginv (C each) and pairs (C, G + 2, 2) */
    float *mem = malloc(sizeof(float) * (size_t)(C * bins + 6 * C + 2 * N * C + C * 2 * (G + 2)));
    if (!mem) return STREAM_NO_MEMORY;
    int32_t *group = (int32_t *)mem;
    float *group_min = mem + C * bins, *group_max = group_min + C, *p0 = group_max + C, *p100 = p0 + C;
    float *map_lo = p100 + C, *map_hi = map_lo + N * C, *table_lo = map_hi + N * C, *table_inv = table_lo + C;
    float *table = table_inv + C;
    for (int64_t c = 0; c < C; c++) {
        group_min[c] = pending ? gmin[c] : INFINITY;
        group_max[c] = pending ? gmax[c] : -INFINITY;
    }
    if (pending) memcpy(group, pending, sizeof(int32_t) * (size_t)(C * bins));
    else memset(group, 0, sizeof(int32_t) * (size_t)(C * bins));
    memcpy(ring_lo_out, ring_lo, sizeof(float) * (size_t)(W * C));
    memcpy(sorted_lo_out, sorted_lo, sizeof(float) * (size_t)(W * C));
    memcpy(ring_hi_out, ring_hi, sizeof(float) * (size_t)(W * C));
    memcpy(sorted_hi_out, sorted_hi, sizeof(float) * (size_t)(W * C));
    memcpy(kn_out, kn, sizeof(float) * (size_t)(C * K));
    int status = stream_push(C, bins, W, group, counts, group_min, group_max, lo, hi, N, ring_lo_out, sorted_lo_out,
                             ring_hi_out, sorted_hi_out, filled, head, nthreads);
    if (status == STREAM_OK) status = aqr_stream_tails(C, W, sorted_lo_out, sorted_hi_out, w, nw, p0, p100);
    if (status == STREAM_OK)
        status = stream_merge(C, K, kn_out, group, GC, group_min, group_max, weight, p0, p100, nthreads);
    if (status == STREAM_OK) status = stream_tables(C, K, kn_out, sq, G, table, table_lo, table_inv, nthreads);
    if (status == STREAM_OK)
        status = stream_scan(x, y, A, C, B, N, pre_scale, pre_shift, K, kn_out, sq, table, G, table_lo, table_inv,
                             stride, GC, NULL, map_lo, map_hi, STREAM_MAP | (rows ? STREAM_ROWS : 0), nthreads);
    free(mem);
    return status;
}

static int stream_large(const float *x, float *y, int64_t A, int64_t C, int64_t B, int64_t N, const float *pre_scale,
                        const float *pre_shift, int64_t K, const float *kn, const float *sq, const float *pairs, int64_t G,
                        const float *glo, const float *ginv, int64_t stride, int64_t GC, const int32_t *pending,
                        const float *gmin, const float *gmax, int64_t W, const float *ring_lo, const float *sorted_lo,
                        const float *ring_hi, const float *sorted_hi, int64_t filled, int64_t head, const double *w,
                        int64_t nw, double weight, float *kn_out, float *ring_lo_out, float *sorted_lo_out,
                        float *ring_hi_out, float *sorted_hi_out, int rows, int nthreads) {
    if (!stream_sizes_ok(C, K, G, GC) || N < 1 || N > INT64_MAX / C / 8) return STREAM_BAD_ARGUMENT;
    const int64_t bins = GC + STREAM_EDGE_BINS;
    float *mem = malloc(sizeof(float) * (size_t)(C * bins + 2 * N * C)); /* counts (C, bins) int32, lo / hi (N, C) */
    if (!mem) return STREAM_NO_MEMORY;
    int32_t *counts = (int32_t *)mem;
    float *lo = mem + C * bins, *hi = lo + N * C;
    int status = stream_scan(x, NULL, A, C, B, N, pre_scale, pre_shift, K, kn, sq, pairs, G, glo, ginv, stride, GC,
                             counts, lo, hi, STREAM_COUNT | (rows ? STREAM_ROWS : 0), nthreads);
    if (status == STREAM_OK)
        status = stream_merge_map(x, y, A, C, B, N, pre_scale, pre_shift, K, kn, sq, G, stride, GC, counts, lo, hi,
                                  pending, gmin, gmax, W, ring_lo, sorted_lo, ring_hi, sorted_hi, filled, head, w,
                                  nw, weight, kn_out, ring_lo_out, sorted_lo_out, ring_hi_out, sorted_hi_out, rows,
                                  nthreads);
    free(mem);
    return status;
}

typedef struct {
    const float *x;
    float *y;
    int64_t A, C, B, N, K, G, GC, stride, M;
    const float *pre_scale, *pre_shift, *sq;
    const int64_t *of, *states;
    const int32_t *maps;
    float blend;
    int32_t *counts;
    float *lo, *hi;
    int32_t *bad;     /* (C): a non-finite value in the channel */
    int32_t *no_mem;  /* (C): a part that could not allocate its row */
} stream_cluster_args;

/* Channel c of every clustered image, channel by channel so that the clusters' tables of the channel stay in
   the cache (image by image, every channel's tables of every cluster would pass through it for each image):
   the same operations, in the same order per image, as stream_scan_channel of the image alone. */
static void stream_cluster_channel(const stream_cluster_args *a, int64_t c, float *row) {
    const int64_t K = a->K, G = a->G, B = a->B, rows = a->A / a->N, stride = a->stride;
    const int64_t bins = a->GC + STREAM_EDGE_BINS;
    const float ps = a->pre_scale ? a->pre_scale[c] : 1.0f, pb = a->pre_shift ? a->pre_shift[c] : 0.0f;
    const float *s = a->sq + c * K;
    int bad = 0;
    for (int64_t n = 0; n < a->N && !bad; n++) {
        const int64_t k = a->of[n];
        if (k < 0) continue;
        const int64_t *at = a->states + 4 * k;
        const float *kn = (const float *)(intptr_t)at[0] + c * K;
        const float *tab = (const float *)(intptr_t)at[1] + c * 2 * (G + 2);
        const float g0 = ((const float *)(intptr_t)at[2])[c], gi = ((const float *)(intptr_t)at[3])[c];
        const stream_bins q = stream_knot_bins(kn, K, a->GC, ps, pb);
        const int map = a->maps[k] != 0;
        int32_t *cnt = a->counts + (k * a->C + c) * bins;
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at_x = ((n * rows + r) * a->C + c) * B;
            stream_map_row(a->x + at_x, map ? row + r * B : NULL, B, ps, pb, tab, g0, gi, G, q.k1, q.kb, &mn, &mx,
                           &bad);
            const int64_t skip = (r * B) % stride; /* flat positions within the image's rows */
            stream_count_row(a->x + at_x, skip ? stride - skip : 0, B, stride, &q, cnt);
        }
        a->lo[n * a->C + c] = mn;
        a->hi[n * a->C + c] = mx;
        if (bad || !map) continue;
        if (mn < q.k0 || mx > q.kl) { /* stretch the edge lines to the image's extremes */
            float line[4];
            stream_edge_lines(&q, s, K, mn, mx, line);
            for (int64_t r = 0; r < rows; r++)
                stream_stretch_row(a->x + ((n * rows + r) * a->C + c) * B, row + r * B, B, ps, pb, q.k1, q.kb,
                                   line[0], line[1], line[2], line[3]);
        }
        const float w = a->blend;
        for (int64_t r = 0; r < rows; r++) {
            float *yp = a->y + ((n * rows + r) * a->C + c) * B;
            const float *mp = row + r * B;
            for (int64_t b = 0; b < B; b++) yp[b] = yp[b] + w * (mp[b] - yp[b]);
        }
    }
    a->bad[c] = bad;
}

static void stream_cluster_part(void *p, int part, int64_t c0, int64_t c1) {
    (void)part;
    const stream_cluster_args *a = (const stream_cluster_args *)p;
    if (c0 >= c1) return;
    float *row = malloc(sizeof(float) * (size_t)(a->A / a->N * a->B)); /* one image's map of one channel */
    if (!row) {
        a->no_mem[c0] = 1;
        return;
    }
    for (int64_t c = c0; c < c1; c++) stream_cluster_channel(a, c, row);
    free(row);
}

/* target="mixed"'s clusters, in one call: each image n of x (A, C, B; N images of A / N rows, read as
 * pre_scale * x + pre_shift) whose cluster k = of[n] is in [0, M) is scanned as a batch of its own on
 * cluster k's state (as stream_scan of its rows alone, N = 1, with the same bits): its extremes into lo / hi
 * (N, C), its values at the flat positions within its rows that are multiples of stride counted into counts
 * (M, C, GC + 4) on the bins of cluster k's knots, and, where maps[k], y's rows (the shared state's map,
 * written in place) moved blend of the way to cluster k's map of them: y + blend * (m - y), in float.
 * states (M, 4) holds cluster k's knots (C, K), table pairs (C, G + 2, 2), glo and ginv (C) as addresses;
 * sq (C, K) the source knots. An image of no cluster (of[n] < 0) is left as it is, its lo / hi unwritten;
 * of[n] >= M is refused before anything is written. Returns STREAM_OK, STREAM_NONFINITE (a value NaN or
 * +-inf: the outputs are then meaningless), STREAM_NO_MEMORY or STREAM_BAD_ARGUMENT. */
static int stream_cluster_scan(const float *x, float *y, int64_t A, int64_t C, int64_t B, int64_t N,
                               const float *pre_scale, const float *pre_shift, int64_t K, const float *sq, int64_t G,
                               int64_t stride, int64_t GC, int64_t M, const int64_t *of, const int64_t *states,
                               const int32_t *maps, double blend, int32_t *counts, float *lo, float *hi,
                               int nthreads) {
    if (!stream_sizes_ok(C, K, G, GC) || A < 1 || B < 1 || N < 1 || A % N || stride < 1 || M < 1 ||
        M > (1 << 20) || A > INT64_MAX / C / B || C > INT64_MAX / M / (GC + STREAM_EDGE_BINS) || !x || !y || !sq ||
        !of || !states || !maps || !counts || !lo || !hi || !(blend >= 0.0 && blend <= 1.0))
        return STREAM_BAD_ARGUMENT;
    for (int64_t n = 0; n < N; n++)
        if (of[n] >= M) return STREAM_BAD_ARGUMENT;
    for (int64_t k = 0; k < 4 * M; k++)
        if (!states[k]) return STREAM_BAD_ARGUMENT;
    int32_t *flags = calloc((size_t)(2 * C), sizeof(int32_t));
    if (!flags) return STREAM_NO_MEMORY;
    memset(counts, 0, sizeof(int32_t) * (size_t)(M * C * (GC + STREAM_EDGE_BINS)));
    stream_cluster_args a = {x, y, A, C, B, N, K, G, GC, stride, M, pre_scale, pre_shift, sq, of, states, maps,
                             (float)blend, counts, lo, hi, flags, flags + C};
    parallel_for(stream_cluster_part, &a, C, stream_parts(C, A * C * B, nthreads));
    int status = STREAM_OK;
    for (int64_t c = 0; c < C; c++) {
        status = flags[c] && status == STREAM_OK ? STREAM_NONFINITE : status;
        status = flags[C + c] ? STREAM_NO_MEMORY : status;
    }
    free(flags);
    return status;
}

/* target="mixed"'s clusters' pushes, in one call: for each cluster k in [0, M), its images (those n with
 * cluster[n] == k, in batch order) pushed as stream_push does: their extremes lo / hi (N, C) into cluster k's
 * tail window and, with its histogram counts (M, C, bins) row k, into its pending group. states (M, 7) holds
 * cluster k's pending, gmin, gmax, ring_lo, sorted_lo, ring_hi and sorted_hi as addresses, filled / head (M)
 * its window's counters before the batch (the caller advances them); every window holds W images. A cluster
 * of no image is not touched; an image of no cluster (cluster[n] < 0) is not pushed; cluster[n] >= M is
 * refused before anything is written. Returns STREAM_OK, STREAM_NO_MEMORY or STREAM_BAD_ARGUMENT. */
static int stream_cluster_push(int64_t C, int64_t bins, int64_t W, int64_t M, int64_t N, const int64_t *cluster,
                               const float *lo, const float *hi, const int32_t *counts, const int64_t *states,
                               const int64_t *filled, const int64_t *head, int nthreads) {
    if (C < 1 || bins < 1 || W < 1 || M < 1 || M > (1 << 20) || N < 1 || !cluster || !lo || !hi || !counts ||
        !states || !filled || !head || N > INT64_MAX / C / 8 || C > INT64_MAX / M / bins)
        return STREAM_BAD_ARGUMENT;
    for (int64_t n = 0; n < N; n++)
        if (cluster[n] >= M) return STREAM_BAD_ARGUMENT;
    for (int64_t j = 0; j < 7 * M; j++)
        if (!states[j]) return STREAM_BAD_ARGUMENT;
    float *mem = malloc(sizeof(float) * (size_t)(2 * N * C)); /* one cluster's extremes, gathered */
    if (!mem) return STREAM_NO_MEMORY;
    float *own_lo = mem, *own_hi = mem + N * C;
    int status = STREAM_OK;
    for (int64_t k = 0; k < M && status == STREAM_OK; k++) {
        int64_t taken = 0;
        for (int64_t n = 0; n < N; n++) {
            if (cluster[n] != k) continue;
            memcpy(own_lo + taken * C, lo + n * C, sizeof(float) * (size_t)C);
            memcpy(own_hi + taken * C, hi + n * C, sizeof(float) * (size_t)C);
            taken++;
        }
        if (!taken) continue;
        const int64_t *at = states + 7 * k;
        status = stream_push(C, bins, W, (int32_t *)(intptr_t)at[0], counts + k * C * bins, (float *)(intptr_t)at[1],
                             (float *)(intptr_t)at[2], own_lo, own_hi, taken, (float *)(intptr_t)at[3],
                             (float *)(intptr_t)at[4], (float *)(intptr_t)at[5], (float *)(intptr_t)at[6], filled[k],
                             head[k], nthreads);
    }
    free(mem);
    return status;
}

/* target="robust"'s rebuild of one batch alone while its groups weigh nothing, in one call: what
 * aqr/adapt/stream/robust.py composes from the operations above, in the same order (so the same bits).
 * The marginal mg (C, K) takes the batch's histogram counts (C, GC + 4) (on the bins of the knots kn)
 * spread to gmin / gmax (C) at weight (aqr_stream_group_merge); kn's inner knots become mg's; kn's ends
 * become the tails of the window's sorted_lo / sorted_hi (C, W) weighted by w (nw of them), kept outside
 * the inner knots. Returns STREAM_OK, STREAM_NO_MEMORY or STREAM_BAD_ARGUMENT. */
static int stream_idle_rebuild(int64_t C, int64_t K, float *mg, float *kn, const int32_t *counts, int64_t GC,
                               const float *gmin, const float *gmax, double weight, int64_t W, const float *sorted_lo,
                               const float *sorted_hi, const double *w, int64_t nw, int nthreads) {
    if (!stream_sizes_ok(C, K, 1, GC) || W < 1 || nw < 1 || nw > W || C > INT64_MAX / W / 8 || !mg || !kn || !counts ||
        !gmin || !gmax || !sorted_lo || !sorted_hi || !w)
        return STREAM_BAD_ARGUMENT;
    double *weights = malloc(sizeof(double) * (size_t)C + sizeof(float) * (size_t)(2 * C));
    if (!weights) return STREAM_NO_MEMORY;
    float *p0 = (float *)(weights + C), *p100 = p0 + C;
    for (int64_t c = 0; c < C; c++) weights[c] = weight;
    int status = stream_group_merge(C, K, mg, kn, counts, GC, gmin, gmax, weights, nthreads);
    if (status == STREAM_OK) {
        for (int64_t c = 0; c < C; c++) memcpy(kn + c * K + 1, mg + c * K + 1, sizeof(float) * (size_t)(K - 2));
        status = aqr_stream_tails(C, W, sorted_lo, sorted_hi, w, nw, p0, p100);
    }
    if (status == STREAM_OK) status = stream_merge(C, K, kn, NULL, 1, NULL, NULL, 0.0, p0, p100, nthreads);
    free(weights);
    return status;
}

/* ------------------------------------------------------------------------------------------------
 * The entry points. Each takes a descriptor (its fields listed once below; aqr/backends/layout.py builds
 * the Python side from the table aqr_layouts returns) and the thread count. */

/* A layer output x (A, C, B) of N images, read as pre_scale * x + pre_shift (per channel; NULL: x). */
#define STREAM_BATCH_FIELDS(F, ST)                                                                      \
    F(ST, P, const float *, x) F(ST, P, float *, y) F(ST, I, int64_t, A) F(ST, I, int64_t, C)          \
    F(ST, I, int64_t, B) F(ST, I, int64_t, N) F(ST, P, const float *, pre_scale)                       \
    F(ST, P, const float *, pre_shift)
/* The knots kn and the source knots sq (C, K), and the lookup table of the map between them: pairs
   (C, G + 2, 2), glo and ginv (C). */
#define STREAM_TABLE_FIELDS(F, ST)                                                                      \
    F(ST, I, int64_t, K) F(ST, P, float *, kn) F(ST, P, const float *, sq) F(ST, P, float *, pairs)    \
    F(ST, I, int64_t, G) F(ST, P, float *, glo) F(ST, P, float *, ginv)
/* The pending group: its histogram counts (C, GC + 4) and its extremes (C). */
#define STREAM_GROUP_FIELDS(F, ST) F(ST, P, int32_t *, pending) F(ST, P, float *, gmin) F(ST, P, float *, gmax)
/* The tail window's buffers: the images' minima and maxima as a ring (W, C) and sorted (C, W). */
#define STREAM_WINDOW_FIELDS(F, ST)                                                                     \
    F(ST, I, int64_t, W) F(ST, P, float *, ring_lo) F(ST, P, float *, sorted_lo) F(ST, P, float *, ring_hi) \
    F(ST, P, float *, sorted_hi)
/* A rebuild into copies: the tails' weights w (nw), the group's weight, and the buffers the knots and
   the window are copied into. */
#define STREAM_COPIES_FIELDS(F, ST)                                                                     \
    F(ST, P, const double *, w) F(ST, I, int64_t, nw) F(ST, D, double, weight) F(ST, P, float *, kn_out) \
    F(ST, P, float *, ring_lo_out) F(ST, P, float *, sorted_lo_out) F(ST, P, float *, ring_hi_out)      \
    F(ST, P, float *, sorted_hi_out)

#define STREAM_SCAN_FIELDS(F, ST)                                                                       \
    STREAM_BATCH_FIELDS(F, ST) STREAM_TABLE_FIELDS(F, ST) F(ST, I, int64_t, stride) F(ST, I, int64_t, GC) \
    F(ST, P, int32_t *, counts) F(ST, P, float *, lo) F(ST, P, float *, hi) F(ST, C, int, mode)
#define STREAM_PUSH_FIELDS(F, ST)                                                                       \
    F(ST, I, int64_t, C) F(ST, I, int64_t, bins) F(ST, P, const int32_t *, counts) F(ST, P, const float *, lo) \
    F(ST, P, const float *, hi) F(ST, I, int64_t, N) STREAM_GROUP_FIELDS(F, ST) STREAM_WINDOW_FIELDS(F, ST) \
    F(ST, I, int64_t, filled) F(ST, I, int64_t, head)
#define STREAM_MERGE_FIELDS(F, ST)                                                                      \
    F(ST, I, int64_t, C) F(ST, I, int64_t, K) F(ST, P, float *, kn) F(ST, P, const int32_t *, counts)  \
    F(ST, I, int64_t, GC) F(ST, P, const float *, gmin) F(ST, P, const float *, gmax) F(ST, D, double, w) \
    F(ST, P, const float *, p0) F(ST, P, const float *, p100)
#define STREAM_TABLES_FIELDS(F, ST) F(ST, I, int64_t, C) STREAM_TABLE_FIELDS(F, ST)
#define STREAM_GROUP_MERGE_FIELDS(F, ST)                                                                \
    F(ST, I, int64_t, R) F(ST, I, int64_t, K) F(ST, P, float *, gk) F(ST, P, const float *, bk)        \
    F(ST, P, const int32_t *, counts) F(ST, I, int64_t, GC) F(ST, P, const float *, gmin)              \
    F(ST, P, const float *, gmax) F(ST, P, const double *, w)
#define STREAM_SHIFT_TEST_FIELDS(F, ST)                                                                 \
    F(ST, I, int64_t, N) F(ST, I, int64_t, C) F(ST, I, int64_t, K) F(ST, P, const float *, kn)         \
    F(ST, P, const int32_t *, counts) F(ST, I, int64_t, GC) F(ST, P, double *, out) F(ST, P, int32_t *, total) \
    F(ST, P, int16_t *, small)
#define STREAM_MERGE_MAP_FIELDS(F, ST)                                                                  \
    STREAM_BATCH_FIELDS(F, ST) F(ST, I, int64_t, K) F(ST, P, const float *, kn) F(ST, P, const float *, sq) \
    F(ST, I, int64_t, G) F(ST, I, int64_t, stride) F(ST, I, int64_t, GC) F(ST, P, const int32_t *, counts) \
    F(ST, P, const float *, lo) F(ST, P, const float *, hi) STREAM_GROUP_FIELDS(F, ST)                 \
    STREAM_WINDOW_FIELDS(F, ST) F(ST, I, int64_t, filled) F(ST, I, int64_t, head) STREAM_COPIES_FIELDS(F, ST) \
    F(ST, C, int, rows)
#define STREAM_LARGE_FIELDS(F, ST)                                                                      \
    STREAM_BATCH_FIELDS(F, ST) STREAM_TABLE_FIELDS(F, ST) F(ST, I, int64_t, stride) F(ST, I, int64_t, GC) \
    STREAM_GROUP_FIELDS(F, ST) STREAM_WINDOW_FIELDS(F, ST) F(ST, I, int64_t, filled) F(ST, I, int64_t, head) \
    STREAM_COPIES_FIELDS(F, ST) F(ST, C, int, rows)
#define STREAM_IDLE_REBUILD_FIELDS(F, ST)                                                               \
    F(ST, I, int64_t, C) F(ST, I, int64_t, K) F(ST, P, float *, mg) F(ST, P, float *, kn)              \
    F(ST, P, const int32_t *, counts) F(ST, I, int64_t, GC) F(ST, P, const float *, gmin)              \
    F(ST, P, const float *, gmax) F(ST, D, double, weight) F(ST, I, int64_t, W) F(ST, P, const float *, sorted_lo) \
    F(ST, P, const float *, sorted_hi) F(ST, P, const double *, w) F(ST, I, int64_t, nw)
/* target="mixed"'s clusters scanned in one call: a batch (STREAM_BATCH_FIELDS), the source knots, and per
   image its cluster (N), per cluster its state's addresses states (M, 4) and whether it maps (maps (M)). */
#define STREAM_CLUSTER_SCAN_FIELDS(F, ST)                                                               \
    STREAM_BATCH_FIELDS(F, ST) F(ST, I, int64_t, K) F(ST, P, const float *, sq) F(ST, I, int64_t, G)   \
    F(ST, I, int64_t, stride) F(ST, I, int64_t, GC) F(ST, I, int64_t, M) F(ST, P, const int64_t *, cluster) \
    F(ST, P, const int64_t *, states) F(ST, P, const int32_t *, maps) F(ST, D, double, blend)          \
    F(ST, P, int32_t *, counts) F(ST, P, float *, lo) F(ST, P, float *, hi)
/* target="mixed"'s clusters' pushes in one call: per image its cluster (N) and extremes lo / hi (N, C), per
   cluster its histogram (counts (M, C, bins)), its group's and window's addresses (states (M, 7)) and its
   window's counters (filled, head (M)). */
#define STREAM_CLUSTER_PUSH_FIELDS(F, ST)                                                               \
    F(ST, I, int64_t, C) F(ST, I, int64_t, bins) F(ST, I, int64_t, W) F(ST, I, int64_t, M)             \
    F(ST, I, int64_t, N) F(ST, P, const int64_t *, cluster) F(ST, P, const float *, lo)                \
    F(ST, P, const float *, hi) F(ST, P, const int32_t *, counts) F(ST, P, const int64_t *, states)     \
    F(ST, P, const int64_t *, filled) F(ST, P, const int64_t *, head)
/* One layer's stream bound once (aqr/adapt/stream/native_kernels.py's BoundStream): its sizes and its
   buffers, so that a small batch's two calls pass only what changes. */
#define STREAM_LAYER_FIELDS(F, ST)                                                                      \
    F(ST, I, int64_t, C) F(ST, I, int64_t, stride) F(ST, I, int64_t, GC) STREAM_TABLE_FIELDS(F, ST)    \
    STREAM_GROUP_FIELDS(F, ST) STREAM_WINDOW_FIELDS(F, ST)
/* A batch of N images on a bound layer: x (A, C, B) read as pre_scale * x + pre_shift, mapped into y;
   stage (2 N C + C (GC + 4) floats) takes lo (N, C), hi (N, C) and the counts (C, GC + 4) as int32, in
   that order, for aqr_stream_bound_commit. */
#define STREAM_BOUND_BATCH_FIELDS(F, ST)                                                                \
    F(ST, P, const float *, x) F(ST, P, float *, y) F(ST, I, int64_t, A) F(ST, I, int64_t, B)          \
    F(ST, I, int64_t, N) F(ST, P, const float *, pre_scale) F(ST, P, const float *, pre_shift)        \
    F(ST, P, float *, stage)
/* Its commit: the window's counters before it, the stage of N images, and, where rebuild, the group's
   weight and the tails' weights tail_w (ntail). */
#define STREAM_BOUND_COMMIT_FIELDS(F, ST)                                                               \
    F(ST, I, int64_t, filled) F(ST, I, int64_t, head) F(ST, P, const float *, stage) F(ST, I, int64_t, N) \
    F(ST, C, int, rebuild) F(ST, D, double, weight) F(ST, P, const double *, tail_w) F(ST, I, int64_t, ntail)

AQR_DESCRIPTOR(aqr_stream_scan_args, STREAM_SCAN_FIELDS)
AQR_DESCRIPTOR(aqr_stream_push_args, STREAM_PUSH_FIELDS)
AQR_DESCRIPTOR(aqr_stream_merge_args, STREAM_MERGE_FIELDS)
AQR_DESCRIPTOR(aqr_stream_tables_args, STREAM_TABLES_FIELDS)
AQR_DESCRIPTOR(aqr_stream_group_merge_args, STREAM_GROUP_MERGE_FIELDS)
AQR_DESCRIPTOR(aqr_stream_shift_test_args, STREAM_SHIFT_TEST_FIELDS)
AQR_DESCRIPTOR(aqr_stream_merge_map_args, STREAM_MERGE_MAP_FIELDS)
AQR_DESCRIPTOR(aqr_stream_large_args, STREAM_LARGE_FIELDS)
AQR_DESCRIPTOR(aqr_stream_idle_rebuild_args, STREAM_IDLE_REBUILD_FIELDS)
AQR_DESCRIPTOR(aqr_stream_cluster_scan_args, STREAM_CLUSTER_SCAN_FIELDS)
AQR_DESCRIPTOR(aqr_stream_cluster_push_args, STREAM_CLUSTER_PUSH_FIELDS)
AQR_DESCRIPTOR(aqr_stream_layer, STREAM_LAYER_FIELDS)
AQR_DESCRIPTOR(aqr_stream_bound_batch, STREAM_BOUND_BATCH_FIELDS)
AQR_DESCRIPTOR(aqr_stream_bound_commit_args, STREAM_BOUND_COMMIT_FIELDS)

static const aqr_layout LAYOUTS[] = {
    AQR_LAYOUT(aqr_stream_scan_args),     AQR_LAYOUT(aqr_stream_push_args),   AQR_LAYOUT(aqr_stream_merge_args),
    AQR_LAYOUT(aqr_stream_tables_args),   AQR_LAYOUT(aqr_stream_group_merge_args),
    AQR_LAYOUT(aqr_stream_shift_test_args), AQR_LAYOUT(aqr_stream_merge_map_args),
    AQR_LAYOUT(aqr_stream_large_args),    AQR_LAYOUT(aqr_stream_idle_rebuild_args), AQR_LAYOUT(aqr_stream_layer),
    AQR_LAYOUT(aqr_stream_bound_batch),   AQR_LAYOUT(aqr_stream_bound_commit_args),
    AQR_LAYOUT(aqr_stream_cluster_scan_args), AQR_LAYOUT(aqr_stream_cluster_push_args),
};

const aqr_layout *aqr_layouts(int64_t *count) {
    *count = (int64_t)(sizeof LAYOUTS / sizeof LAYOUTS[0]);
    return LAYOUTS;
}

int aqr_stream_scan(const aqr_stream_scan_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_scan(d->x, d->y, d->A, d->C, d->B, d->N, d->pre_scale, d->pre_shift, d->K, d->kn, d->sq, d->pairs,
                       d->G, d->glo, d->ginv, d->stride, d->GC, d->counts, d->lo, d->hi, d->mode, nthreads);
}

int aqr_stream_push(const aqr_stream_push_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_push(d->C, d->bins, d->W, d->pending, d->counts, d->gmin, d->gmax, d->lo, d->hi, d->N, d->ring_lo,
                       d->sorted_lo, d->ring_hi, d->sorted_hi, d->filled, d->head, nthreads);
}

int aqr_stream_merge(const aqr_stream_merge_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_merge(d->C, d->K, d->kn, d->counts, d->GC, d->gmin, d->gmax, d->w, d->p0, d->p100, nthreads);
}

int aqr_stream_tables(const aqr_stream_tables_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_tables(d->C, d->K, d->kn, d->sq, d->G, d->pairs, d->glo, d->ginv, nthreads);
}

int aqr_stream_group_merge(const aqr_stream_group_merge_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_group_merge(d->R, d->K, d->gk, d->bk, d->counts, d->GC, d->gmin, d->gmax, d->w, nthreads);
}

int aqr_stream_shift_test(const aqr_stream_shift_test_args *d) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_shift_test(d->N, d->C, d->K, d->kn, d->counts, d->GC, d->out, d->total, d->small);
}

int aqr_stream_merge_map(const aqr_stream_merge_map_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_merge_map(d->x, d->y, d->A, d->C, d->B, d->N, d->pre_scale, d->pre_shift, d->K, d->kn, d->sq, d->G,
                            d->stride, d->GC, d->counts, d->lo, d->hi, d->pending, d->gmin, d->gmax, d->W, d->ring_lo,
                            d->sorted_lo, d->ring_hi, d->sorted_hi, d->filled, d->head, d->w, d->nw, d->weight,
                            d->kn_out, d->ring_lo_out, d->sorted_lo_out, d->ring_hi_out, d->sorted_hi_out, d->rows,
                            nthreads);
}

int aqr_stream_large(const aqr_stream_large_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_large(d->x, d->y, d->A, d->C, d->B, d->N, d->pre_scale, d->pre_shift, d->K, d->kn, d->sq, d->pairs,
                        d->G, d->glo, d->ginv, d->stride, d->GC, d->pending, d->gmin, d->gmax, d->W, d->ring_lo,
                        d->sorted_lo, d->ring_hi, d->sorted_hi, d->filled, d->head, d->w, d->nw, d->weight, d->kn_out,
                        d->ring_lo_out, d->sorted_lo_out, d->ring_hi_out, d->sorted_hi_out, d->rows, nthreads);
}

int aqr_stream_idle_rebuild(const aqr_stream_idle_rebuild_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_idle_rebuild(d->C, d->K, d->mg, d->kn, d->counts, d->GC, d->gmin, d->gmax, d->weight, d->W,
                               d->sorted_lo, d->sorted_hi, d->w, d->nw, nthreads);
}

int aqr_stream_cluster_scan(const aqr_stream_cluster_scan_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_cluster_scan(d->x, d->y, d->A, d->C, d->B, d->N, d->pre_scale, d->pre_shift, d->K, d->sq, d->G,
                               d->stride, d->GC, d->M, d->cluster, d->states, d->maps, d->blend, d->counts, d->lo, d->hi,
                               nthreads);
}

int aqr_stream_cluster_push(const aqr_stream_cluster_push_args *d, int nthreads) {
    if (!d) return STREAM_BAD_ARGUMENT;
    return stream_cluster_push(d->C, d->bins, d->W, d->M, d->N, d->cluster, d->lo, d->hi, d->counts, d->states,
                               d->filled, d->head, nthreads);
}

/* stream_scan with STREAM_MAP | STREAM_COUNT of the batch b on the bound layer d. */
int aqr_stream_bound_scan(const aqr_stream_layer *d, const aqr_stream_bound_batch *b, int nthreads) {
    if (!d || !b || !b->stage || b->N < 1 || d->C < 1 || d->C > INT64_MAX / 2 / b->N) return STREAM_BAD_ARGUMENT;
    const int64_t C = d->C, N = b->N;
    return stream_scan(b->x, b->y, b->A, C, b->B, N, b->pre_scale, b->pre_shift, d->K, d->kn, d->sq, d->pairs, d->G,
                       d->glo, d->ginv, d->stride, d->GC, (int32_t *)(b->stage + 2 * N * C), b->stage,
                       b->stage + N * C, STREAM_MAP | STREAM_COUNT, nthreads);
}

/* stream_commit on the bound layer d of what aqr_stream_bound_scan left in b's stage. */
int aqr_stream_bound_commit(const aqr_stream_layer *d, const aqr_stream_bound_commit_args *b, int nthreads) {
    if (!d || !b || !b->stage || b->N < 1 || d->C < 1 || d->C > INT64_MAX / 2 / b->N) return STREAM_BAD_ARGUMENT;
    const int64_t C = d->C, N = b->N;
    return stream_commit(C, d->K, d->GC, d->W, d->G, d->kn, d->sq, d->pairs, d->glo, d->ginv, d->pending, d->gmin,
                         d->gmax, d->ring_lo, d->sorted_lo, d->ring_hi, d->sorted_hi, b->filled, b->head,
                         (const int32_t *)(b->stage + 2 * N * C), b->stage, b->stage + N * C, N, b->rebuild,
                         b->weight, b->tail_w, b->ntail, nthreads);
}

