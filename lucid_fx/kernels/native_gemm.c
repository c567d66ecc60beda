/* lucid_fx's native int8 GEMM: uint8 codes times int8 weights, of at most 7 bits without VNNI, any
 * with it, with the float steps after the int32 sums fused in (compiled with native.c, see there).
 *
 * out = FINISH(((acc + offset[j]) * x_scale) * w_scale[j] + bias[j]), acc = sum_k x[i,k] * w[j,k]:
 * one float32 rounding per step (-ffp-contract=off, and the intrinsics below are separate multiplies
 * and adds). Codes are rint(clamp(y * inv_out + zp, low, high)); a float result is y clamped to
 * [low, high]. The vector steps give the scalar ones' values bit for bit: the same operations in the
 * same order, the clamp as compare-and-select, and vcvtps2dq rounds half to even as rintf does.
 *
 * The weight is packed once (lucid_fx.kernels.linear_native.packed_weight): blocks of 16 outputs by 4
 * inputs, [ceil(N/16)][ceil(K/4)][16][4], zero-padded. With AVX2 a step broadcasts 4 input codes of
 * a row, multiplies them with the block's 64 weights (vpmaddubsw: u8 x s8, adjacent pairs summed in
 * int16) and sums the pairs into 8 int32 lanes per 8 outputs (vpmaddwd by 1), 4 rows at a time. A
 * pair sum is exact while |w| <= 64: 2 * 255 * 64 = 32640 <= 32767 (the weight grid of CPUs without
 * VNNI, lucid_fx.kernels.target.NARROW_GRID; the caller checks). With VNNI one vpdpbusd per 8 outputs
 * replaces the two multiplies and the add, exact for any weight (native_gemm.h's GEMM_STEP). Without
 * AVX2 a plain loop computes the same values. */
#include "native_gemm.h"
#include "native_threads.h" /* lucid_threads */

#if GEMM_AVX2
#define GEMM_LOAD(r) (memcpy(&v, x + (r) * k + g * GEMM_KB, GEMM_KB), v) /* one 4-byte load */
/* The steps of one block: the full ones, then the last, zero-padded, if k % 4. */
#define GEMM_STEPS(STEPS)                                                                             \
    const __m256i ones = _mm256_set1_epi16(1);                                                        \
    const int64_t full = k / GEMM_KB;                                                                 \
    int32_t v;                                                                                        \
    for (int64_t g = 0; g <= full; g++) {                                                             \
        if (g == full && full * GEMM_KB == k) break;                                                  \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + g * 64));                        \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + g * 64 + 32));                   \
        if (g < full) { STEPS(GEMM_LOAD) }                                                            \
        else { STEPS(GEMM_TAIL) }                                                                     \
    }
#define GEMM_TAIL(r) gemm_x4(x + (r) * k, g, k)
#define GEMM_STEPS4(LOAD) GEMM_STEP(0, LOAD(0)) GEMM_STEP(1, LOAD(1)) GEMM_STEP(2, LOAD(2)) GEMM_STEP(3, LOAD(3))
#define GEMM_STEPS1(LOAD) GEMM_STEP(0, LOAD(0))

/* Four rows of x (k codes each) with one packed block of 16 outputs, finished into out's rows. */
static void gemm_block4(const uint8_t *x, int64_t k, const int8_t *w, int64_t j0, int64_t n,
                        const gemm_finish_t *f, char *out) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    GEMM_STEPS(GEMM_STEPS4)
    const size_t row = n * gemm_size(f->kind), at = j0 * gemm_size(f->kind);
    gemm_finish16(a00, a01, j0, n, f, out + at);
    gemm_finish16(a10, a11, j0, n, f, out + row + at);
    gemm_finish16(a20, a21, j0, n, f, out + 2 * row + at);
    gemm_finish16(a30, a31, j0, n, f, out + 3 * row + at);
}

/* Two or three rows, the block's weights read once for them all, their steps alternating between two sets of
 * sums (int32 sums are exact in any order: the same values), so that the chains of dependent steps are as many as
 * the four-row kernel's or more. 1 x 1024 x 1024 takes 27 us (AVX512-VNNI EPYC, 1 thread), four rows 33; two rows
 * one at a time took 56, in one pass of one set of sums 40, so: 26. For the rows past the four-row steps. */
#define GEMM_STEPS2(LOAD) \
    if (g & 1) { GEMM_STEP(2, LOAD(0)) GEMM_STEP(3, LOAD(1)) } else { GEMM_STEP(0, LOAD(0)) GEMM_STEP(1, LOAD(1)) }
#define GEMM_STEPS3(LOAD)                                                                             \
    if (g & 1) { GEMM_STEP(3, LOAD(0)) GEMM_STEP(4, LOAD(1)) GEMM_STEP(5, LOAD(2)) }                  \
    else { GEMM_STEP(0, LOAD(0)) GEMM_STEP(1, LOAD(1)) GEMM_STEP(2, LOAD(2)) }
static void gemm_block2or3(const uint8_t *x, int64_t k, const int8_t *w, int64_t j0, int64_t n,
                           const gemm_finish_t *f, char *out, int rows) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    __m256i a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    const size_t row = n * gemm_size(f->kind), at = j0 * gemm_size(f->kind);
    if (rows == 2) {
        GEMM_STEPS(GEMM_STEPS2)
        gemm_finish16(_mm256_add_epi32(a00, a20), _mm256_add_epi32(a01, a21), j0, n, f, out + at);
        gemm_finish16(_mm256_add_epi32(a10, a30), _mm256_add_epi32(a11, a31), j0, n, f, out + row + at);
        return;
    }
    GEMM_STEPS(GEMM_STEPS3)
    gemm_finish16(_mm256_add_epi32(a00, a30), _mm256_add_epi32(a01, a31), j0, n, f, out + at);
    gemm_finish16(_mm256_add_epi32(a10, a40), _mm256_add_epi32(a11, a41), j0, n, f, out + row + at);
    gemm_finish16(_mm256_add_epi32(a20, a50), _mm256_add_epi32(a21, a51), j0, n, f, out + 2 * row + at);
}

static void gemm_block1(const uint8_t *x, int64_t k, const int8_t *w, int64_t j0, int64_t n,
                        const gemm_finish_t *f, char *out) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00;
    GEMM_STEPS(GEMM_STEPS1)
    gemm_finish16(a00, a01, j0, n, f, out + j0 * gemm_size(f->kind));
}
#endif

/* With AVX-512's VNNI, eight rows meet two packed blocks at once: a block's step (16 outputs by 4 inputs) is one
 * 64-byte load and one 512-bit vpdpbusd per row, so a step is two loads and eight broadcasts for sixteen
 * vpdpbusd into sixteen independent sums (the 256-bit kernel above: two loads and four broadcasts for eight,
 * whose chains of dependent steps a VNNI unit's latency stalls). The int32 sums are the same, exactly; the
 * float steps are gemm_finish16's. Measured (AVX512-VNNI EPYC, 1 thread, the float GEMM alone, us, 256-bit kernel
 * against this one): 48.7 / 45.0 at 8 x 1024 x 1024, 350 / 332 at 64, 1524 / 1434 at 64 x 1024 -> 4096, 629 / 598
 * at 197 x 768 x 768; with 64 inputs 8-14% slower, so from GEMM_ZMM_K inputs. Rows past a multiple of 8 and an odd
 * last block take the 256-bit kernel. */
#if GEMM_AVX2 && GEMM_VNNI && defined(__AVX512F__) && defined(__AVX512VNNI__)
#define GEMM_ZMM 1
#define GEMM_ZMM_ROWS 8
#define GEMM_ZMM_K 256 /* fewer inputs: the 256-bit kernel, measured as fast or faster (8-14% at 64) */
/* One row's step: its 4 codes broadcast, times the blocks' weights (the second block's only for two). Named sums,
 * not arrays: with arrays (and the intrinsic) GCC 12 copied every sum to another register each step, two through
 * the stack; named, with the asm's tied operand, the loop is loads, broadcasts and vpdpbusd alone. Measured, 1
 * thread, AVX512-VNNI EPYC, us before / after, two alternating runs: 825, 653 / 624, 617 at 64 x 1024 -> 2048;
 * 325, 327 / 332, 311 at 64 x 1024 -> 1024 (this core's vpdpbusd peak, measured alone: ~230 GMAC/s; the GEMM
 * reaches 200-218 at 64 rows). */
#define GEMM_ZMM_STEP(r, LOAD)                                                                        \
    {                                                                                                 \
        const __m512i xv = _mm512_set1_epi32(LOAD(r));                                                \
        GEMM_ZMM_DOT(s0##r, xv, w0);                                                                  \
        if (BLOCKS == 2) GEMM_ZMM_DOT(s1##r, xv, w1);                                                 \
    }
/* acc += the four u8 x s8 products of each lane, in one register (the asm's tied operand; see above). */
#define GEMM_ZMM_DOT(acc, xv, w) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(xv), "v"(w))
#define GEMM_ZMM_ROWS8(LOAD)                                                                          \
    GEMM_ZMM_STEP(0, LOAD) GEMM_ZMM_STEP(1, LOAD) GEMM_ZMM_STEP(2, LOAD) GEMM_ZMM_STEP(3, LOAD)       \
    GEMM_ZMM_STEP(4, LOAD) GEMM_ZMM_STEP(5, LOAD) GEMM_ZMM_STEP(6, LOAD) GEMM_ZMM_STEP(7, LOAD)
#define GEMM_ZMM_FULL(r) (memcpy(&v, x + (r) * k + g * GEMM_KB, GEMM_KB), v)
#define GEMM_ZMM_TAIL(r) gemm_x4(x + (r) * k, g, k)
#define GEMM_ZMM_FINISH(r)                                                                            \
    gemm_finish16(_mm512_castsi512_si256(s0##r), _mm512_extracti64x4_epi64(s0##r, 1), j0, n, f,      \
                  out + (r) * row + j0 * size);                                                       \
    if (BLOCKS == 2)                                                                                  \
        gemm_finish16(_mm512_castsi512_si256(s1##r), _mm512_extracti64x4_epi64(s1##r, 1), j0 + GEMM_NB, n, f, \
                      out + (r) * row + (j0 + GEMM_NB) * size);
#define GEMM_ZMM_KERNEL(NAME, BLOCKS_)                                                                \
    static void NAME(const uint8_t *x, int64_t k, const int8_t *wa, const int8_t *wb, int64_t j0, int64_t n, \
                     const gemm_finish_t *f, char *out) {                                             \
        enum { BLOCKS = BLOCKS_ };                                                                    \
        __m512i s00 = _mm512_setzero_si512(), s01 = s00, s02 = s00, s03 = s00, s04 = s00, s05 = s00, s06 = s00, \
                s07 = s00, s10 = s00, s11 = s00, s12 = s00, s13 = s00, s14 = s00, s15 = s00, s16 = s00, s17 = s00; \
        const int64_t full = k / GEMM_KB;                                                             \
        int32_t v;                                                                                    \
        int64_t g = 0;                                                                                \
        for (; g < full; g++) {                                                                       \
            const __m512i w0 = _mm512_loadu_si512((const void *)(wa + g * 64));                       \
            const __m512i w1 = BLOCKS == 2 ? _mm512_loadu_si512((const void *)(wb + g * 64)) : w0;    \
            GEMM_ZMM_ROWS8(GEMM_ZMM_FULL)                                                             \
        }                                                                                             \
        if (full * GEMM_KB < k) { /* the k % 4 last codes, zero-padded as the packed weights are */   \
            const __m512i w0 = _mm512_loadu_si512((const void *)(wa + g * 64));                       \
            const __m512i w1 = BLOCKS == 2 ? _mm512_loadu_si512((const void *)(wb + g * 64)) : w0;    \
            GEMM_ZMM_ROWS8(GEMM_ZMM_TAIL)                                                             \
        }                                                                                             \
        (void)wb;                                                                                     \
        const size_t size = gemm_size(f->kind), row = n * size;                                       \
        GEMM_ZMM_FINISH(0) GEMM_ZMM_FINISH(1) GEMM_ZMM_FINISH(2) GEMM_ZMM_FINISH(3)                   \
        GEMM_ZMM_FINISH(4) GEMM_ZMM_FINISH(5) GEMM_ZMM_FINISH(6) GEMM_ZMM_FINISH(7)                   \
    }
GEMM_ZMM_KERNEL(gemm_zmm2, 2) /* blocks b and b + 1 */
GEMM_ZMM_KERNEL(gemm_zmm1, 1) /* an odd last block alone (wb unread) */
#else
#define GEMM_ZMM 0
#endif

int32_t lucid_gemm_vectorized(void) { return GEMM_AVX2; }
/* Whether this build's sums are exact for every int8 weight (VNNI), not only |w| <= 64. */
int32_t lucid_gemm_full_grid(void) { return GEMM_VNNI; }
/* Whether this build's GEMM splits its output columns among the caller's OpenMP threads (-fopenmp). */
#ifdef _OPENMP
int32_t lucid_gemm_threaded(void) { return 1; }
#else
int32_t lucid_gemm_threaded(void) { return 0; }
#endif

/* Rows [i0, end) with blocks b and b + 1 (the pair the AVX-512 kernel takes together; a lone last block alone).
 * Flattened: GCC 12 kept gemm_finish16 a call, its constants read again each time; inlined, 1 thread, us: 175-180
 * against 217 at 3136 x 64 -> 64, 97-100 against 142 at 784 x 40 -> 240, 39 against 65 at 4 x 1024 -> 1024 (the
 * VNNI kernels of an AMX Xeon, its tiles off; its MobileNet- and EfficientNet-like models, whose 1x1 convolutions
 * run elsewhere there, unchanged). The same operations: the same values. */
__attribute__((flatten)) static void gemm_pair(const uint8_t *x, const int8_t *packed, char *out, int64_t n, int64_t k, const gemm_finish_t *f,
                      int64_t i0, int64_t end, int64_t b, int64_t nb, int64_t kg, size_t size) {
    const int8_t *w = packed + b * kg * GEMM_NB * GEMM_KB;
    const int two = b + 1 < nb;
#if GEMM_AVX2
    int64_t i = i0;
#if GEMM_ZMM
    for (; k >= GEMM_ZMM_K && i + GEMM_ZMM_ROWS <= end; i += GEMM_ZMM_ROWS) { /* eight rows at a time (from 256 inputs) */
        if (two) gemm_zmm2(x + i * k, k, w, w + kg * GEMM_NB * GEMM_KB, b * GEMM_NB, n, f, out + i * n * size);
        else gemm_zmm1(x + i * k, k, w, w, b * GEMM_NB, n, f, out + i * n * size);
    }
#endif
    const int64_t done = i; /* the rows left take the 256-bit kernel, for both blocks */
    for (int64_t c = 0; c <= two; c++) {
        const int8_t *wc = w + c * kg * GEMM_NB * GEMM_KB;
        for (i = done; i + 4 <= end; i += 4) gemm_block4(x + i * k, k, wc, (b + c) * GEMM_NB, n, f, out + i * n * size);
        if (end - i >= 2) gemm_block2or3(x + i * k, k, wc, (b + c) * GEMM_NB, n, f, out + i * n * size, (int)(end - i));
        else if (i < end) gemm_block1(x + i * k, k, wc, (b + c) * GEMM_NB, n, f, out + i * n * size);
    }
#else
    for (int64_t c = 0; c <= two; c++)
        for (int64_t i = i0; i < end; i++)
            for (int64_t j = (b + c) * GEMM_NB; j < n && j < (b + c + 1) * GEMM_NB; j++) {
                const int8_t *wc = w + c * kg * GEMM_NB * GEMM_KB;
                int32_t s = 0;
                for (int64_t kk = 0; kk < k; kk++)
                    s += (int32_t)x[i * k + kk] * wc[(kk / GEMM_KB) * 64 + (j % GEMM_NB) * GEMM_KB + kk % GEMM_KB];
                gemm_finish1(s, j, f, out + (i * n + j) * size);
            }
#endif
}

/* Threads of the caller's OpenMP pool for an m x n x k product (native_threads.h), at most one a pair of blocks. */
static int gemm_threads(int64_t m, int64_t n, int64_t k, int64_t pairs) { return lucid_threads(m * n * k, GEMM_PARALLEL_MNK, pairs); }

/* Each output element is one thread's, computed as with one thread: the result never depends on the count. The
 * entry points (native_gemm_entry.c) run a product here where the AMX tiles (native_amx.c) do not take it. */
void lucid_gemm_kernels(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                        const gemm_finish_t *f) {
    const int64_t nb = (n + GEMM_NB - 1) / GEMM_NB, kg = (k + GEMM_KB - 1) / GEMM_KB, tile = gemm_tile(m, k);
    const int64_t pairs = (nb + 1) / 2;
    const size_t size = gemm_size(f->kind);
    const int threads = gemm_threads(m, n, k, pairs);
    (void)threads; /* read by the OpenMP pragma alone */
    for (int64_t i0 = 0; i0 < m; i0 += tile) { /* a tile of rows meets every block while it is in cache */
        const int64_t end = i0 + tile < m ? i0 + tile : m;
        LUCID_PARALLEL_FOR(threads)
        for (int64_t p = 0; p < pairs; p++) gemm_pair(x, packed, (char *)out, n, k, f, i0, end, 2 * p, nb, kg, size);
    }
}
