/* The thread team of aqr's C kernels (declared in _shared.h): linked into every library aqr builds.
 *
 * Plain C99 with pthreads; parallel work runs on torch's OpenMP team when Python found it.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <time.h>

#include "_shared.h"

int num_parts(int64_t n, int nthreads) {
    if (nthreads > n) nthreads = (int)n;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    return nthreads < 1 ? 1 : nthreads;
}

typedef struct {
    part_fn fn;
    void *arg;
    int part;
    int64_t lo, hi;
} part_t;

static void *run_part(void *p) {
    part_t *t = (part_t *)p;
    t->fn(t->arg, t->part, t->lo, t->hi);
    return NULL;
}

/* The OpenMP runtime torch already runs on, when Python found it (aqr_use_openmp). Its worker
   threads spin for a while after each torch op; threads of our own would compete with them for
   the cores, so parallel work goes to that same team instead. The GOMP entry points are the
   stable libgomp ABI, also exported by LLVM's libomp and Intel's libiomp5. */
typedef void (*gomp_parallel_t)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static gomp_parallel_t gomp_parallel = NULL;
static omp_int_fn omp_thread_num = NULL, omp_num_threads = NULL;

void aqr_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    gomp_parallel = (gomp_parallel_t)parallel;
    omp_thread_num = (omp_int_fn)thread_num;
    omp_num_threads = (omp_int_fn)num_threads;
}

typedef struct {
    part_fn fn;
    void *arg;
    int64_t n;
} team_t;

static void team_body(void *p) {
    team_t *t = (team_t *)p;
    int64_t part = omp_thread_num(), parts = omp_num_threads(); /* the team may be smaller than asked */
    t->fn(t->arg, (int)part, t->n * part / parts, t->n * (part + 1) / parts);
}

void parallel_for(part_fn fn, void *arg, int64_t n, int nthreads) {
    nthreads = num_parts(n, nthreads);
    if (nthreads == 1) {
        fn(arg, 0, 0, n);
        return;
    }
    if (gomp_parallel) {
        team_t team = {fn, arg, n};
        gomp_parallel(team_body, &team, (unsigned)nthreads, 0);
        return;
    }
    pthread_t ids[MAX_THREADS];
    part_t parts[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++) {
        parts[t] = (part_t){fn, arg, t, n * t / nthreads, n * (t + 1) / nthreads};
    }
    for (int t = 1; t < nthreads; t++) {
        started[t] = pthread_create(&ids[t], NULL, run_part, &parts[t]) == 0;
        if (!started[t]) run_part(&parts[t]); /* no thread: do its part here */
    }
    run_part(&parts[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
    }
}

#ifdef AQR_WIDE_LOOKUP
int aqr_wide_lookup = 0;

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* y = the table map of n values x on [0, 1) over a table of `cells` cells, with the AVX2 loads or
   AVX-512's gathers, as the kernels map a row: timed by aqr_choose_lookup. */
static void lookups_avx2(const float *tab, int64_t cells, const float *x, float *y, int64_t n) {
    const __m256 scale = _mm256_set1_ps((float)cells), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 top = _mm256_set1_ps((float)(cells + 1));
    for (int64_t i = 0; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(_mm256_mul_ps(v, scale), one), zero), top);
        _mm256_storeu_ps(y + i, pair_lookup(tab, _mm256_cvttps_epi32(t), v));
    }
}

AQR_WIDE static void lookups_wide(const float *tab, int64_t cells, const float *x, float *y, int64_t n) {
    const __m512 scale = _mm512_set1_ps((float)cells), one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const __m512 top = _mm512_set1_ps((float)(cells + 1));
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(v, scale), one), zero), top);
        _mm512_storeu_ps(y + i, wide_pair_lookup(tab, _mm512_cvttps_epi32(t), v));
    }
}
#endif

/* The lookups this library's kernels use: 0 the AVX2 loads, 1 AVX-512's gathers (where the build and
   the CPU have them), -1 leaves them as they are. Returns the lookup now in use. */
int aqr_set_lookup(int wide) {
#ifdef AQR_WIDE_LOOKUP
    if (wide < 0) return aqr_wide_lookup;
    __builtin_cpu_init();
    aqr_wide_lookup = wide && __builtin_cpu_supports("avx512f");
    return aqr_wide_lookup;
#else
    (void)wide;
    return 0;
#endif
}

/* Sets the faster lookup on this CPU, timed on a map's table of 1,024 cells (best of 7 alternated
   rounds of 32,768 values each, after two untimed ones: about a millisecond in all); both give the
   same results. Returns the lookup chosen, as aqr_set_lookup. */
int aqr_choose_lookup(void) {
#ifdef AQR_WIDE_LOOKUP
    if (!aqr_set_lookup(1)) return 0;
    enum { CELLS = 1024, N = 32768, ROUNDS = 7 };
    float *tab = malloc(sizeof(float) * 2 * (CELLS + 2) + sizeof(float) * 2 * N);
    if (!tab) return aqr_set_lookup(0);
    float *x = tab + 2 * (CELLS + 2), *y = x + N;
    uint32_t state = 12345u;
    for (int i = 0; i < 2 * (CELLS + 2); i++) tab[i] = (float)i / (float)CELLS;
    for (int i = 0; i < N; i++) {
        state = state * 1664525u + 1013904223u; /* a linear congruential sequence */
        x[i] = (float)(state >> 8) / 16777216.0f;
    }
    double best[2] = {1e30, 1e30};
    for (int r = -2; r < ROUNDS; r++) { /* two rounds untimed: the pages, the clock, the wide units warm up */
        for (int w = 0; w < 2; w++) {
            double t = seconds();
            if (w) lookups_wide(tab, CELLS, x, y, N);
            else lookups_avx2(tab, CELLS, x, y, N);
            t = seconds() - t;
            if (r >= 0) best[w] = t < best[w] ? t : best[w];
        }
    }
    free(tab);
    return aqr_set_lookup(best[1] < best[0]);
#else
    return 0;
#endif
}
