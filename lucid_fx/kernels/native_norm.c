/* Layer norm and RMS norm of 8-bit codes, codes out (lucid_fx.kernels.norms.cpu_layer_norm and
 * cpu_rms_norm), rows of n codes.
 *
 * The statistics are those of the codes centred on zp, (x - zp): their sum and sum of squares are
 * exact in int32 for rows of fewer than 2^15 codes (65025 * 2^15 < 2^31), so the mean and variance
 * come from exact sums, in double. Layer norm ignores the shift (it subtracts the mean); RMS norm
 * does not (its mean is 0). eps is the caller's, already in codes' units (divided by scale^2, as the
 * values are the codes times scale). Then per code, in float32, one rounding a step:
 * y = ((x - zp) - mean) * rstd, times weight, plus bias; the output code is quant's:
 * rint(y * inv_out), clamped to [low - out_zp, high - out_zp], plus out_zp. The statistics of a
 * block of rows are computed together, so that short rows (ConvNeXt's 16 channels) do not wait on
 * one square root after another. */
#include <math.h>

#include "native_codes.h"

#define NORM_BLOCK 64

#if defined(__AVX2__)
#include <immintrin.h>
#include <string.h>
/* 8 codes from x widened to int32 and centred on zp: uint8 or int8 (SIGNED). */
static inline __m256i norm_load8(const void *x, int signed_codes, __m256i zp) {
    int64_t bytes;
    memcpy(&bytes, x, 8);
    const __m128i v = _mm_cvtsi64_si128(bytes);
    return _mm256_sub_epi32(signed_codes ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v), zp);
}
static inline int32_t norm_hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
/* The float32 steps of 8 codes, the same operations in the same order as the scalar ones: vcvtps2dq
 * rounds half to even as rintf does; the clamp is max then min, as REQUANTIZE's compare-and-select. */
static inline void norm_store8(void *y, int signed_codes, __m256i c, __m256 m, __m256 s, const float *w,
                               const float *b, __m256 inv, __m256 lo, __m256 hi, __m256i zp) {
    __m256 v = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(c), m), s);
    if (w) v = _mm256_mul_ps(v, _mm256_loadu_ps(w));
    if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b));
    v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, inv), lo), hi);
    const __m256i codes = _mm256_add_epi32(_mm256_cvtps_epi32(v), zp);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64((__m128i *)y, signed_codes ? _mm_packs_epi16(words, words) : _mm_packus_epi16(words, words));
}
#define NORM_AVX2 1
#else
#define NORM_AVX2 0
#endif

#if NORM_AVX2
#define NORM_SUMS8                                                                                    \
    {                                                                                                 \
        __m256i vs = _mm256_setzero_si256(), vq = vs;                                                 \
        for (; j + 8 <= n; j += 8) {                                                                  \
            const __m256i v = norm_load8(x + j, signed_codes, vzp);                                         \
            vs = _mm256_add_epi32(vs, v), vq = _mm256_add_epi32(vq, _mm256_mullo_epi32(v, v));         \
        }                                                                                             \
        sum = norm_hsum(vs), square = norm_hsum(vq);                                                  \
    }
#define NORM_STEPS8                                                                                   \
    for (; j + 8 <= n; j += 8)                                                                        \
        norm_store8(y + j, signed_codes, norm_load8(x + j, signed_codes, vzp), _mm256_set1_ps(m), _mm256_set1_ps(s), \
                    weight ? weight + j : NULL, bias ? bias + j : NULL, vinv, vlo, vhi, vout_zp);
#define NORM_VECTORS                                                                                  \
    const __m256i vzp = _mm256_set1_epi32(zp), vout_zp = _mm256_set1_epi32(out_zp);                  \
    const __m256 vinv = _mm256_set1_ps(inv_out), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
#else
#define NORM_SUMS8
#define NORM_STEPS8
#define NORM_VECTORS
#endif

#define NORM(NAME, CODE, SIGNED)                                                                      \
    void NAME(const CODE *restrict q, CODE *restrict out, int64_t rows, int64_t n, int32_t zp, int32_t rms, \
              float eps, const float *restrict weight, const float *restrict bias, float inv_out,        \
              int32_t out_zp, int32_t low, int32_t high) {                                           \
        const float lo = (float)(low - out_zp), hi = (float)(high - out_zp);                         \
        const double inv_n = 1.0 / (double)n;                                                        \
        const int signed_codes = SIGNED;                                                             \
        (void)signed_codes;                                                                          \
        NORM_VECTORS                                                                                  \
        float mean[NORM_BLOCK], rstd[NORM_BLOCK];                                                    \
        double sums[NORM_BLOCK], squares[NORM_BLOCK];                                                \
        for (int64_t r0 = 0; r0 < rows; r0 += NORM_BLOCK) {                                          \
            const int64_t block = rows - r0 < NORM_BLOCK ? rows - r0 : NORM_BLOCK;                   \
            for (int64_t b = 0; b < block; b++) {                                                    \
                const CODE *x = q + (r0 + b) * n;                                                    \
                int32_t sum = 0, square = 0;                                                         \
                int64_t j = 0;                                                                       \
                NORM_SUMS8                                                                           \
                for (; j < n; j++) {                                                                 \
                    const int32_t v = (int32_t)x[j] - zp;                                            \
                    sum += v, square += v * v;                                                       \
                }                                                                                    \
                sums[b] = (double)sum, squares[b] = (double)square;                                  \
            }                                                                                        \
            for (int64_t b = 0; b < block; b++) {                                                    \
                const double m = rms ? 0.0 : sums[b] * inv_n;                                        \
                const double var = (squares[b] - sums[b] * m) * inv_n;                               \
                mean[b] = (float)m;                                                                  \
                rstd[b] = (float)(1.0 / sqrt((var > 0.0 ? var : 0.0) + (double)eps));                \
            }                                                                                        \
            for (int64_t b = 0; b < block; b++) {                                                    \
                const CODE *x = q + (r0 + b) * n;                                                    \
                CODE *y = out + (r0 + b) * n;                                                        \
                const float m = mean[b], s = rstd[b];                                                \
                int64_t j = 0;                                                                       \
                NORM_STEPS8                                                                          \
                for (; j < n; j++) {                                                                 \
                    float v = ((float)((int32_t)x[j] - zp) - m) * s;                                 \
                    if (weight) v = v * weight[j];                                                   \
                    if (bias) v = v + bias[j];                                                       \
                    y[j] = (CODE)REQUANTIZE(v * inv_out, lo, hi, out_zp);                            \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

NORM(lucid_norm_uint8, uint8_t, 0)
NORM(lucid_norm_int8, int8_t, 1)

int32_t lucid_norm_vectorized(void) { return NORM_AVX2; }
