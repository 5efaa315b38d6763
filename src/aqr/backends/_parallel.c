/* The thread team of aqr's C kernels (declared in _shared.h): linked into every library aqr builds.
 *
 * Plain C99 with pthreads; parallel work runs on torch's OpenMP team when Python found it.
 */
#include <pthread.h>
#include <stddef.h>

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
