/* What aqr's C kernels share: the thread team they split their work over (defined in _parallel.c)
 * and the AVX2 lookup of a map's table.
 *
 * Each library aqr builds (aqr/backends/build.py) links its kernels with _parallel.c; Python hands
 * that library torch's OpenMP runtime through aqr_use_openmp. The team's helpers are hidden: they
 * stay inside the library that links them.
 */
#ifndef AQR_SHARED_H
#define AQR_SHARED_H

#include <stddef.h>
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

/* Descriptor structs. An entry point takes at most 8 arguments: the rest travel in a struct whose fields
 * are listed once, as an X-macro of F(ST, kind, type, name) (ST the struct, kind P for a pointer, I for
 * int64_t, D for double, C for int). AQR_DESCRIPTOR declares the struct from that list and AQR_LAYOUT
 * lists each field's name, kind, offset and size, in the library's aqr_layouts table; the Python side
 * (aqr/backends/layout.py) builds its ctypes structures from that table when the library loads and
 * checks that its own offsets and sizes agree with it, so the two sides cannot drift apart. */
typedef struct {
    const char *name, *kind;
    int64_t offset, size;
} aqr_field;

typedef struct {
    const char *name;
    int64_t size, nfields;
    const aqr_field *fields;
} aqr_layout;

#define AQR_FIELD_MEMBER(ST, kind, type, name) type name;
#define AQR_FIELD_ROW(ST, kind, type, name) {#name, #kind, (int64_t)offsetof(ST, name), (int64_t)sizeof(((ST *)0)->name)},
#define AQR_DESCRIPTOR(ST, FIELDS)                \
    typedef struct { FIELDS(AQR_FIELD_MEMBER, ST) } ST; \
    static const aqr_field ST##_fields[] = {FIELDS(AQR_FIELD_ROW, ST)};
#define AQR_LAYOUT(ST) {#ST, (int64_t)sizeof(ST), (int64_t)(sizeof ST##_fields / sizeof(aqr_field)), ST##_fields}

/* Each library's table of its descriptors: *count of them (defined beside its kernels). */
const aqr_layout *aqr_layouts(int64_t *count);

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
#if defined(__GNUC__) || defined(__clang__)
    /* read the indices back from memory: compilers otherwise extract them from the register, eight
       shuffles on one port where loads take two (a map of 131,072 values: 0.62 ns a value, not 0.82) */
    __asm__("" : "+m"(at));
#endif
    const __m256d p0 = _mm256_insertf128_pd(_mm256_castpd128_pd256(pair_load2(tab, at[0], at[1])),
                                            pair_load2(tab, at[4], at[5]), 1);
    const __m256d p1 = _mm256_insertf128_pd(_mm256_castpd128_pd256(pair_load2(tab, at[2], at[3])),
                                            pair_load2(tab, at[6], at[7]), 1);
    const __m256 slope = _mm256_shuffle_ps(_mm256_castpd_ps(p0), _mm256_castpd_ps(p1), _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 icpt = _mm256_shuffle_ps(_mm256_castpd_ps(p0), _mm256_castpd_ps(p1), _MM_SHUFFLE(3, 1, 3, 1));
    return _mm256_add_ps(_mm256_mul_ps(slope, v), icpt);
}
#endif

/* AVX-512 lookups, compiled for any x86-64 build with AVX2 and taken where the CPU has AVX-512 and
   aqr_choose_lookup timed them faster than the AVX2 loads (they are not on every such CPU: the
   gathers are slow where microcode mitigates Gather Data Sampling). */
#if defined(__AVX2__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define AQR_WIDE_LOOKUP 1
#define AQR_WIDE __attribute__((target("avx512f")))

/* Whether the kernels of this library use the AVX-512 lookups (set by aqr_choose_lookup). */
AQR_HIDDEN extern int aqr_wide_lookup;

/* slope[cell] * v + icpt[cell] for 16 values: two gathers of 8 pairs (8 bytes each), deinterleaved. */
AQR_WIDE static inline __m512 wide_pair_lookup(const float *tab, __m512i cell, __m512 v) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512 p0 = _mm512_castpd_ps(_mm512_i32gather_pd(_mm512_castsi512_si256(cell), (const double *)tab, 8));
    const __m512 p1 = _mm512_castpd_ps(_mm512_i32gather_pd(_mm512_extracti64x4_epi64(cell, 1), (const double *)tab, 8));
    const __m512 slope = _mm512_permutex2var_ps(p0, even, p1), icpt = _mm512_permutex2var_ps(p0, odd, p1);
    return _mm512_add_ps(_mm512_mul_ps(slope, v), icpt);
}
#endif

#endif
