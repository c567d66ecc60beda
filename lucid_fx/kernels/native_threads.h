/* How lucid_fx's native kernels split a loop among the caller's OpenMP threads (torch's pool: the library links
 * libgomp.so.1, the runtime PyPI's torch loads, so torch.set_num_threads sets the count; a build without -fopenmp
 * runs every loop on one thread). A split never changes a value: each output is written by one thread, computed
 * as with one thread (sums of integers in any order are the same integers). */
#ifndef LUCID_NATIVE_THREADS_H
#define LUCID_NATIVE_THREADS_H
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Below this many elements a pass (a quantize, a lookup, squeeze-excite's product, a pool's sums) runs on one
 * thread. Measured, AVX512-VNNI EPYC, 1 / 2 threads, us: a gate product of 1.2M codes 245 / 126-129, of 132K 27-28 / 17-18;
 * a quantize of 1.2M floats 113 / 60-64, of 132K 16 / 10-12. A threshold of 16K instead of 64K made no difference in the
 * MobileNet- and EfficientNet-like models of benchmarks/models.py (the cost of waking the pool is not measured). */
#define LUCID_PARALLEL_ELEMENTS 65536

/* Threads for `work` units where one thread should have at least `least / 2` of them, at most `parts` (the
 * pieces the loop can split into), at most the pool's: 1 below `least`. */
static inline int lucid_threads(int64_t work, int64_t least, int64_t parts) {
#ifdef _OPENMP
    if (work < least || parts < 2) return 1;
    const int64_t most = omp_get_max_threads(), by_work = 1 + work / least;
    const int64_t t = most < by_work ? most : by_work;
    return (int)(t < parts ? t : parts);
#else
    (void)work, (void)least, (void)parts;
    return 1;
#endif
}

#define LUCID_PRAGMA(x) _Pragma(#x)
#ifdef _OPENMP
#define LUCID_PARALLEL_FOR(threads) LUCID_PRAGMA(omp parallel for num_threads(threads) if ((threads) > 1) schedule(static))
#define LUCID_ATOMIC LUCID_PRAGMA(omp atomic) /* the next statement, an update of a shared variable, one thread at a time */
#else
#define LUCID_PARALLEL_FOR(threads)
#define LUCID_ATOMIC
#endif

/* The statements after the arguments once per chunk [from, to) of [0, n) (number `chunk`, 0 to threads - 1) on
 * `threads` threads, the chunks' bounds multiples of `align` (a vector loop's step: each chunk's vector part as one
 * thread's would be). */
#define LUCID_SPLIT(n, align, threads, ...)                                                           \
    {                                                                                                 \
        const int threads_ = (threads);                                                               \
        const int64_t n_ = (n), per_ = ((n_ + threads_ - 1) / threads_ + (align) - 1) / (align) * (align); \
        LUCID_PARALLEL_FOR(threads_)                                                                  \
        for (int chunk = 0; chunk < threads_; chunk++) {                                              \
            const int64_t from = chunk * per_ < n_ ? chunk * per_ : n_;                               \
            const int64_t to = from + per_ < n_ ? from + per_ : n_;                                   \
            __VA_ARGS__                                                                               \
        }                                                                                             \
    }

/* Inside LUCID_SPLIT's statements: where `buffer` is NULL (a chunk's scratch not allocated), set `failed` and leave
 * the chunk unwritten (its caller reports the failure). */
#define LUCID_CHUNK_NEEDS(buffer, failed)                                                             \
    if (!(buffer)) {                                                                                  \
        LUCID_ATOMIC                                                                                  \
        (failed) |= 1;                                                                                \
        continue;                                                                                     \
    }

#endif
