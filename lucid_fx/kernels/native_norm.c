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

/* Group norm of 8-bit codes (lucid_fx.kernels.norms.cpu_group_norm): batch samples of c channels of
 * inner values each, contiguous (N, C, inner) or channels-last (N, inner, C). Per sample, the sums of
 * each channel's codes and of their squares are exact (int32 over at most 2^15 values at a time, then
 * int64), and a group's mean and variance come from them in double. Each channel's map from a code to
 * the output grid is then one affine step, x * a[k] + b[k], with a = rstd * weight / out_scale and
 * b = (bias - mean * rstd * weight) / out_scale computed in double: a float32 multiply and add a code
 * (values within float32 rounding of torch's four steps), rounded to the output code. Where tail is
 * given (a following table lookup: SiLU's, or a dequantize's float table), the codes go through it in
 * a second pass (LUT's vectorized lookup). The inner loops run over a plane (contiguous) or a pixel's
 * channels (channels-last) with no branch, which the compiler vectorizes. Returns 0, or -1 when the
 * scratch cannot be allocated (the caller runs torch's kernel). One thread. */
#include <stdlib.h>

#define GROUP_NORM_CODES(SUFFIX, CODE)                                                                 \
    static void group_sums_##SUFFIX(const CODE *restrict x, int64_t c, int64_t inner, int32_t channels_last, \
                                    int64_t *restrict sum, int64_t *restrict square, int32_t *restrict acc) { \
        for (int64_t k = 0; k < c; k++) sum[k] = 0, square[k] = 0;                                    \
        if (!channels_last) {                                                                         \
            for (int64_t k = 0; k < c; k++)                                                           \
                for (int64_t i0 = 0; i0 < inner; i0 += 1 << 15) {                                     \
                    const CODE *restrict p = x + k * inner;                                           \
                    const int64_t end = inner - i0 < (1 << 15) ? inner : i0 + (1 << 15);              \
                    int32_t s = 0, q = 0;                                                             \
                    for (int64_t i = i0; i < end; i++) s += p[i], q += (int32_t)p[i] * p[i];          \
                    sum[k] += s, square[k] += q;                                                      \
                }                                                                                     \
            return;                                                                                   \
        }                                                                                             \
        int32_t *restrict as = acc, *restrict aq = acc + c;                                           \
        for (int64_t p0 = 0; p0 < inner; p0 += 1 << 15) {                                             \
            const int64_t end = inner - p0 < (1 << 15) ? inner : p0 + (1 << 15);                      \
            for (int64_t k = 0; k < c; k++) as[k] = 0, aq[k] = 0;                                     \
            for (int64_t p = p0; p < end; p++) {                                                      \
                const CODE *restrict row = x + p * c;                                                 \
                for (int64_t k = 0; k < c; k++) as[k] += row[k], aq[k] += (int32_t)row[k] * row[k];   \
            }                                                                                         \
            for (int64_t k = 0; k < c; k++) sum[k] += as[k], square[k] += aq[k];                      \
        }                                                                                             \
    }                                                                                                 \
    static void group_steps_##SUFFIX(const CODE *restrict x, CODE *restrict y, int64_t c, int64_t inner,  \
                                     int32_t channels_last, const float *restrict a, const float *restrict b, \
                                     float lo, float hi, int32_t zp) {                                \
        if (channels_last) {                                                                          \
            for (int64_t p = 0; p < inner; p++)                                                       \
                for (int64_t k = 0; k < c; k++)                                                       \
                    y[p * c + k] = (CODE)REQUANTIZE((float)x[p * c + k] * a[k] + b[k], lo, hi, zp);   \
            return;                                                                                   \
        }                                                                                             \
        for (int64_t k = 0; k < c; k++) {                                                             \
            const float ak = a[k], bk = b[k];                                                         \
            for (int64_t i = 0; i < inner; i++)                                                       \
                y[k * inner + i] = (CODE)REQUANTIZE((float)x[k * inner + i] * ak + bk, lo, hi, zp);   \
        }                                                                                             \
    }
GROUP_NORM_CODES(u8, uint8_t)
GROUP_NORM_CODES(s8, int8_t)

void lucid_lut_uint8(const uint8_t *, const uint8_t *, uint8_t *, int64_t, int32_t);
void lucid_lut_int8(const uint8_t *, const int8_t *, int8_t *, int64_t, int32_t);
void lucid_lut_float32(const uint8_t *, const float *, float *, int64_t, int32_t);

#define GROUP_NORM(NAME, OUT, LUT)                                                                     \
    int32_t NAME(const uint8_t *restrict q, OUT *restrict out, int64_t batch, int64_t c, int64_t inner,  \
                 int32_t groups, int32_t channels_last, int32_t signed_codes, float eps,               \
                 const float *restrict weight, const float *restrict bias, float inv_out, int32_t out_zp, \
                 int32_t low, int32_t high, const OUT *restrict tail) {                                \
        const float lo = (float)(low - out_zp), hi = (float)(high - out_zp);                          \
        const int64_t per = c / groups, sample = c * inner;                                           \
        int64_t *sums = malloc(sizeof(int64_t) * 2 * c);                                              \
        int32_t *acc = malloc(sizeof(int32_t) * 2 * c);                                               \
        float *steps = malloc(sizeof(float) * 2 * c);                                                 \
        uint8_t *codes = tail ? malloc((size_t)sample) : (uint8_t *)out;                              \
        if (!sums || !acc || !steps || !codes) {                                                      \
            free(sums), free(acc), free(steps);                                                       \
            if (tail) free(codes);                                                                    \
            return -1;                                                                                \
        }                                                                                             \
        float *a = steps, *b = steps + c;                                                             \
        for (int64_t n = 0; n < batch; n++) {                                                         \
            const uint8_t *x = q + n * sample;                                                        \
            uint8_t *y = tail ? codes : (uint8_t *)out + n * sample;                                  \
            if (signed_codes)                                                                         \
                group_sums_s8((const int8_t *)x, c, inner, channels_last, sums, sums + c, acc);       \
            else                                                                                      \
                group_sums_u8(x, c, inner, channels_last, sums, sums + c, acc);                       \
            for (int32_t g = 0; g < groups; g++) {                                                    \
                int64_t s = 0, sq = 0;                                                                \
                for (int64_t k = g * per; k < (g + 1) * per; k++) s += sums[k], sq += sums[c + k];    \
                const double count = (double)(per * inner), mean = (double)s / count;                 \
                const double var = ((double)sq - (double)s * mean) / count;                           \
                const double rstd = 1.0 / sqrt((var > 0.0 ? var : 0.0) + (double)eps);                \
                for (int64_t k = g * per; k < (g + 1) * per; k++) {                                   \
                    const double slope = rstd * (weight ? weight[k] : 1.0);                           \
                    a[k] = (float)(slope * inv_out);                                                  \
                    b[k] = (float)(((bias ? bias[k] : 0.0) - mean * slope) * inv_out);                \
                }                                                                                     \
            }                                                                                         \
            if (signed_codes)                                                                         \
                group_steps_s8((const int8_t *)x, (int8_t *)y, c, inner, channels_last, a, b, lo, hi, out_zp); \
            else                                                                                      \
                group_steps_u8(x, y, c, inner, channels_last, a, b, lo, hi, out_zp);                  \
            if (tail) LUT(y, tail, out + n * sample, sample, signed_codes ? 128 : 0);                 \
        }                                                                                             \
        free(sums), free(acc), free(steps);                                                           \
        if (tail) free(codes);                                                                        \
        return 0;                                                                                     \
    }

GROUP_NORM(lucid_group_norm_uint8, uint8_t, lucid_lut_uint8)
GROUP_NORM(lucid_group_norm_int8, int8_t, lucid_lut_int8)
GROUP_NORM(lucid_group_norm_float32, float, lucid_lut_float32)
