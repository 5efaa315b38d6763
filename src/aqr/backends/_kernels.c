/* aqr's CPU kernels for the fast recalibration path: aqr/backends/build.py builds and loads them,
 * aqr/backends/native.py calls them.
 *
 * Plain C99, parallel on the thread team of _parallel.c; AVX2 intrinsics for the map when compiled with -mavx2 -mfma. No Python
 * or torch headers: arrays are passed as raw pointers through ctypes, which also releases the GIL.
 *
 * Layout: a layer output is viewed as x[A][C][B] (float32, contiguous), channel c in the middle.
 *
 * Every array index computed from data (a histogram bucket, a table cell, a knot level) is clamped
 * to its array's bounds *before* the float is converted to an integer, NaN going to the lowest
 * index: any finite or non-finite input stays in bounds (tests/test_native_fuzz.py runs this file
 * under AddressSanitizer and UBSan). Ranges and interpolations that can exceed FLT_MAX between
 * two finite floats (max - min of a channel spanning +-3.4e38) are computed in double, the grid and
 * the knots only where float overflows (elsewhere the float results are those of torch and Triton).
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

/* Below this many values per (row, channel), a layout counts as channels-last: the kernels read
   row by row over all channels instead of channel by channel. */
enum { ROWS_LAYOUT_BELOW = 16 };

/* Status codes of the entry points. */
enum { AQR_OK = 0, AQR_NO_MEMORY = -1, AQR_BAD_ARGUMENT = -2 };

/* Whether the sizes describe arrays the kernels can index: a positive layout, K >= 3 knots (p0, an
   inner knot, p100), at least one cell, and int32 gather indices over every channel's table. */
static int sizes_ok(int64_t A, int64_t C, int64_t B, int64_t K, int64_t cells) {
    return A >= 0 && C >= 1 && B >= 1 && K >= 3 && cells >= 1 && cells < INT32_MAX / 4 &&
           C <= INT32_MAX / (cells + 2);
}

/* Whether the sample description is in bounds: S >= 1 positions each inside channel 0 of the
   (A, C, B) layout, nondecreasing ranks in [0, S - 1]. Returns 0 if not, 1 if so, 2 if the positions
   are all of channel 0's, in order (then a channel's sample is its rows, copied). Sorted positions
   find their row without a division. */
static int sample_ok(int64_t A, int64_t C, int64_t B, const int64_t *pos, int64_t S, int64_t K,
                     const int64_t *rank_lo, int64_t nbins) {
    if (S < 1 || S > INT32_MAX / 4 || nbins < 1 || nbins > INT32_MAX / 8 || S > A * B) return 0;
    const int64_t CB = C * B; /* channel 0's values: [row * CB, row * CB + B) for rows 0..A-1 */
    int64_t base = 0;
    int dense = S == A * B;
    for (int64_t i = 0; i < S; i++) {
        int64_t p = pos[i];
        if (p < 0) return 0;
        if (p - base >= CB || p < base) base = p / CB * CB;
        if (base >= A * CB || p - base >= B) return 0;
        dense &= i == 0 || p > pos[i - 1];
    }
    for (int64_t k = 0; k < K; k++) {
        if (rank_lo[k] < 0 || rank_lo[k] >= S || (k > 0 && rank_lo[k] < rank_lo[k - 1])) return 0;
    }
    return dense ? 2 : 1;
}

/* Tail codes (aqr.backends.base.TAIL_CODES); the parametric tails (interval, gaussian) read arrays
   that must be given. Clip-source came after the others, so its code is last. */
enum { TAIL_EQ1 = 0, TAIL_NONE = 1, TAIL_CLIP = 2, TAIL_INTERVAL = 3, TAIL_GAUSSIAN = 4, TAIL_CLIP_SOURCE = 5 };

/* Whether the tail reads the sample's mean and std and the source's scale. */
static int tail_parametric(int tail) { return tail == TAIL_INTERVAL || tail == TAIL_GAUSSIAN; }

static int tail_ok(int tail, const void *mean, const void *std, const void *loc, const void *scale, const void *z) {
    if (tail < TAIL_EQ1 || tail > TAIL_CLIP_SOURCE) return 0;
    if (tail_parametric(tail) && (!std || !scale)) return 0;
    return tail != TAIL_GAUSSIAN || (mean && loc && z);
}


/* ------------------------------------------------------------------------------------------------
 * Quantiles of a subset of positions, from a fine histogram. The S sampled values of a channel go
 * into NB equal-width buckets between their min and max. An order statistic in a bucket holding n
 * values is read off by spreading those n values evenly over the bucket, so it is off by less than
 * one bucket width, and its rank by less than n. A needed bucket holding more than `crowded` values
 * (ties, or a range stretched by outliers) is sorted instead, so those order statistics are exact.
 * The min and max (p0 and p100) are always exact.
 * ---------------------------------------------------------------------------------------------- */

typedef struct {
    const float *x;
    const int64_t *pos; /* (S) flat offsets of the sampled positions in channel 0; NULL: 0..S-1 */
    int64_t stride;     /* channel c's values are at x[pos[i] + c * stride] */
    const float *pre_scale, *pre_shift; /* (C) or NULL: the quantiles of pre_scale * x + pre_shift */
    int64_t S, K, nbins, crowded;
    int64_t A, C, B; /* the layout of the whole layer output src */
    const float *src;
    const int64_t *rank_lo; /* (K) order statistic below each level (type-7 interpolation) */
    const float *frac;      /* (K) interpolation weight toward rank_lo + 1 */
    float *tq;              /* (C, K) out */
    float *moments;         /* (C, 2) out: mean, std (population); NULL: not wanted */
    int32_t *finite;        /* (C) out: 1 when every value of the channel is finite */
    char *scratch;          /* per part: quant_scratch_bytes */
    float *gathered;        /* (C, S) for channels-last layouts (transpose_part), else NULL */
    float *ext_min, *ext_max; /* (C): the extremes of every value of each channel */
    int32_t *ext_nan;         /* (C): whether any value of the channel is NaN */
    struct map_args *then_map; /* aqr_recalibrate: map each finite channel right after its quantiles */
    int dense;                 /* pos holds all of channel 0's positions, in order (sample_ok) */
} quant_args;

static void after_channel(quant_args *a, int part, int64_t c);

/* Scratch sizes are rounded to 64 bytes, so every part's slice (and each array in it) is aligned. */
static int64_t round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

enum { HISTS = 2 }; /* interleaved histograms: repeated buckets do not chain their increments (two: the
                       histograms' sum and clearing cost less than four's, with 4,096 buckets) */

static int64_t quant_scratch_bytes(int64_t S, int64_t NB, int64_t K) {
    int64_t ints = HISTS * (NB + 1) + NB + S + 5 * K; /* hist; fill; bin; ranks, index, bucket */
    return round64((int64_t)sizeof(int32_t) * ints + (int64_t)sizeof(float) * 2 * S + NB + 2 * K);
}

static int cmp_float(const void *a, const void *b) {
    float fa = *(const float *)a, fb = *(const float *)b;
    return (fa > fb) - (fa < fb);
}

/* min and max of v[0..n), and whether any value is NaN. */
static int min_max(const float *v, int64_t n, float *mn_out, float *mx_out) {
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX2__
    /* four chains of 8 lanes: a min's latency does not serialize the loop (which of +0 and -0 a
       min or max keeps may differ: they are equal) */
    __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
    __m256 mn4[4] = {vmn, vmn, vmn, vmn}, mx4[4] = {vmx, vmx, vmx, vmx};
    for (; i + 32 <= n; i += 32) {
        for (int u = 0; u < 4; u++) {
            __m256 x = _mm256_loadu_ps(v + i + 8 * u);
            vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
            mn4[u] = _mm256_min_ps(mn4[u], x);
            mx4[u] = _mm256_max_ps(mx4[u], x);
        }
    }
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        mn4[0] = _mm256_min_ps(mn4[0], x);
        mx4[0] = _mm256_max_ps(mx4[0], x);
    }
    vmn = _mm256_min_ps(_mm256_min_ps(mn4[0], mn4[1]), _mm256_min_ps(mn4[2], mn4[3]));
    vmx = _mm256_max_ps(_mm256_max_ps(mx4[0], mx4[1]), _mm256_max_ps(mx4[2], mx4[3]));
    float lanes_mn[8], lanes_mx[8];
    _mm256_storeu_ps(lanes_mn, vmn);
    _mm256_storeu_ps(lanes_mx, vmx);
    for (int j = 0; j < 8; j++) {
        mn = lanes_mn[j] < mn ? lanes_mn[j] : mn;
        mx = lanes_mx[j] > mx ? lanes_mx[j] : mx;
    }
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < n; i++) {
        nan |= v[i] != v[i];
        mn = v[i] < mn ? v[i] : mn;
        mx = v[i] > mx ? v[i] : mx;
    }
    *mn_out = mn;
    *mx_out = mx;
    return nan;
}

/* Bucket of each value, bin[i] = (v[i] - mn) * scale clamped to [0, NB - 1] as a float before it
   is converted (an overflow to inf, or NaN, would convert to INT_MIN): monotone in v[i], because
   IEEE rounding and the clamp are monotone. */
static void bucket_index(const float *v, int64_t n, float mn, float scale, int32_t NB, int32_t *bin) {
    const float top = (float)(NB - 1);
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 vmn = _mm256_set1_ps(mn), vscale = _mm256_set1_ps(scale);
    const __m256 zero = _mm256_setzero_ps(), vtop = _mm256_set1_ps(top);
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + i), vmn), vscale);
        t = _mm256_min_ps(_mm256_max_ps(t, zero), vtop); /* max(NaN, 0) is 0: its second operand */
        _mm256_storeu_si256((__m256i *)(bin + i), _mm256_cvttps_epi32(t));
    }
#endif
    for (; i < n; i++) {
        float t = (v[i] - mn) * scale;
        t = t > 0.0f ? t : 0.0f; /* NaN fails the test: bucket 0 */
        bin[i] = (int32_t)(t < top ? t : top);
    }
}

/* Mean and population std of v[0..n), n >= 1, in double and in two passes: E[x^2] - E[x]^2 loses
   every digit for values of 1e30 with a spread of 1, and float squares overflow above 1.8e19. */
static void moments_of(const float *v, int64_t n, float *out) {
    double sum[4] = {0}, sq[4] = {0}; /* four chains: the adds' latency does not serialize */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; j++) sum[j] += v[i + j];
    }
    for (; i < n; i++) sum[0] += v[i];
    double mean = (sum[0] + sum[1] + sum[2] + sum[3]) / (double)n;
    for (i = 0; i + 4 <= n; i += 4) {
        for (int j = 0; j < 4; j++) sq[j] += ((double)v[i + j] - mean) * ((double)v[i + j] - mean);
    }
    for (; i < n; i++) sq[0] += ((double)v[i] - mean) * ((double)v[i] - mean);
    out[0] = (float)mean;
    out[1] = (float)sqrt((sq[0] + sq[1] + sq[2] + sq[3]) / (double)n);
}

/* a + (b - a) * f for floats a <= b (exact when a == b: tied knots stay tied); in double where that
   overflows float (a = -b = 3e38). aqr.core.qmap.lerp_knots does the same. */
static float lerp_knots(float a, float b, float f) {
    float r = a + (b - a) * f;
    if (isfinite(r) || !isfinite(a) || !isfinite(b)) return r;
    return (float)((double)a + ((double)b - (double)a) * (double)f);
}

/* Min, max and NaN flag of every value of channel c, channel-major layouts: A rows of B contiguous
   values. Run just before the channel's sample is gathered, it also brings those rows into cache. */
static void channel_extremes(quant_args *a, int64_t c) {
    float mn = INFINITY, mx = -INFINITY;
    int nan = 0;
    for (int64_t row = 0; row < a->A; row++) {
        float rmn, rmx;
        nan |= min_max(a->src + (row * a->C + c) * a->B, a->B, &rmn, &rmx);
        mn = rmn < mn ? rmn : mn;
        mx = rmx > mx ? rmx : mx;
    }
    a->ext_min[c] = mn;
    a->ext_max[c] = mx;
    a->ext_nan[c] = nan;
}

#ifdef AQR_WIDE_LOOKUP
/* buf[i] = xc[pos[i]] * pa + pb for the first i of S sampled positions, eight at a time with
   AVX-512's gathers (where aqr_choose_lookup found gathers the faster; same operations lane by
   lane); returns how many it read, a multiple of 8. The positions are in bounds (sample_ok). */
AQR_WIDE static int64_t gather_sample_wide(const float *xc, const int64_t *pos, int64_t S, float pa, float pb,
                                           float *buf) {
    const __m256 vpa = _mm256_set1_ps(pa), vpb = _mm256_set1_ps(pb);
    int64_t i = 0;
    for (; i + 8 <= S; i += 8) {
        const __m256 v = _mm512_i64gather_ps(_mm512_loadu_si512((const void *)(pos + i)), xc, 4);
        _mm256_storeu_ps(buf + i, _mm256_add_ps(_mm256_mul_ps(v, vpa), vpb));
    }
    return i;
}
#endif

static void quantiles_part(void *p, int part, int64_t c0, int64_t c1) {
    quant_args *a = (quant_args *)p;
    const int64_t S = a->S, K = a->K;
    const int32_t NB = (int32_t)a->nbins;
    char *mem = a->scratch + part * quant_scratch_bytes(S, NB, K);
    int32_t *hist = (int32_t *)mem;          /* HISTS x (NB + 1); row 0 becomes the bucket starts */
    int32_t *fill = hist + HISTS * (NB + 1); /* NB: placement cursors of the crowded buckets */
    int32_t *bin = fill + NB;                /* S */
    int32_t *ranks = bin + S;                /* <= 2K: the needed ranks, ascending */
    int32_t *index = ranks + 2 * K;          /* K: position of rank_lo[k] in ranks */
    int32_t *bucket = index + K;             /* <= 2K: the bucket of each needed rank */
    float *buf = (float *)(bucket + 2 * K);  /* S */
    float *placed = buf + S;                 /* S: crowded buckets, sorted in place */
    unsigned char *crowd = (unsigned char *)(placed + S); /* NB: which buckets are sorted */
    unsigned char *exact = crowd + NB;                     /* 2K: needed ranks read from placed */
    int64_t nranks = 0;
    for (int64_t k = 0; k < K; k++) { /* the order statistics the K levels interpolate between */
        for (int64_t r = a->rank_lo[k]; r <= a->rank_lo[k] + 1 && r < S; r++) {
            if (nranks == 0 || ranks[nranks - 1] < r) ranks[nranks++] = (int32_t)r;
        }
        int32_t at = (int32_t)nranks - 1; /* levels may share ranks when S < K */
        while (ranks[at] > a->rank_lo[k]) at--;
        index[k] = at;
    }
    memset(crowd, 0, (size_t)NB);
    memset(hist, 0, sizeof(int32_t) * HISTS * (NB + 1)); /* once: each channel leaves it zero */
    /* after_channel runs after every channel, also those that `continue` early */
    for (int64_t c = c0; c < c1; after_channel(a, part, c), c++) {
        const float *xc = a->x + c * a->stride;
        float *out = a->tq + c * K;
        float pa = a->pre_scale ? a->pre_scale[c] : 1.0f, pb = a->pre_shift ? a->pre_shift[c] : 0.0f;
        if (a->pos) channel_extremes(a, c);
        if (a->pos && a->dense) { /* every value: the rows one after another */
            for (int64_t row = 0; row < a->A; row++) {
                const float *xr = xc + row * a->C * a->B;
                float *br = buf + row * a->B;
                for (int64_t j = 0; j < a->B; j++) br[j] = xr[j] * pa + pb;
            }
        } else if (a->pos) {
            int64_t i = 0;
#ifdef AQR_WIDE_LOOKUP
            if (aqr_wide_lookup) i = gather_sample_wide(xc, a->pos, S, pa, pb, buf);
#endif
            for (; i < S; i++) buf[i] = xc[a->pos[i]] * pa + pb;
        } else { /* already gathered, channel by channel (transpose_part) */
            for (int64_t i = 0; i < S; i++) buf[i] = xc[i] * pa + pb;
        }
        float mn, mx;
        int nan = min_max(buf, S, &mn, &mx);
        if (a->moments) moments_of(buf, S, a->moments + 2 * c);
        /* p0 and p100 are the extremes of the whole layer output, as in the exact path: a sample's
           extremes fall short of the batch's, and the tail strategies anchor on them. */
        float lo_all = a->ext_min[c] * pa + pb, hi_all = a->ext_max[c] * pa + pb; /* monotone in x */
        if (lo_all > hi_all) {
            float t = lo_all;
            lo_all = hi_all;
            hi_all = t;
        }
        a->finite[c] = !nan && !a->ext_nan[c] && isfinite(lo_all) && isfinite(hi_all);
        if (!a->finite[c] || mn == mx) {
            for (int64_t k = 0; k < K; k++) out[k] = a->finite[c] ? mn : NAN;
            if (a->finite[c]) out[0] = lo_all, out[K - 1] = hi_all;
            continue;
        }
        /* In double: mx - mn overflows float when the sample spans more than FLT_MAX. A range so
           small that NB / range overflows float puts every value in the first buckets (then
           crowded, hence sorted); bucket_index clamps whatever lands outside. */
        double scale_d = (double)NB / ((double)mx - (double)mn);
        float scale = scale_d < (double)FLT_MAX ? (float)scale_d : FLT_MAX;
        bucket_index(buf, S, mn, scale, NB, bin); /* hist is all zero here (see below) */
        int64_t i = 0;
        for (; i + HISTS <= S; i += HISTS) {
            for (int j = 0; j < HISTS; j++) hist[j * (NB + 1) + bin[i + j] + 1]++;
        }
        for (; i < S; i++) hist[bin[i] + 1]++;
        /* The buckets' starts: the histograms summed and their prefix sums, in one pass. Then the
           bucket of each needed rank, by a merge with the ascending ranks, and which of those
           buckets are crowded. */
        int32_t *start = hist; /* start[b] = number of values in buckets below b */
        int32_t *rows[HISTS];
        for (int j = 0; j < HISTS; j++) rows[j] = hist + j * (NB + 1);
        int32_t at = 1;
#ifdef __AVX2__
        /* eight buckets at a time: the rows summed (and rows 1.. cleared: all zero for the next
           channel), the prefix sums within the eight lanes, plus the sum of all buckets before them */
        const __m256i zero_i = _mm256_setzero_si256();
        __m256i carry = zero_i;
        for (; at + 8 <= NB + 1; at += 8) {
            __m256i n = _mm256_loadu_si256((const __m256i *)(start + at));
            for (int j = 1; j < HISTS; j++) {
                n = _mm256_add_epi32(n, _mm256_loadu_si256((const __m256i *)(rows[j] + at)));
                _mm256_storeu_si256((__m256i *)(rows[j] + at), zero_i);
            }
            n = _mm256_add_epi32(n, _mm256_slli_si256(n, 4)); /* within each half of four */
            n = _mm256_add_epi32(n, _mm256_slli_si256(n, 8));
            const __m256i low_sum = _mm256_permutevar8x32_epi32(n, _mm256_setr_epi32(0, 0, 0, 0, 3, 3, 3, 3));
            n = _mm256_add_epi32(n, _mm256_blend_epi32(zero_i, low_sum, 0xF0));
            n = _mm256_add_epi32(n, carry);
            _mm256_storeu_si256((__m256i *)(start + at), n);
            carry = _mm256_permutevar8x32_epi32(n, _mm256_set1_epi32(7));
        }
#endif
        for (int32_t run = start[at - 1]; at <= NB; at++) { /* start[0] is 0 */
            for (int j = 1; j < HISTS; j++) {
                start[at] += rows[j][at];
                rows[j][at] = 0;
            }
            run += start[at];
            start[at] = run;
        }
        int any_crowded = 0;
        int32_t b = 0;
        for (int64_t r = 0; r < nranks; r++) { /* ranks < S = start[NB]: the bound only guards */
            const int32_t rank = ranks[r];
            while (b + 16 < NB && start[b + 16] <= rank) b += 16; /* start is ascending: skip 16 buckets */
#ifdef __AVX2__
            if (b + 16 < NB) { /* start[b + 16] > rank: b moves by the count of start[b + 1 .. b + 15] <= rank */
                const __m256i vrank = _mm256_set1_epi32(rank);
                const __m256i gt0 = _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(start + b + 1)), vrank);
                const __m256i gt1 = _mm256_cmpgt_epi32(_mm256_loadu_si256((const __m256i *)(start + b + 9)), vrank);
                const unsigned gt = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(gt0)) |
                                    (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(gt1)) << 8;
                b += __builtin_popcount(~gt & 0xffffu);
            }
#endif
            while (b + 1 < NB && start[b + 1] <= rank) b++;
            bucket[r] = b;
            int crowded = start[b + 1] - start[b] > a->crowded;
            exact[r] = (unsigned char)crowded;
            if (crowded && !crowd[b]) {
                crowd[b] = 1;
                fill[b] = start[b];
                any_crowded = 1;
            }
        }
        if (any_crowded) {
            for (i = 0; i < S; i++) {
                if (crowd[bin[i]]) placed[fill[bin[i]]++] = buf[i];
            }
            for (int64_t r = 0; r < nranks; r++) {
                int32_t b = bucket[r];
                if (exact[r] && crowd[b]) {
                    qsort(placed + start[b], (size_t)(start[b + 1] - start[b]), sizeof(float), cmp_float);
                    crowd[b] = 0; /* sorted once; also leaves crowd all zero for the next channel */
                }
            }
        }
        double width = 1.0 / (double)scale; /* of a bucket as bucket_index assigns them; in double: see scale_d */
        for (int64_t k = 0; k < K; k++) {
            float v[2];
            for (int j = 0; j < 2; j++) {
                int64_t at = index[k] + (j && a->rank_lo[k] + 1 < S);
                int64_t rank = ranks[at];
                int32_t b = bucket[at];
                double n = (double)(start[b + 1] - start[b]);
                double est = (double)mn + ((double)b + ((double)(rank - start[b]) + 0.5) / n) * width;
                est = est < mn ? mn : (est > mx ? mx : est);
                v[j] = rank == 0 ? mn : (rank == S - 1 ? mx : (exact[at] ? placed[rank] : (float)est));
            }
            out[k] = lerp_knots(v[0], v[1], a->frac[k]);
        }
        out[0] = lo_all;
        out[K - 1] = hi_all;
        memset(start, 0, sizeof(int32_t) * (size_t)(NB + 1)); /* the histograms all zero again */
    }
}

/* Extremes for channels-last layouts, over a range of rows into this part's own (C) arrays
   (ext_min/ext_max/ext_nan + part * C); aqr_subset_quantiles combines the parts. */
static void extremes_rows_part(void *p, int part, int64_t r0, int64_t r1) {
    quant_args *a = (quant_args *)p;
    const int64_t C = a->C, B = a->B;
    float *mn = a->ext_min + (part + 1) * C, *mx = a->ext_max + (part + 1) * C;
    int32_t *nan = a->ext_nan + (part + 1) * C; /* the caller set every slot to +inf, -inf, 0 */
    for (int64_t row = r0; row < r1; row++) {
        const float *xr = a->src + row * C * B;
        int64_t c = 0;
#ifdef __AVX2__
        if (B == 1) {
            for (; c + 8 <= C; c += 8) {
                __m256 v = _mm256_loadu_ps(xr + c);
                _mm256_storeu_ps(mn + c, _mm256_min_ps(_mm256_loadu_ps(mn + c), v));
                _mm256_storeu_ps(mx + c, _mm256_max_ps(_mm256_loadu_ps(mx + c), v));
                __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                _mm256_storeu_si256((__m256i *)(nan + c), _mm256_or_si256(_mm256_loadu_si256((const __m256i *)(nan + c)), isnan));
            }
        }
#endif
        for (; c < C; c++) {
            for (int64_t b = 0; b < B; b++) {
                float v = xr[c * B + b];
                nan[c] |= v != v;
                mn[c] = v < mn[c] ? v : mn[c];
                mx[c] = v > mx[c] ? v : mx[c];
            }
        }
    }
}

#ifdef __AVX2__
/* dst[j * ds + k] = src[k][j] for j, k < 8: eight rows of eight floats (at any addresses) transposed
   into eight rows ds apart. Moves only: the values keep their bits. */
static inline void transpose8(const float *const src[8], float *dst, int64_t ds) {
    __m256 r[8], t[8], u[8];
    for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_ps(src[k]);
    for (int k = 0; k < 8; k += 2) {
        t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
        t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(dst + j * ds, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
        _mm256_storeu_ps(dst + (j + 4) * ds, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
    }
}
#endif

/* dst[c * ds + i] = rows[i][c * cs] for i < n rows and c < C channels: rows of channels-last values
   transposed into channel-major ones (eight by eight where the channels sit side by side). */
static void rows_to_channels(const float *const *rows, int64_t n, int64_t C, int64_t cs, float *dst, int64_t ds) {
    int64_t i = 0;
#ifdef __AVX2__
    if (cs == 1) {
        for (; i + 8 <= n; i += 8) {
            const float *src[8];
            int64_t c = 0;
            for (; c + 8 <= C; c += 8) {
                for (int k = 0; k < 8; k++) src[k] = rows[i + k] + c;
                transpose8(src, dst + c * ds + i, ds);
            }
            for (; c < C; c++) {
                for (int k = 0; k < 8; k++) dst[c * ds + i + k] = rows[i + k][c];
            }
        }
    }
#endif
    for (; i < n; i++) {
        for (int64_t c = 0; c < C; c++) dst[c * ds + i] = rows[i][c * cs];
    }
}

/* Rows of the sample transposed at a time by the gather below. */
enum { GATHER_BLOCK = 64 };

/* The sampled values of every channel, channel-major into a->gathered (C, S). */
static void transpose_part(void *p, int part, int64_t i0, int64_t i1) {
    (void)part;
    quant_args *a = (quant_args *)p;
    const float *rows[GATHER_BLOCK];
    for (int64_t i = i0; i < i1; i += GATHER_BLOCK) {
        const int64_t n = i + GATHER_BLOCK < i1 ? GATHER_BLOCK : i1 - i;
        for (int64_t k = 0; k < n; k++) rows[k] = a->x + a->pos[i + k];
        rows_to_channels(rows, n, a->C, a->stride, a->gathered + i, a->S);
    }
}

/* x is a layer output (A, C, B). Per channel c: tq[c] = the K quantiles of pre_scale * x + pre_shift
   (NULL: of x) at pos + c * B (S positions), read from an nbins-bucket histogram (buckets with more
   than `crowded` values are sorted), except p0 and p100, taken over every value; moments[c] =
   (mean, std) of the sample unless moments is NULL; finite[c] = whether every value of the channel
   is finite (else tq[c] is NaN). Returns 0, -1 when the scratch memory could not be allocated, or
   -2 when the sizes, positions or ranks are out of bounds. */
static int subset_quantiles(const float *x, int64_t A, int64_t C, int64_t B, const int64_t *pos,
                            const float *pre_scale, const float *pre_shift, int64_t S, int64_t K,
                            const int64_t *rank_lo, const float *frac, int64_t nbins, int64_t crowded,
                            float *tq, float *moments, int32_t *finite, int nthreads) {
    int sample = sizes_ok(A, C, B, K, 1) ? sample_ok(A, C, B, pos, S, K, rank_lo, nbins) : 0;
    if (!sample) return AQR_BAD_ARGUMENT;
    /* Channels-last (rows): channel c's samples sit C * B apart. Its extremes come from one pass
       over the rows and its sample is gathered once into a (C, S) buffer, instead of reading every
       row once per channel. Channel-major layouts do both per channel, in quantiles_part. */
    const int rows = B < ROWS_LAYOUT_BELOW && C > 1;
    int parts = num_parts(C, nthreads), row_parts = rows ? num_parts(A, nthreads) : 0;
    char *scratch = malloc((size_t)(parts * quant_scratch_bytes(S, nbins, K)));
    /* extremes: (C) results, then one (C) slot per part of the rows pass */
    float *ext = malloc(sizeof(float) * (size_t)(2 * C * (row_parts + 1)));
    int32_t *ext_nan = malloc(sizeof(int32_t) * (size_t)(C * (row_parts + 1)));
    if (!scratch || !ext || !ext_nan) {
        free(scratch);
        free(ext);
        free(ext_nan);
        return -1;
    }
    quant_args a = {x, pos, B, pre_scale, pre_shift, S, K, nbins, crowded, A, C, B, x, rank_lo, frac, tq, moments,
                    finite, scratch, NULL, ext, ext + C * (row_parts + 1), ext_nan, NULL, sample == 2};
    if (rows) {
        for (int64_t i = 0; i < C * (row_parts + 1); i++) a.ext_min[i] = INFINITY, a.ext_max[i] = -INFINITY, a.ext_nan[i] = 0;
        parallel_for(extremes_rows_part, &a, A, row_parts); /* a smaller team leaves slots as set */
        for (int64_t c = 0; c < C; c++) {
            for (int t = 1; t <= row_parts; t++) {
                float pmn = a.ext_min[t * C + c], pmx = a.ext_max[t * C + c];
                a.ext_min[c] = pmn < a.ext_min[c] ? pmn : a.ext_min[c];
                a.ext_max[c] = pmx > a.ext_max[c] ? pmx : a.ext_max[c];
                a.ext_nan[c] |= a.ext_nan[t * C + c] != 0;
            }
        }
        a.gathered = malloc(sizeof(float) * (size_t)(C * S));
        if (!a.gathered) {
            free(scratch);
            free(ext);
            free(ext_nan);
            return -1;
        }
        parallel_for(transpose_part, &a, S, nthreads);
        a.x = a.gathered;
        a.pos = NULL;
        a.stride = S;
    }
    parallel_for(quantiles_part, &a, C, parts);
    free(a.gathered);
    free(scratch);
    free(ext);
    free(ext_nan);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * The lookup-table map. Each channel's table: cell 0 is the lower tail line, cells 1..cells the
 * exact map (Eq. 1) interpolated between grid points spanning [p1^T, p_{K-2}^T], cell cells+1 the
 * upper tail line. Mirrors aqr.backends.torch_backend.table_map (same float32 arithmetic order);
 * the rule both implement is in that module's docstring ("Marked cells").
 *
 * Marked cells hold NaN as slope and intercept. The exact map jumps at a value shared by a run of
 * tied target knots (from the source at the run's first level to its last, with the middle level
 * at the value itself); a line per cell would smear that jump over the cell. So the cell of every
 * tied knot and its two neighbours are marked (unless all K knots are equal: then every value is
 * that value, and cell 1 maps it to the middle level), as is any cell whose line is not finite.
 * A value whose table result is NaN is mapped by exact_value instead.
 * ---------------------------------------------------------------------------------------------- */

/* Tail strategies (aqr.core.qmap.TAILS, codes above); "standard" and "average" differ only in the
   source knots. */

typedef struct map_args {
    const float *x;
    float *y;
    int64_t A, C, B;
    const float *pre_scale, *pre_shift; /* (C) or NULL: the map applies to pre_scale * x + pre_shift */
    const float *tq, *sq;               /* (C, K) */
    int64_t K;
    int tail;
    const float *mean, *std;  /* (C): the sample's moments (interval, gaussian), mstride apart */
    int64_t mstride;
    const float *loc, *scale; /* (C): the source's (gaussian; scale also interval) */
    const double *z;          /* (2): probits at p0 and p_{K-2} (gaussian) */
    int64_t cells;
    char *scratch; /* per part: map_scratch_bytes */
} map_args;

static float slope_of(float rise, float run) { return run > 0 ? rise / run : 0.0f; }

/* The affine map below p1^T (lines[0] * x + lines[1]) and at or above p_{K-2}^T (lines[2], lines[3]):
   aqr.core.qmap.tail_lines, with the same float32 operations. */
static void tail_lines(const map_args *a, int64_t c, float lines[4]) {
    const int64_t K = a->K;
    const float *tq = a->tq + c * K, *sq = a->sq + c * K;
    float t0 = tq[0], t1 = tq[1], t98 = tq[K - 2], t99 = tq[K - 1];
    float s0 = sq[0], s1 = sq[1], s98 = sq[K - 2], s99 = sq[K - 1];
    float std = 1.0f, scale = 0.0f;
    if (tail_parametric(a->tail)) {
        float sd = a->std[c * a->mstride];
        std = sd > 0 ? sd : 1.0f; /* constant channel: no spread to rescale */
        scale = a->scale[c];
    }
    switch (a->tail) {
    case TAIL_NONE:
        lines[0] = 1.0f, lines[1] = 0.0f, lines[2] = 1.0f, lines[3] = 0.0f;
        return;
    case TAIL_CLIP:
        lines[0] = 0.0f, lines[1] = t1, lines[2] = 0.0f, lines[3] = t98;
        return;
    case TAIL_CLIP_SOURCE:
        lines[0] = 0.0f, lines[1] = s1, lines[2] = 0.0f, lines[3] = s98;
        return;
    case TAIL_INTERVAL: {
        float s = scale / std;
        lines[0] = s, lines[1] = s0 - s * t0, lines[2] = s, lines[3] = s98 - s * t98;
        return;
    }
    case TAIL_GAUSSIAN: {
        const double *z = a->z; /* the slopes' probit differences cancel: both are scale / std */
        float z0 = (float)z[0], z98 = (float)z[1];
        float mean = a->mean[c * a->mstride], loc = a->loc[c], s = scale / std;
        lines[0] = s, lines[2] = s;
        lines[1] = (loc + scale * z0) - s * (mean + std * z0);
        lines[3] = s98 - s * (mean + std * z98);
        return;
    }
    default: /* Eq. 1 on the edge intervals, extended linearly beyond */
        lines[0] = slope_of(s1 - s0, t1 - t0);
        lines[1] = s0 - lines[0] * t0;
        lines[2] = slope_of(s99 - s98, t99 - t98);
        lines[3] = s98 - lines[2] * t98;
    }
}

/* The exact map at point g (aqr.core.qmap.interp_levels then eval_levels), given p = the number of
   knots <= g (0 for NaN) and run_first = the first index of the run of knots equal to tq[p - 1]. */
static float exact_at(float g, int64_t p, const float *tq, const float *sq, int64_t run_first, int64_t K) {
    int64_t j = p - 1;
    j = j < 0 ? 0 : (j > K - 2 ? K - 2 : j);
    float lo_knot = tq[j], width = tq[j + 1] - lo_knot;
    float t = width > 0 ? (g - lo_knot) / width : (float)(g > lo_knot);
    float u = (float)j + t;
    int64_t last = p - 1 < 0 ? 0 : p - 1;
    if (p > 0 && g == tq[last]) u = (float)(run_first + last) / 2;
    /* the level's interval, clamped as a float before the conversion (u may be +-inf or NaN) */
    float fl = floorf(u);
    int64_t i = fl >= (float)(K - 2) ? K - 2 : (fl > 0.0f ? (int64_t)fl : 0);
    float f = u - (float)i;
    return sq[i] + (sq[i + 1] - sq[i]) * f;
}

#ifdef __AVX2__
/* The level coordinate u of exact_at at the eight points g, given each point's knot interval j =
   clamp(p - 1, 0, K - 2) with its ends lo_knot = tq[j] and hi_knot = tq[j + 1], its last knot
   at_last = tq[last] (last = max(p - 1, 0)) and that knot's tie-run start first: the same float
   operations lane by lane (a division by a width that is not positive is computed and discarded). */
static inline __m256 level_at8(__m256 g, __m256i p, __m256i j, __m256i last, __m256 lo_knot, __m256 hi_knot,
                               __m256 at_last, __m256i first) {
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    const __m256 width = _mm256_sub_ps(hi_knot, lo_knot);
    const __m256 t_step = _mm256_and_ps(_mm256_cmp_ps(g, lo_knot, _CMP_GT_OQ), one);
    const __m256 t = _mm256_blendv_ps(t_step, _mm256_div_ps(_mm256_sub_ps(g, lo_knot), width),
                                      _mm256_cmp_ps(width, zero, _CMP_GT_OQ));
    const __m256 u = _mm256_add_ps(_mm256_cvtepi32_ps(j), t);
    const __m256 tied = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(p, _mm256_setzero_si256())),
                                      _mm256_cmp_ps(g, at_last, _CMP_EQ_OQ));
    return _mm256_blendv_ps(u, _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(first, last)), _mm256_set1_ps(2.0f)), tied);
}

/* The source level interval i of level coordinate u: K - 2 from fl = floor(u) >= K - 2, fl where
   fl > 0, else (also NaN) 0. */
static inline __m256i level_interval8(__m256 u, int64_t K) {
    const __m256 fl = _mm256_floor_ps(u);
    __m256i i = _mm256_and_si256(_mm256_cvttps_epi32(fl), _mm256_castps_si256(_mm256_cmp_ps(fl, _mm256_setzero_ps(), _CMP_GT_OQ)));
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i), _mm256_castsi256_ps(_mm256_set1_epi32((int)(K - 2))),
                                                _mm256_cmp_ps(fl, _mm256_set1_ps((float)(K - 2)), _CMP_GE_OQ)));
}

/* exact_at at the eight points g[0..8) with p[l] knots <= g[l] (0 <= p[l] <= K), by gathers:
   every gathered index is clamped to [0, K - 1] first. */
static inline __m256 exact_at8_gathered(const float *g_in, const int32_t *p_in, const float *tq, const float *sq,
                                        const int32_t *run_start, int64_t K) {
    const __m256i one_i = _mm256_set1_epi32(1);
    const __m256 g = _mm256_loadu_ps(g_in);
    const __m256i p = _mm256_loadu_si256((const __m256i *)p_in);
    const __m256i last = _mm256_max_epi32(_mm256_sub_epi32(p, one_i), _mm256_setzero_si256());
    const __m256i j = _mm256_min_epi32(last, _mm256_set1_epi32((int)(K - 2))); /* clamp(p - 1, 0, K - 2) */
    const __m256 u = level_at8(g, p, j, last, _mm256_i32gather_ps(tq, j, 4), _mm256_i32gather_ps(tq + 1, j, 4),
                               _mm256_i32gather_ps(tq, last, 4), _mm256_i32gather_epi32(run_start, last, 4));
    const __m256i i = level_interval8(u, K);
    const __m256 f = _mm256_sub_ps(u, _mm256_cvtepi32_ps(i));
    const __m256 s0 = _mm256_i32gather_ps(sq, i, 4), s1 = _mm256_i32gather_ps(sq + 1, i, 4);
    return _mm256_add_ps(s0, _mm256_mul_ps(_mm256_sub_ps(s1, s0), f));
}

/* exact_at8_gathered, where the eight points' knots lie within the eight from j0 = clamp(p[0] - 1,
   0, K - 2), or from K - 8 where j0 is past it: the knots, tie-run starts and source levels are
   read from those eight by permutes (gathers are slow on some CPUs; a table's 1,025 points took
   9,400 cycles with them, 3,800 so; starting no window past K - 8, the grid's points in the top
   seven intervals all took gathers, and a table 10-18 % longer).
   The grid ascends, so p[l] does (a prefix sum of counts): lanes 0 and 7 bound every lane's knots.
   Points whose source levels reach outside the window (a tie run starting below j0) take gathers. */
static inline __m256 exact_at8(const float *g_in, const int32_t *p_in, const float *tq, const float *sq,
                               const int32_t *run_start, int64_t K) {
    if (K < 8) return exact_at8_gathered(g_in, p_in, tq, sq, run_start, K);
    /* the window starts at lane 0's interval, or at K - 8 where that is past it (the grid's top
       points: their intervals are the last few) */
    int32_t j0 = p_in[0] - 1 < 0 ? 0 : (p_in[0] - 1 > (int32_t)(K - 2) ? (int32_t)(K - 2) : p_in[0] - 1);
    j0 = j0 > (int32_t)(K - 8) ? (int32_t)(K - 8) : j0;
    const int32_t last7 = p_in[7] - 1 < 0 ? 0 : p_in[7] - 1, j7 = last7 > (int32_t)(K - 2) ? (int32_t)(K - 2) : last7;
    /* every lane's interval j in [j0, j0 + 6]; then its upper knot and its last knot (at most j + 1,
       as p <= K) lie in the window too */
    if (j7 - j0 > 6) return exact_at8_gathered(g_in, p_in, tq, sq, run_start, K);
    const __m256i one_i = _mm256_set1_epi32(1), base = _mm256_set1_epi32(j0);
    const __m256 knots = _mm256_loadu_ps(tq + j0); /* tq[j0 .. j0 + 7], j0 + 7 <= K - 1 */
    const __m256 g = _mm256_loadu_ps(g_in);
    const __m256i p = _mm256_loadu_si256((const __m256i *)p_in);
    const __m256i last = _mm256_max_epi32(_mm256_sub_epi32(p, one_i), _mm256_setzero_si256());
    const __m256i j = _mm256_min_epi32(last, _mm256_set1_epi32((int)(K - 2))); /* in [j0, j0 + 6] */
    const __m256i jw = _mm256_sub_epi32(j, base), lw = _mm256_sub_epi32(last, base); /* lw in [0, 7] */
    const __m256i first = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(run_start + j0)), lw);
    const __m256 u = level_at8(g, p, j, last, _mm256_permutevar8x32_ps(knots, jw),
                               _mm256_permutevar8x32_ps(knots, _mm256_add_epi32(jw, one_i)),
                               _mm256_permutevar8x32_ps(knots, lw), first);
    const __m256i i = level_interval8(u, K);
    const __m256 f = _mm256_sub_ps(u, _mm256_cvtepi32_ps(i));
    const __m256i iw = _mm256_sub_epi32(i, base);
    __m256 s0, s1;
    if (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(_mm256_setzero_si256(), iw),
                                                               _mm256_cmpgt_epi32(iw, _mm256_set1_epi32(6)))))) {
        s0 = _mm256_i32gather_ps(sq, i, 4), s1 = _mm256_i32gather_ps(sq + 1, i, 4);
    } else {
        const __m256 levels = _mm256_loadu_ps(sq + j0);
        s0 = _mm256_permutevar8x32_ps(levels, iw);
        s1 = _mm256_permutevar8x32_ps(levels, _mm256_add_epi32(iw, one_i));
    }
    return _mm256_add_ps(s0, _mm256_mul_ps(_mm256_sub_ps(s1, s0), f));
}
#endif

/* The map of value v in channel c by Eq. 1 with the tie rule, then the tail strategy's lines below
   p1^T and at or above p_{K-2}^T (aqr.core.qmap.map_rows on one value): marked cells' values. */
static float exact_value(const map_args *a, int64_t c, float v) {
    if (v != v) return v; /* NaN stays NaN (resolve_marked in torch_backend.py skips it too) */
    const int64_t K = a->K;
    const float *tq = a->tq + c * K, *sq = a->sq + c * K;
    int64_t lo = 0, hi = K; /* binary search: p = the number of knots <= v (NaN: 0) */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (tq[mid] <= v) lo = mid + 1;
        else hi = mid;
    }
    int64_t last = lo > 0 ? lo - 1 : 0, first = last;
    while (first > 0 && tq[first - 1] == tq[last]) first--;
    float y = exact_at(v, lo, tq, sq, first, K);
    if (a->tail != TAIL_EQ1) {
        float lines[4];
        tail_lines(a, c, lines);
        if (v < tq[1]) y = lines[0] * v + lines[1];
        if (v >= tq[K - 2]) y = lines[2] * v + lines[3];
    }
    return y;
}

/* Marks cell `cell` of a table (see the section comment). */
static void mark_cell(float *tab, int64_t cell) {
    tab[2 * cell] = NAN;
    tab[2 * cell + 1] = NAN;
}

/* The table cell of value v: cell 0 below lo, 1..cells on the grid, cells + 1 from hi on; the float
   is clamped before the conversion and NaN goes to cell 0. map_row computes the same, in line. */
static int64_t cell_of(float v, float lo, float inv, int64_t cells) {
    float t = (v - lo) * inv + 1.0f;
    t = t > 0.0f ? t : 0.0f;
    t = t < (float)(cells + 1) ? t : (float)(cells + 1);
    return (int64_t)t;
}

/* tab[2 * cell] is the slope and tab[2 * cell + 1] the intercept of each cell's line (NaN: marked). */
static void build_table(const map_args *a, int64_t c, float *values, float *tab, int32_t *run_start,
                        float *lo_out, float *inv_out) {
    float *grid = values + a->cells + 1;                   /* cells + 1 */
    int32_t *below = (int32_t *)(grid + a->cells + 1);     /* cells + 2 */
    const int64_t K = a->K, cells = a->cells;
    const float *tq = a->tq + c * K, *sq = a->sq + c * K;
    for (int64_t k = 0; k < K; k++) run_start[k] = (k > 0 && tq[k] == tq[k - 1]) ? run_start[k - 1] : (int32_t)k;
    float lo = tq[1], hi = tq[K - 2];
    /* The grid in double where hi - lo overflows float (knots spanning more than FLT_MAX). */
    const int wide = !isfinite(hi - lo);
    const double step = wide ? ((double)hi - (double)lo) / (double)cells : 0.0;
    float width = wide ? (float)step : (hi - lo) / (float)cells;
    float inv = width > 0 ? 1.0f / width : 0.0f;
    int overflow = !(inv <= FLT_MAX); /* a subnormal width: every value goes to cell 1, marked */
    if (overflow) inv = 0.0f;
    /* The grid points, the number of knots <= each, then exact_at at each point: eight at a time
       with AVX2, the same float operations lane by lane. */
    if (wide) {
        for (int64_t j = 0; j <= cells; j++) grid[j] = (float)((double)lo + step * (double)j);
    } else {
        for (int32_t j = 0; j <= (int32_t)cells; j++) grid[j] = lo + width * (float)j; /* int32: vectorized */
    }
    /* below[j] = the number of knots <= grid[j] (the grid ascends): each knot's first grid point at or
       above it, from its estimated cell corrected against the grid, is counted, then the counts summed.
       The knots are independent of each other, where a merge would chain every grid point's load. */
    memset(below, 0, sizeof(int32_t) * (size_t)(cells + 2));
    for (int64_t k = 0; k < K; k++) {
        const float v = tq[k];
        int64_t j = 0;
        if (v > grid[cells]) {
            j = cells + 1;
        } else if (v > grid[0]) { /* then grid[cells] > grid[0] */
            double e = ((double)v - (double)grid[0]) / ((double)grid[cells] - (double)grid[0]) * (double)cells;
            j = e < 1.0 ? 1 : (e > (double)cells ? cells : (int64_t)e);
            while (j > 0 && grid[j - 1] >= v) j--;
            while (j <= cells && grid[j] < v) j++;
        }
        below[j]++;
    }
    for (int64_t j = 1; j <= cells; j++) below[j] += below[j - 1];
    int64_t j0 = 0;
#ifdef __AVX2__
    for (; j0 + 8 <= cells + 1; j0 += 8) _mm256_storeu_ps(values + j0, exact_at8(grid + j0, below + j0, tq, sq, run_start, K));
#endif
    for (int64_t j = j0; j <= cells; j++) {
        int64_t pj = below[j];
        values[j] = exact_at(grid[j], pj, tq, sq, run_start[pj > 0 ? pj - 1 : 0], K);
    }
    float lines[4];
    tail_lines(a, c, lines);
    tab[0] = lines[0];
    tab[1] = lines[1];
    for (int64_t j = 0; j < cells; j++) {
        float s = (values[j + 1] - values[j]) * inv;
        tab[2 * j + 2] = s;
        tab[2 * j + 3] = values[j] - s * grid[j];
    }
    tab[2 * cells + 2] = lines[2];
    tab[2 * cells + 3] = lines[3];
    /* All knots equal (every value of the batch is that value, and goes to cell 1): the exact map's
       value there, the middle level (values[0]) for Eq. 1 tails, the upper tail line's otherwise. */
    if (tq[0] == tq[K - 1] && a->tail != TAIL_EQ1) tab[3] = lines[2] * tq[0] + lines[3];
    int nonfinite = 0; /* an exponent of all ones: inf or NaN (an integer test, vectorized) */
    for (int64_t i = 0; i < 2 * (cells + 2); i++) {
        uint32_t bits;
        memcpy(&bits, tab + i, sizeof bits);
        nonfinite |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    for (int64_t cell = 0; nonfinite && cell < cells + 2; cell++) {
        if (!isfinite(tab[2 * cell]) || !isfinite(tab[2 * cell + 1])) mark_cell(tab, cell);
    }
    if (overflow) mark_cell(tab, 1);
    if (tq[0] != tq[K - 1]) { /* the jumps at tied knots */
        for (int64_t k = 0; k < K; k++) {
            int tied = (k > 0 && tq[k] == tq[k - 1]) || (k + 1 < K && tq[k] == tq[k + 1]);
            if (!tied) continue;
            int64_t cell = cell_of(tq[k], lo, inv, cells);
            for (int64_t d = cell > 0 ? cell - 1 : 0; d <= cell + 1 && d <= cells + 1; d++) mark_cell(tab, d);
        }
    }
    *lo_out = lo;
    *inv_out = inv;
}

#ifdef __AVX2__
/* ys[l] = exact_value of vs[l] for each lane l set in `marked` (of `lanes`): the values of marked
   cells, or NaN inputs. Lane l belongs to channel c + l * dc (dc = 0: one channel, dc = 1: channels
   side by side). */
static void resolve_lanes(const map_args *a, int64_t c, int64_t dc, const float *vs, float *ys, unsigned marked,
                          int lanes) {
    for (int l = 0; l < lanes; l++) {
        if (marked >> l & 1) ys[l] = exact_value(a, c + l * dc, vs[l]);
    }
}

/* The lanes of y that are NaN get exact_value of their v (resolve_lanes, eight lanes). */
static inline __m256 resolve_marked(const map_args *a, int64_t c, int64_t dc, __m256 v, __m256 y) {
    int marked = _mm256_movemask_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
    if (!marked) return y;
    float vs[8], ys[8];
    _mm256_storeu_ps(vs, v);
    _mm256_storeu_ps(ys, y);
    resolve_lanes(a, c, dc, vs, ys, (unsigned)marked, 8);
    return _mm256_loadu_ps(ys);
}
#endif

#ifdef __AVX2__
/* The lanes of yp[0..n) (n a multiple of 8) that map_row left NaN get exact_value of their
   v = pa * xp + pb, recomputed with the same operations. Out of line: a call inside map_row's (or
   map_rows_wide's) loop would make the compiler keep its constants in memory, not in registers. */
__attribute__((noinline)) static void resolve_row(const map_args *a, int64_t c, const float *xp, float *yp, int64_t n,
                                                  float pa, float pb) {
    const __m256 vpa = _mm256_set1_ps(pa), vpb = _mm256_set1_ps(pb);
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 y = _mm256_loadu_ps(yp + i);
        if (!_mm256_movemask_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q))) continue;
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xp + i), vpa), vpb);
        _mm256_storeu_ps(yp + i, resolve_marked(a, c, 0, v, y));
    }
}
#endif

/* Asks for the n floats at p to be brought into the core's cache (a hint, which does nothing where
   the compiler has no builtin for it): a channel's rows are apart by the other channels' values,
   which the hardware prefetcher does not follow from one row to the next. */
static inline void prefetch_floats(const float *p, int64_t n) {
#if defined(__GNUC__) || defined(__clang__)
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 2);
#else
    (void)p, (void)n;
#endif
}

/* The maps bring the next channel's row into cache while they map a row: all at once where it is
   at most this many cache lines, else one line per block of 16 values mapped. A row of 64 lines
   (stage 1 of a ResNet-20, 32 x 32) asked for at once stalls while the line fill buffers are full:
   spread out, such a layer took 7 % less time. Rows of 4 lines (8 x 8) took 5 % more with a
   request inside the loop; rows of 16 lines, the same either way. */
enum { BURST_PREFETCH_LINES = 16 };

/* The next row to bring into cache one line per block (prefetch_floats on 16 values), or NULL
   where the row was asked for at once (a short row) or there is none. */
static const float *spread_prefetch(const float *next, int64_t n) {
    if (!next || n <= 16 * BURST_PREFETCH_LINES) {
        if (next) prefetch_floats(next, n);
        return NULL;
    }
    return next;
}

#ifdef __AVX2__
/* The table map of pa * x + pb for the eight values at xp, into yp; returns which results are NaN. */
static inline int map_block(const float *xp, float *yp, __m256 vpa, __m256 vpb, __m256 vlo, __m256 vinv,
                            __m256 vtop, const float *tab) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xp), vpa), vpb);
    __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, vlo), vinv), one);
    /* max(t, 0) returns its second operand when t is NaN: NaN goes to cell 0, and stays NaN */
    t = _mm256_min_ps(_mm256_max_ps(t, zero), vtop);
    const __m256 y = pair_lookup(tab, _mm256_cvttps_epi32(t), v);
    _mm256_storeu_ps(yp, y);
    return _mm256_movemask_ps(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
}
#endif

/* yp = the table map of pa * xp + pb (pa = 1, pb = 0 leave x as it is, exactly), channel c; `next`
   (NULL: none) is the row of as many values to bring into cache meanwhile (BURST_PREFETCH_LINES). */
static void map_row(const map_args *a, int64_t c, const float *xp, float *yp, int64_t n, float pa, float pb,
                    float lo, float inv, const float *tab, int64_t cells, const float *next) {
    int64_t i = 0;
    const float top = (float)(cells + 1);
    const float *spread = spread_prefetch(next, n);
#ifdef __AVX2__
    const __m256 vlo = _mm256_set1_ps(lo), vinv = _mm256_set1_ps(inv), vtop = _mm256_set1_ps(top);
    const __m256 vpa = _mm256_set1_ps(pa), vpb = _mm256_set1_ps(pb);
    int any = 0;
    if (spread) {
        for (; i + 8 <= n; i += 8) {
            if (i % 16 == 0) prefetch_floats(spread + i, 16);
            any |= map_block(xp + i, yp + i, vpa, vpb, vlo, vinv, vtop, tab);
        }
    } else {
        for (; i + 8 <= n; i += 8) any |= map_block(xp + i, yp + i, vpa, vpb, vlo, vinv, vtop, tab);
    }
    if (any) resolve_row(a, c, xp, yp, i, pa, pb);
#else
    if (spread) prefetch_floats(spread, n); /* no blocks of eight here: the whole row at once */
#endif
    for (; i < n; i++) {
        float v = xp[i] * pa + pb;
        int64_t cell = cell_of(v, lo, inv, cells);
        float y = tab[2 * cell] * v + tab[2 * cell + 1];
        yp[i] = y == y ? y : exact_value(a, c, v);
    }
}

#ifdef AQR_WIDE_LOOKUP
/* map_block on 16 values with AVX-512's gathers. */
AQR_WIDE static inline unsigned map_block_wide(const float *xp, float *yp, __m512 vpa, __m512 vpb, __m512 vlo,
                                               __m512 vinv, __m512 vtop, const float *tab) {
    const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(xp), vpa), vpb);
    __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(v, vlo), vinv), one);
    t = _mm512_min_ps(_mm512_max_ps(t, zero), vtop); /* NaN -> cell 0, as in map_row */
    __m512 y = wide_pair_lookup(tab, _mm512_cvttps_epi32(t), v);
    _mm512_storeu_ps(yp, y);
    return _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
}

/* map_row on 16 values at a time with AVX-512's gathers (where aqr_choose_lookup chose them), on the
   first n values of each of channel c's A rows: the same float operations lane by lane, so the same
   results. Returns how many values of each row it mapped (a multiple of 16); map_row maps the rest.
   One call per channel: a row of a small feature map is only a few blocks of 16. A row with NaN
   results (marked cells, NaN inputs) is passed over again by resolve_row (the same operations,
   eight lanes at a time). */
AQR_WIDE static int64_t map_rows_wide(const map_args *a, int64_t c, int64_t n, float pa, float pb, float lo, float inv,
                                      const float *tab, int64_t cells) {
    const __m512 vlo = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv), vtop = _mm512_set1_ps((float)(cells + 1));
    const __m512 vpa = _mm512_set1_ps(pa), vpb = _mm512_set1_ps(pb);
    const int64_t whole = n / 16 * 16;
    for (int64_t r = 0; r < a->A; r++) {
        const int64_t at = (r * a->C + c) * a->B;
        const float *xp = a->x + at;
        float *yp = a->y + at;
        /* the next channel's row, while this maps (BURST_PREFETCH_LINES) */
        const float *spread = spread_prefetch(c + 1 < a->C ? xp + a->B : NULL, a->B);
        unsigned any = 0;
        if (spread) {
            for (int64_t i = 0; i < whole; i += 16) {
                prefetch_floats(spread + i, 16);
                any |= map_block_wide(xp + i, yp + i, vpa, vpb, vlo, vinv, vtop, tab);
            }
        } else {
            for (int64_t i = 0; i < whole; i += 16) any |= map_block_wide(xp + i, yp + i, vpa, vpb, vlo, vinv, vtop, tab);
        }
        if (any) resolve_row(a, c, xp, yp, whole, pa, pb);
    }
    return whole;
}
#endif

static int64_t map_scratch_bytes(int64_t K, int64_t cells) {
    return round64((int64_t)sizeof(int32_t) * (K + cells + 2) + (int64_t)sizeof(float) * (4 * cells + 6));
}

/* Build channel c's table in this part's scratch and map all of the channel's rows. */
static void map_channel(map_args *a, int part, int64_t c) {
    const int64_t cells = a->cells;
    int32_t *run_start = (int32_t *)(a->scratch + part * map_scratch_bytes(a->K, cells));
    float *tab = (float *)(run_start + a->K); /* the pairs (slope, intercept), read 8 bytes at a time */
    float *values = tab + 2 * (cells + 2);
    float lo, inv;
    build_table(a, c, values, tab, run_start, &lo, &inv);
    float pa = a->pre_scale ? a->pre_scale[c] : 1.0f, pb = a->pre_shift ? a->pre_shift[c] : 0.0f;
    int64_t done = 0;
#ifdef AQR_WIDE_LOOKUP
    if (aqr_wide_lookup) done = map_rows_wide(a, c, a->B, pa, pb, lo, inv, tab, cells);
#endif
    for (int64_t r = 0; done < a->B && r < a->A; r++) {
        int64_t at = (r * a->C + c) * a->B;
        /* the next channel's row, unless map_rows_wide brought it in */
        const float *next = !done && c + 1 < a->C ? a->x + at + a->B : NULL;
        map_row(a, c, a->x + at + done, a->y + at + done, a->B - done, pa, pb, lo, inv, tab, cells, next);
    }
}

static void map_part(void *p, int part, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++) map_channel((map_args *)p, part, c);
}

static void after_channel(quant_args *a, int part, int64_t c) {
    if (a->then_map && a->finite[c]) map_channel(a->then_map, part, c);
}

/* Channels-last layouts (B small, e.g. a ViT's LayerNorm over (tokens, C)): every channel's table
   is built first, then each row of C * B values is mapped with all of them, so the input is read
   in order instead of with a stride of C * B per channel. */
typedef struct {
    map_args *a;
    float *tabs;            /* (C, 2 * (cells + 2)) */
    float *lo, *inv, *pa, *pb; /* (C) */
    int32_t *pair_base;     /* (C): c * (cells + 2), the first pair of channel c */
    float *tiles; /* rows_tiled_part: per part, two (C, tile + 16) blocks; else NULL */
    int64_t tile;
} rows_args;

static void tables_part(void *p, int part, int64_t c0, int64_t c1) {
    rows_args *r = (rows_args *)p;
    map_args *a = r->a;
    const int64_t cells = a->cells;
    int32_t *run_start = (int32_t *)(a->scratch + part * map_scratch_bytes(a->K, cells));
    float *values = (float *)(run_start + a->K) + 2 * (cells + 2);
    for (int64_t c = c0; c < c1; c++) {
        build_table(a, c, values, r->tabs + c * 2 * (cells + 2), run_start, &r->lo[c], &r->inv[c]);
        r->pa[c] = a->pre_scale ? a->pre_scale[c] : 1.0f;
        r->pb[c] = a->pre_shift ? a->pre_shift[c] : 0.0f;
        r->pair_base[c] = (int32_t)(c * (cells + 2));
    }
}

/* Channels per block in rows_part: 16 floats are one cache line, and 16 tables (128 KB at 1024
   cells) stay in L2 while every row's block is mapped. */
enum { CHANNEL_BLOCK = 16 };

static void rows_part(void *p, int part, int64_t r0, int64_t r1) {
    (void)part;
    rows_args *r = (rows_args *)p;
    map_args *a = r->a;
    const int64_t C = a->C, B = a->B, cells = a->cells, stride = 2 * (cells + 2);
    for (int64_t c0 = 0; c0 < C; c0 += CHANNEL_BLOCK) {
        const int64_t c1 = c0 + CHANNEL_BLOCK < C ? c0 + CHANNEL_BLOCK : C;
        for (int64_t row = r0; row < r1; row++) {
            const float *xp = a->x + row * C * B;
            float *yp = a->y + row * C * B;
            int64_t c = c0;
#ifdef __AVX2__
            if (B == 1) { /* eight channels at a time: the lanes look up eight tables */
                const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
                const __m256 vtop = _mm256_set1_ps((float)(cells + 1));
                for (; c + 8 <= c1; c += 8) {
                    __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(xp + c), _mm256_loadu_ps(r->pa + c)),
                                             _mm256_loadu_ps(r->pb + c));
                    __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, _mm256_loadu_ps(r->lo + c)),
                                                           _mm256_loadu_ps(r->inv + c)), one);
                    t = _mm256_min_ps(_mm256_max_ps(t, zero), vtop); /* NaN -> cell 0, as in map_row */
                    __m256i cell = _mm256_add_epi32(_mm256_cvttps_epi32(t),
                                                    _mm256_loadu_si256((const __m256i *)(r->pair_base + c)));
                    _mm256_storeu_ps(yp + c, resolve_marked(a, c, 1, v, pair_lookup(r->tabs, cell, v)));
                }
            }
#endif
            for (; c < c1; c++) {
                map_row(a, c, xp + c * B, yp + c * B, B, r->pa[c], r->pb[c], r->lo[c], r->inv[c], r->tabs + c * stride,
                        cells, NULL);
            }
        }
    }
}

/* Rows of one value per channel (B == 1, e.g. a channels-last (N, H, W, C) convolution output) of
   ROWS_TILED_CHANNELS channels or more, whose C tables do not stay in L2 while rows_part maps every
   row with all of them: a tile of rows is transposed into a channel-major block in cache, each
   channel's part of it mapped by map_row with its own table (the same operations as the
   channel-major layouts, so the same bits) and transposed back into y. On a Zen 3 core at 128
   images of 8 x 8 x 64 values, 1.9 ms against rows_part's 2.5; at 16 channels rows_part is faster. */
enum { ROWS_TILED_CHANNELS = 32, ROWS_TILE_FLOATS = 16384 };

static void rows_tiled_part(void *p, int part, int64_t r0, int64_t r1) {
    rows_args *r = (rows_args *)p;
    map_args *a = r->a;
    const int64_t C = a->C, cells = a->cells, stride = 2 * (cells + 2), T = r->tile;
    const int64_t L = T + 16; /* rows of the block: not a power of two apart (cache sets) */
    float *in = r->tiles + part * 2 * C * L, *out = in + C * L;
    const float *rows[8];
    for (int64_t t0 = r0; t0 < r1; t0 += T) {
        const int64_t n = t0 + T < r1 ? T : r1 - t0;
        for (int64_t i = 0; i < n; i += 8) {
            const int64_t m = i + 8 <= n ? 8 : n - i;
            for (int64_t k = 0; k < m; k++) rows[k] = a->x + (t0 + i + k) * C;
            rows_to_channels(rows, m, C, 1, in + i, L);
        }
        for (int64_t c = 0; c < C; c++) {
            map_row(a, c, in + c * L, out + c * L, n, r->pa[c], r->pb[c], r->lo[c], r->inv[c], r->tabs + c * stride,
                    cells, NULL);
        }
        int64_t i = 0;
#ifdef __AVX2__
        for (; i + 8 <= n; i += 8) { /* back: the (C, 8) block of rows i.. is eight rows of C values */
            int64_t c = 0;
            for (; c + 8 <= C; c += 8) {
                const float *src[8];
                for (int k = 0; k < 8; k++) src[k] = out + (c + k) * L + i;
                transpose8(src, a->y + (t0 + i) * C + c, C);
            }
            for (; c < C; c++) {
                for (int k = 0; k < 8; k++) a->y[(t0 + i + k) * C + c] = out[c * L + i + k];
            }
        }
#endif
        for (; i < n; i++) {
            for (int64_t c = 0; c < C; c++) a->y[(t0 + i) * C + c] = out[c * L + i];
        }
    }
}

/* y (A, C, B) = the recalibration of pre_scale * x + pre_shift (per channel; NULL: x itself) with
   target knots tq and source knots sq (C, K), and the given tail strategy; mean, std, loc, scale
   (C) and z (2) are read by the parametric tails only. Returns 0, -1 when scratch memory failed, or
   -2 for sizes out of bounds or a missing array. */
static int table_map(const float *x, float *y, int64_t A, int64_t C, int64_t B, const float *pre_scale,
                     const float *pre_shift, const float *tq, const float *sq, int64_t K, int tail,
                     const float *mean, const float *std, const float *loc, const float *scale,
                     const double *z, int64_t cells, int nthreads) {
    if (!sizes_ok(A, C, B, K, cells) || !tail_ok(tail, mean, std, loc, scale, z)) return AQR_BAD_ARGUMENT;
    int parts = num_parts(C, nthreads);
    char *scratch = malloc((size_t)(parts * map_scratch_bytes(K, cells)));
    if (!scratch) return -1;
    map_args a = {x, y, A, C, B, pre_scale, pre_shift, tq, sq, K, tail, mean, std, 1, loc, scale, z, cells, scratch};
    if (B >= ROWS_LAYOUT_BELOW) {
        parallel_for(map_part, &a, C, parts);
        free(scratch);
        return 0;
    }
    float *tabs = malloc(sizeof(float) * (size_t)(C * (2 * (cells + 2) + 4)));
    int32_t *pair_base = malloc(sizeof(int32_t) * (size_t)C);
    const int tiled = B == 1 && C >= ROWS_TILED_CHANNELS, row_parts = num_parts(A, nthreads);
    int64_t tile = ROWS_TILE_FLOATS / C / 8 * 8;
    tile = tile < 16 ? 16 : tile;
    /* per part: two (C, tile + 16) blocks (rows_tiled_part) */
    float *tiles = tiled ? malloc(sizeof(float) * (size_t)(row_parts * 2 * C * (tile + 16))) : NULL;
    int status = -1;
    if (tabs && pair_base && (tiles || !tiled)) {
        float *per_channel = tabs + C * 2 * (cells + 2);
        rows_args r = {&a, tabs, per_channel, per_channel + C, per_channel + 2 * C, per_channel + 3 * C, pair_base,
                       tiles, tile};
        parallel_for(tables_part, &r, C, parts);
        parallel_for(tiled ? rows_tiled_part : rows_part, &r, A, row_parts);
        status = 0;
    }
    free(tiles);
    free(tabs);
    free(pair_base);
    free(scratch);
    return status;
}

/* Channel-major layouts (B >= ROWS_LAYOUT_BELOW): aqr_subset_quantiles and aqr_table_map in one
   pass per channel. A channel's values are read for its extremes and sample, then mapped while
   they are still in cache, which saves one read of the layer output from memory. Channels whose
   values are not all finite are left unmapped (finite[c] = 0). tq (C, K), moments (C, 2) and
   finite (C) are outputs a caller may pass NULL for (then kept in scratch: one allocation fewer
   per layer for a caller that only wants y); moments are computed where given or where the tail
   reads them (the parametric tails). Returns the number of channels left unmapped (0: every value
   was finite), -1 when scratch memory failed, or -2 for a channels-last layout, sizes, positions
   or ranks out of bounds, or a missing array. */
static int recalibrate(const float *x, float *y, int64_t A, int64_t C, int64_t B, const int64_t *pos,
                       const float *pre_scale, const float *pre_shift, int64_t S, int64_t K,
                       const int64_t *rank_lo, const float *frac, int64_t nbins, int64_t crowded,
                       const float *sq, int tail, const float *loc, const float *scale, const double *z,
                       int64_t cells, float *tq, float *moments, int32_t *finite, int nthreads) {
    int sample = B >= ROWS_LAYOUT_BELOW && sizes_ok(A, C, B, K, cells) ? sample_ok(A, C, B, pos, S, K, rank_lo, nbins) : 0;
    /* the moments are given or made here: only the source's arrays are checked */
    if (!sample || !tail_ok(tail, &tail, &tail, loc, scale, z)) return AQR_BAD_ARGUMENT;
    int parts = num_parts(C, nthreads);
    char *qscratch = malloc((size_t)(parts * quant_scratch_bytes(S, nbins, K)));
    char *mscratch = malloc((size_t)(parts * map_scratch_bytes(K, cells)));
    float *ext = malloc(sizeof(float) * (size_t)(2 * C));
    int32_t *ext_nan = malloc(sizeof(int32_t) * (size_t)C);
    /* the outputs not given: (C, K) knots, (C, 2) moments, (C) finite flags */
    void *own = malloc(sizeof(float) * (size_t)(C * K + 2 * C) + sizeof(int32_t) * (size_t)C);
    int status = AQR_NO_MEMORY;
    if (qscratch && mscratch && ext && ext_nan && own) {
        float *own_tq = (float *)own, *own_moments = own_tq + C * K;
        tq = tq ? tq : own_tq;
        moments = moments ? moments : (tail_parametric(tail) ? own_moments : NULL);
        finite = finite ? finite : (int32_t *)(own_moments + 2 * C);
        map_args m = {x, y, A, C, B, pre_scale, pre_shift, tq, sq, K, tail, moments, moments ? moments + 1 : NULL,
                      2, loc, scale, z, cells, mscratch};
        quant_args q = {x, pos, B, pre_scale, pre_shift, S, K, nbins, crowded, A, C, B, x, rank_lo, frac, tq, moments,
                        finite, qscratch, NULL, ext, ext + C, ext_nan, &m, sample == 2};
        parallel_for(quantiles_part, &q, C, parts);
        status = 0;
        for (int64_t c = 0; c < C; c++) status += !finite[c];
    }
    free(qscratch);
    free(mscratch);
    free(ext);
    free(ext_nan);
    free(own);
    return status;
}

/* ------------------------------------------------------------------------------------------------
 * The entry points: each takes its descriptor (what stays the same for a layer and batch shape, so
 * threads may share one) and the batch's arrays. */

/* Where a layer's sample is read and how its quantiles are interpolated: a layer output (A, C, B),
   S flat positions pos of channel 0 (channel c at pos + c * B), type-7 ranks rank_lo / frac (K) of
   the sorted sample, a histogram of nbins buckets, those holding more than crowded values sorted. */
#define AQR_SAMPLE_FIELDS(F, ST)                                                                    \
    F(ST, I, int64_t, A) F(ST, I, int64_t, C) F(ST, I, int64_t, B) F(ST, P, const int64_t *, pos)  \
    F(ST, I, int64_t, S) F(ST, I, int64_t, K) F(ST, P, const int64_t *, rank_lo)                   \
    F(ST, P, const float *, frac) F(ST, I, int64_t, nbins) F(ST, I, int64_t, crowded)
/* The source side of a map: knots sq (C, K), the tail code and the parametric tails' loc, scale (C)
   and z (2), and the cells of each channel's table. */
#define AQR_SOURCE_FIELDS(F, ST)                                                                    \
    F(ST, P, const float *, sq) F(ST, C, int, tail) F(ST, P, const float *, loc)                   \
    F(ST, P, const float *, scale) F(ST, P, const double *, z) F(ST, I, int64_t, cells)
#define AQR_MAP_FIELDS(F, ST)                                                                       \
    F(ST, I, int64_t, A) F(ST, I, int64_t, C) F(ST, I, int64_t, B) F(ST, I, int64_t, K)           \
    F(ST, P, const float *, tq) F(ST, P, const float *, mean) F(ST, P, const float *, std)        \
    AQR_SOURCE_FIELDS(F, ST)
/* The outputs tq (C, K), moments (C, 2) and finite (C), each NULL for scratch of the kernel's own (so
   that threads can share one descriptor). */
#define AQR_RECALIBRATE_FIELDS(F, ST)                                                               \
    AQR_SAMPLE_FIELDS(F, ST) AQR_SOURCE_FIELDS(F, ST) F(ST, P, float *, tq) F(ST, P, float *, moments) \
    F(ST, P, int32_t *, finite)

AQR_DESCRIPTOR(aqr_sample, AQR_SAMPLE_FIELDS)
AQR_DESCRIPTOR(aqr_map, AQR_MAP_FIELDS)
AQR_DESCRIPTOR(aqr_recalibration, AQR_RECALIBRATE_FIELDS)

static const aqr_layout LAYOUTS[] = {AQR_LAYOUT(aqr_sample), AQR_LAYOUT(aqr_map), AQR_LAYOUT(aqr_recalibration)};

const aqr_layout *aqr_layouts(int64_t *count) {
    *count = (int64_t)(sizeof LAYOUTS / sizeof LAYOUTS[0]);
    return LAYOUTS;
}

/* subset_quantiles of x on the sample s. */
int aqr_subset_quantiles(const aqr_sample *s, const float *x, const float *pre_scale, const float *pre_shift,
                         float *tq, float *moments, int32_t *finite, int nthreads) {
    if (!s) return AQR_BAD_ARGUMENT;
    return subset_quantiles(x, s->A, s->C, s->B, s->pos, pre_scale, pre_shift, s->S, s->K, s->rank_lo, s->frac,
                            s->nbins, s->crowded, tq, moments, finite, nthreads);
}

/* table_map of x into y with the targets and source of m. */
int aqr_table_map(const aqr_map *m, const float *x, float *y, const float *pre_scale, const float *pre_shift,
                  int nthreads) {
    if (!m) return AQR_BAD_ARGUMENT;
    return table_map(x, y, m->A, m->C, m->B, pre_scale, pre_shift, m->tq, m->sq, m->K, m->tail, m->mean, m->std,
                     m->loc, m->scale, m->z, m->cells, nthreads);
}

/* recalibrate of x into y on the sample and source of r. */
int aqr_recalibrate(const aqr_recalibration *r, const float *x, float *y, const float *pre_scale,
                    const float *pre_shift, int nthreads) {
    if (!r) return AQR_BAD_ARGUMENT;
    return recalibrate(x, y, r->A, r->C, r->B, r->pos, pre_scale, pre_shift, r->S, r->K, r->rank_lo, r->frac,
                       r->nbins, r->crowded, r->sq, r->tail, r->loc, r->scale, r->z, r->cells, r->tq, r->moments,
                       r->finite, nthreads);
}
