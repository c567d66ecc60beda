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
 * in elements (0 along a broadcast batch dim). out is contiguous (batch..., m, n).
 *
 * Each batch's operands are centred into int16 first, zero-padded: a as rows of kp values (m rounded
 * up to 4 rows, kp = k rounded up to 2), b as pairs of rows interleaved, [kp / 2][np][2] (np = n
 * rounded up to 16). The packing loops write along the packed rows and read along a contiguous
 * dimension where there is one (keys transposed: each pair of a key's values together, the key
 * block staying in L1), so the compiler vectorizes them; written the other way round, with a store
 * every 512 bytes, packing a transposed key took a third of q @ k^T's time. With AVX2 a step
 * broadcasts two values of each of 4 rows of a and multiplies them with 16 columns' pairs
 * (vpmaddwd: two products summed into each int32 lane), 4 rows x 16 outputs at a time, no
 * horizontal sums; the 16 sums of a row are requantized, packed to codes and stored together.
 * Without AVX2 a plain loop computes the same sums. Returns 0, or -1 when the buffers cannot be
 * allocated (nothing written then). */
#include <stdlib.h>
#include <string.h>

#include "native_codes.h" /* REQUANTIZE */

#define MM_ROWS 4
#define MM_COLS 16

#if defined(__AVX2__)
#include <immintrin.h>
#define MATMUL_AVX2 1

/* rint(clamp(sum * mult)) + zp of 8 sums: the scalar REQUANTIZE's steps (one float32 multiply, the
 * clamp, round half to even as vcvtps2dq does), bit for bit; sums are finite, so min/max clamp as
 * the scalar compare does. */
static inline __m256i requantize8(__m256i sums, __m256 mult, __m256 lo, __m256 hi, __m256i zp) {
    const __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), mult), hi), lo);
    return _mm256_add_epi32(_mm256_cvtps_epi32(v), zp);
}

/* 16 codes from two vectors of 8 (already within the code range, so the saturating packs are exact). */
static inline __m128i pack16_uint8_t(__m256i lo8, __m256i hi8) {
    const __m128i a = _mm_packs_epi32(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1));
    const __m128i b = _mm_packs_epi32(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1));
    return _mm_packus_epi16(a, b);
}
static inline __m128i pack16_int8_t(__m256i lo8, __m256i hi8) {
    const __m128i a = _mm_packs_epi32(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1));
    const __m128i b = _mm_packs_epi32(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1));
    return _mm_packs_epi16(a, b);
}

/* The codes of rows i..i+3, columns j..j+15 (those below m and n written). */
#define MATMUL_BLOCK(CODE)                                                                         \
    {                                                                                              \
        __m256i acc[MM_ROWS][2];                                                                   \
        for (int r = 0; r < MM_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();         \
        for (int64_t p = 0; p < kp / 2; p++) {                                                     \
            const int16_t *w = pb + (p * np + j) * 2;                                              \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);                            \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 16));                     \
            for (int r = 0; r < MM_ROWS; r++) {                                                    \
                int32_t pair;                                                                      \
                memcpy(&pair, pa + (i + r) * kp + 2 * p, sizeof pair);                             \
                const __m256i x = _mm256_set1_epi32(pair);                                         \
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(x, w0));                 \
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(x, w1));                 \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MM_ROWS && i + r < m; r++) {                                           \
            const __m128i codes = pack16_##CODE(requantize8(acc[r][0], vmult, vlo, vhi, vzp),      \
                                                requantize8(acc[r][1], vmult, vlo, vhi, vzp));     \
            CODE *row = out + (i + r) * n + j;                                                     \
            if (j + MM_COLS <= n) _mm_storeu_si128((__m128i *)row, codes);                         \
            else {                                                                                 \
                CODE tail[MM_COLS];                                                                \
                _mm_storeu_si128((__m128i *)tail, codes);                                          \
                memcpy(row, tail, (size_t)(n - j) * sizeof *row);                                  \
            }                                                                                      \
        }                                                                                          \
    }
#else
#define MATMUL_AVX2 0
#define MATMUL_BLOCK(CODE)                                                                         \
    for (int64_t r = i; r < i + MM_ROWS && r < m; r++)                                             \
        for (int64_t c = j; c < j + MM_COLS && c < n; c++) {                                       \
            int32_t s = 0;                                                                         \
            for (int64_t t = 0; t < kp; t++) s += (int32_t)pa[r * kp + t] * (int32_t)pb[((t / 2) * np + c) * 2 + t % 2]; \
            out[r * n + c] = (CODE)REQUANTIZE((float)s * mult, lo, hi, zp);                        \
        }
#endif

int32_t lucid_matmul_vectorized(void) { return MATMUL_AVX2; }

/* STORE for every i < rows and t < cols, the loop along the smaller of the strides innermost. */
#define PACK(rows, cols, row_stride, col_stride, STORE)                                            \
    if ((col_stride) <= (row_stride)) {                                                            \
        for (int64_t i = 0; i < (rows); i++)                                                       \
            for (int64_t t = 0; t < (cols); t++) STORE;                                            \
    } else {                                                                                       \
        for (int64_t t = 0; t < (cols); t++)                                                       \
            for (int64_t i = 0; i < (rows); i++) STORE;                                            \
    }

#define MATMUL(NAME, CODE)                                                                         \
    int32_t NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out, const int64_t *restrict g, \
                 int32_t a_zp, int32_t b_zp, float mult, int32_t zp, int32_t low, int32_t high) {    \
        const int64_t m = g[4], n = g[5], k = g[6], *sa = g + 7, *sb = g + 13;                     \
        const int64_t kp = k + k % 2, mp = (m + MM_ROWS - 1) / MM_ROWS * MM_ROWS;                  \
        const int64_t np = (n + MM_COLS - 1) / MM_COLS * MM_COLS;                                  \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        (void)lo; (void)hi;                                                                        \
        MATMUL_CONSTANTS                                                                           \
        int16_t *pa = calloc((size_t)(mp * kp + kp * np), sizeof *pa);                             \
        if (!pa) return -1;                                                                        \
        int16_t *pb = pa + mp * kp;                                                                \
        for (int64_t b0 = 0; b0 < g[0]; b0++)                                                      \
        for (int64_t b1 = 0; b1 < g[1]; b1++)                                                      \
        for (int64_t b2 = 0; b2 < g[2]; b2++)                                                      \
        for (int64_t b3 = 0; b3 < g[3]; b3++, out += m * n) {                                      \
            const CODE *x = a + b0 * sa[0] + b1 * sa[1] + b2 * sa[2] + b3 * sa[3];                   \
            const CODE *y = b + b0 * sb[0] + b1 * sb[1] + b2 * sb[2] + b3 * sb[3];                   \
            /* each operand read along its smaller stride (a transposed view of keys: down its columns) */ \
            if (sa[5] == 1) /* rows of a contiguous: a loop the compiler vectorizes */               \
                for (int64_t i = 0; i < m; i++) {                                                  \
                    const CODE *xr = x + i * sa[4];                                                \
                    int16_t *pr = pa + i * kp;                                                     \
                    for (int64_t t = 0; t < k; t++) pr[t] = (int16_t)((int32_t)xr[t] - a_zp);      \
                }                                                                                  \
            else PACK(m, k, sa[4], sa[5], pa[i * kp + t] = (int16_t)((int32_t)x[i * sa[4] + t * sa[5]] - a_zp)) \
            if (sb[5] == 1) /* rows of b contiguous (values): two rows interleaved into pairs */   \
                for (int64_t t = 0; t < k; t += 2) {                                               \
                    const CODE *y0 = y + t * sb[4], *y1 = t + 1 < k ? y0 + sb[4] : NULL;           \
                    int16_t *pr = pb + (t / 2) * np * 2;                                           \
                    if (y1) for (int64_t i = 0; i < n; i++) {                                      \
                        pr[2 * i] = (int16_t)((int32_t)y0[i] - b_zp);                              \
                        pr[2 * i + 1] = (int16_t)((int32_t)y1[i] - b_zp);                          \
                    }                                                                              \
                    else for (int64_t i = 0; i < n; i++) pr[2 * i] = (int16_t)((int32_t)y0[i] - b_zp); \
                }                                                                                  \
            else if (sb[4] == 1) /* columns of b contiguous (keys transposed): each pair read together, */ \
                for (int64_t t = 0; t < k; t += 2) { /* written along the packed row (b stays in L1) */   \
                    int16_t *pr = pb + (t / 2) * np * 2;                                           \
                    if (t + 1 < k) for (int64_t i = 0; i < n; i++) {                               \
                        pr[2 * i] = (int16_t)((int32_t)y[i * sb[5] + t] - b_zp);                   \
                        pr[2 * i + 1] = (int16_t)((int32_t)y[i * sb[5] + t + 1] - b_zp);           \
                    }                                                                              \
                    else for (int64_t i = 0; i < n; i++) pr[2 * i] = (int16_t)((int32_t)y[i * sb[5] + t] - b_zp); \
                }                                                                                  \
            else PACK(n, k, sb[5], sb[4], pb[((t / 2) * np + i) * 2 + t % 2] = (int16_t)((int32_t)y[t * sb[4] + i * sb[5]] - b_zp)) \
            for (int64_t i = 0; i < m; i += MM_ROWS)                                               \
                for (int64_t j = 0; j < n; j += MM_COLS) MATMUL_BLOCK(CODE)                        \
        }                                                                                          \
        free(pa);                                                                                  \
        return 0;                                                                                  \
    }

#if MATMUL_AVX2
#define MATMUL_CONSTANTS                                                                           \
    const __m256 vmult = _mm256_set1_ps(mult), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi); \
    const __m256i vzp = _mm256_set1_epi32(zp);
#else
#define MATMUL_CONSTANTS
#endif

MATMUL(lucid_matmul_uint8, uint8_t)
MATMUL(lucid_matmul_int8, int8_t)
