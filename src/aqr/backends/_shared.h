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
/* slope[cell] * v + icpt[cell] for 8 values, pairs[cell] = (slope, icpt). One 64-bit gather per
   pair: half the gathered elements of two float gathers (Zen 3: 1.4x faster). Cells of values
   0,1,4,5 go to the first gather and 2,3,6,7 to the second, so the in-lane shuffles come out in
   order. */
static inline __m256 pair_lookup(const long long *pairs, __m256i cell, __m256 v) {
    cell = _mm256_permute4x64_epi64(cell, _MM_SHUFFLE(3, 1, 2, 0));
    __m256 p0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(pairs, _mm256_castsi256_si128(cell), 8));
    __m256 p1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(pairs, _mm256_extracti128_si256(cell, 1), 8));
    __m256 slope = _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(2, 0, 2, 0));
    __m256 icpt = _mm256_shuffle_ps(p0, p1, _MM_SHUFFLE(3, 1, 3, 1));
    return _mm256_add_ps(_mm256_mul_ps(slope, v), icpt);
}
#endif

#endif
