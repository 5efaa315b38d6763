/* What aqr's C kernels share: the thread team they split their work over (defined in _parallel.c)
 * and the AVX2 lookup of a map's table.
 *
 * Each library aqr builds (aqr/backends/build.py) links its kernels with _parallel.c; Python hands
 * that library torch's OpenMP runtime through aqr_use_openmp. The team's helpers are hidden: they
 * stay inside the library that links them.
 */
#ifndef AQR_SHARED_H
#define AQR_SHARED_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define AQR_HIDDEN __attribute__((visibility("hidden")))
#else
#define AQR_HIDDEN
#endif

enum { MAX_THREADS = 64 };

/* Run fn(arg, part, lo, hi) over [0, n) split into num_parts contiguous parts; the caller runs part 0. */
typedef void (*part_fn)(void *arg, int part, int64_t lo, int64_t hi);

/* The number of parts parallel_for will use for n items (at most MAX_THREADS). */
AQR_HIDDEN int num_parts(int64_t n, int nthreads);

/* fn over [0, n) on torch's OpenMP team when aqr_use_openmp gave it, else on pthreads of our own. */
AQR_HIDDEN void parallel_for(part_fn fn, void *arg, int64_t n, int nthreads);

/* Hands the kernels the OpenMP runtime's GOMP_parallel, omp_get_thread_num and omp_get_num_threads. */
void aqr_use_openmp(void *parallel, void *thread_num, void *num_threads);

#ifdef __AVX2__
/* slope[cell] * v + icpt[cell] for 8 values, tab[2 * cell] = slope and tab[2 * cell + 1] = icpt: each
   pair read by one 8-byte load. Plain loads beat the 64-bit gathers on Zen 3, and they have more of
   the lookups' cache misses in flight. Pairs 0,1,4,5 fill the first register and 2,3,6,7 the second,
   so the in-lane shuffles come out in order. */
static inline __m128d pair_load2(const float *tab, int32_t i, int32_t j) {
    double a, b; /* memcpy: the pairs are floats, read 8 bytes at a time */
    memcpy(&a, tab + 2 * (int64_t)i, sizeof a);
    memcpy(&b, tab + 2 * (int64_t)j, sizeof b);
    return _mm_setr_pd(a, b);
}

static inline __m256 pair_lookup(const float *tab, __m256i cell, __m256 v) {
    int32_t at[8];
    _mm256_storeu_si256((__m256i *)at, cell);
    const __m256d p0 = _mm256_insertf128_pd(_mm256_castpd128_pd256(pair_load2(tab, at[0], at[1])),
                                            pair_load2(tab, at[4], at[5]), 1);
    const __m256d p1 = _mm256_insertf128_pd(_mm256_castpd128_pd256(pair_load2(tab, at[2], at[3])),
                                            pair_load2(tab, at[6], at[7]), 1);
    const __m256 slope = _mm256_shuffle_ps(_mm256_castpd_ps(p0), _mm256_castpd_ps(p1), _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 icpt = _mm256_shuffle_ps(_mm256_castpd_ps(p0), _mm256_castpd_ps(p1), _MM_SHUFFLE(3, 1, 3, 1));
    return _mm256_add_ps(_mm256_mul_ps(slope, v), icpt);
}
#endif

#endif
