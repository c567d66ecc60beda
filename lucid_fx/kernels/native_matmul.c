/* The batched product of two 8-bit code tensors (attention's q @ k^T and p @ v), compiled with
 * native.c (see there):
 *
 *   out[b, i, j] = requantize(sum_k (a[b, i, k] - a_zp) * (b[b, k, j] - b_zp) * mult)
 *
 * with the sums exact in int32. program_ops.matmul_codes sums the same products in float32, which is
 * exact too while every partial sum stays within 2^24 (the caller checks k * max|a - a_zp| *
 * max|b - b_zp| <= 2^24), then makes the same float32 multiply: the codes are equal bit for bit.
 *
 * g: the 4 batch sizes (outermost first), m, n, k; then a's strides (4 batch, row, column) and b's,
 * in elements (0 along a broadcast batch dim). out is contiguous (batch..., m, n). Each batch's
 * operands are centred into int16 rows first (a as m x k, b transposed as n x k, zero-padded to 16),
 * so a sum is a dot product of two int16 rows: vpmaddwd with AVX2, 4 outputs at a time. Returns 0,
 * or -1 when the buffer cannot be allocated (nothing written then). */
#include <stdlib.h>

#include "native_codes.h" /* REQUANTIZE */

#if defined(__AVX2__)
#include <immintrin.h>

static inline int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* The sums of row x (kp int16) with rows y..y+count-1 (count <= 4), into sums[0..count). */
static inline void dot_rows(const int16_t *x, const int16_t *y, int64_t kp, int count, int32_t *sums) {
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t k = 0; k < kp; k += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x + k));
        for (int t = 0; t < count; t++)
            acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(v, _mm256_loadu_si256((const __m256i *)(y + t * kp + k))));
    }
    for (int t = 0; t < count; t++) sums[t] = hsum8(acc[t]);
}
#else
static inline void dot_rows(const int16_t *x, const int16_t *y, int64_t kp, int count, int32_t *sums) {
    for (int t = 0; t < count; t++) {
        int32_t s = 0;
        for (int64_t k = 0; k < kp; k++) s += (int32_t)x[k] * (int32_t)y[t * kp + k];
        sums[t] = s;
    }
}
#endif

int32_t lucid_matmul_vectorized(void) {
#if defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}

#define MATMUL(NAME, CODE)                                                                         \
    int32_t NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out, const int64_t *restrict g, \
                 int32_t a_zp, int32_t b_zp, float mult, int32_t zp, int32_t low, int32_t high) {    \
        const int64_t m = g[4], n = g[5], k = g[6], *sa = g + 7, *sb = g + 13, kp = (k + 15) & ~(int64_t)15; \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        int16_t *pa = calloc((size_t)((m + n) * kp), sizeof *pa);                                  \
        if (!pa) return -1;                                                                        \
        int16_t *pb = pa + m * kp;                                                                 \
        int32_t sums[4];                                                                           \
        for (int64_t b0 = 0; b0 < g[0]; b0++)                                                      \
        for (int64_t b1 = 0; b1 < g[1]; b1++)                                                      \
        for (int64_t b2 = 0; b2 < g[2]; b2++)                                                      \
        for (int64_t b3 = 0; b3 < g[3]; b3++) {                                                    \
            const CODE *x = a + b0 * sa[0] + b1 * sa[1] + b2 * sa[2] + b3 * sa[3];                   \
            const CODE *y = b + b0 * sb[0] + b1 * sb[1] + b2 * sb[2] + b3 * sb[3];                   \
            for (int64_t i = 0; i < m; i++)                                                        \
                for (int64_t t = 0; t < k; t++) pa[i * kp + t] = (int16_t)((int32_t)x[i * sa[4] + t * sa[5]] - a_zp); \
            for (int64_t j = 0; j < n; j++)                                                        \
                for (int64_t t = 0; t < k; t++) pb[j * kp + t] = (int16_t)((int32_t)y[t * sb[4] + j * sb[5]] - b_zp); \
            for (int64_t i = 0; i < m; i++, out += n)                                              \
                for (int64_t j = 0; j < n; j += 4) {                                               \
                    const int count = n - j < 4 ? (int)(n - j) : 4;                                \
                    dot_rows(pa + i * kp, pb + j * kp, kp, count, sums);                           \
                    for (int t = 0; t < count; t++) out[j + t] = (CODE)REQUANTIZE((float)sums[t] * mult, lo, hi, zp); \
                }                                                                                  \
        }                                                                                          \
        free(pa);                                                                                  \
        return 0;                                                                                  \
    }

MATMUL(lucid_matmul_uint8, uint8_t)
MATMUL(lucid_matmul_int8, int8_t)
