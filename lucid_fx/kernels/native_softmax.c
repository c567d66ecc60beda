/* Softmax of 8-bit codes from a table of exponentials (lucid_fx/kernels/softmax_native.py), compiled
 * with native.c (see there):
 *
 *   e[j] = table[max - q[j]]      (int32: round(exp(-d * scale) * 2^23), d = 0..255)
 *   s    = sum_j e[j]             (int64: exact, in any order)
 *   r    = (float)(1.0 / s)       (one double division per row, rounded to float32)
 *   out[j] = requantize((float)e[j] * r * mult)
 *
 * program_ops.softmax_codes's steps one for one, so its codes bit for bit: the sums are exact
 * integers and every float step is one IEEE operation in the same order. Codes are laid out as
 * (outer, n, inner), dense, softmax along n (inner 1 for the last dim); keep (or NULL), one byte
 * per code in the same layout, marks the positions a mask leaves (program_ops.softmax_keep). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_math.h" /* exp_below_zero */
#include "native_threads.h" /* LUCID_SPLIT */

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SOFTMAX_VBMI 1
/* e[j] = table[top - x[j]] for 64 codes of a row from the table's three low bytes (its values are at
 * most 2^23), each a 256-byte lookup of two VBMI permutes, the bytes then joined into int32, where
 * the compiler gathers: 8x4x128x128 codes 504-574 -> 363-417 us (AVX512-VBMI EPYC, runs alternating). */
static inline __m512i softmax_plane(const __m512i plane[4], __m512i idx, __mmask64 high) {
    const __m512i lo = _mm512_permutex2var_epi8(plane[0], idx, plane[1]); /* the index's low 7 bits */
    return _mm512_mask_blend_epi8(high, lo, _mm512_permutex2var_epi8(plane[2], idx, plane[3]));
}
#define SOFTMAX_JOIN(q)                                                                            \
    _mm512_storeu_si512(e + 16 * (q), _mm512_or_si512(_mm512_or_si512(                            \
        _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b0, q)),                                    \
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b1, q)), 8)),            \
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(b2, q)), 16)))
static inline void softmax_lookup64(const void *x, int32_t top, const __m512i planes[3][4], int32_t *e) {
    const __m512i idx = _mm512_sub_epi8(_mm512_set1_epi8((char)top), _mm512_loadu_si512(x)); /* top - x, mod 256 */
    const __mmask64 high = _mm512_movepi8_mask(idx);
    const __m512i b0 = softmax_plane(planes[0], idx, high), b1 = softmax_plane(planes[1], idx, high);
    const __m512i b2 = softmax_plane(planes[2], idx, high);
    SOFTMAX_JOIN(0);
    SOFTMAX_JOIN(1);
    SOFTMAX_JOIN(2);
    SOFTMAX_JOIN(3);
}
#define SOFTMAX_PLANES                                                                             \
    __m512i planes[3][4];                                                                          \
    {                                                                                              \
        uint8_t bytes[3][256];                                                                     \
        for (int k = 0; k < 3; k++)                                                                \
            for (int d = 0; d < 256; d++) bytes[k][d] = (uint8_t)(table[d] >> (8 * k));            \
        for (int k = 0; k < 3; k++)                                                                \
            for (int r = 0; r < 4; r++) planes[k][r] = _mm512_loadu_si512(bytes[k] + 64 * r);      \
    }
#define SOFTMAX_FAST(STEP)                                                                         \
    if ((STEP) == 1)                                                                               \
        for (; j + 64 <= n; j += 64) softmax_lookup64(x + j, top, (const __m512i(*)[4])planes, e + j);
#else
#define SOFTMAX_PLANES
#define SOFTMAX_FAST(STEP)
#endif

/* One row of n codes a step apart (step 1: loops the compiler vectorizes, the lookups with VBMI as
 * above, else as gathers). Sums of fewer than 256 values stay below 2^31: int32 there, int64 beyond. */
#define SOFTMAX_ROW(CODE, STEP)                                                                    \
    {                                                                                              \
        int32_t top = x[0];                                                                        \
        for (int64_t j = 1; j < n; j++) top = x[j * (STEP)] > top ? x[j * (STEP)] : top;           \
        const int32_t *t = table + top; /* t[-code] = table[top - code] */                       \
        int64_t j = 0;                                                                             \
        SOFTMAX_FAST(STEP)                                                                         \
        for (; j < n; j++) e[j] = t[-(int32_t)x[j * (STEP)]];                                      \
        int64_t sum = 0;                                                                           \
        if (n < 256) {                                                                             \
            int32_t small = 0;                                                                     \
            for (int64_t j = 0; j < n; j++) small += e[j];                                         \
            sum = small;                                                                           \
        } else                                                                                     \
            for (int64_t j = 0; j < n; j++) sum += e[j];                                           \
        const float r = (float)(1.0 / (double)sum);                                                \
        for (int64_t j = 0; j < n; j++) y[j * (STEP)] = (CODE)REQUANTIZE((float)e[j] * r * mult, lo, hi, zp); \
    }

/* The same over the positions keep marks (a mask's complement, in q's layout): the others are
 * probability 0, and a row with none kept is all 0, as program_ops.softmax_codes with keep. */
#define SOFTMAX_KEPT_ROW(CODE, STEP)                                                               \
    {                                                                                              \
        const uint8_t *k = keep + (x - q);                                                         \
        int32_t top = -256;                                                                        \
        for (int64_t j = 0; j < n; j++) {                                                          \
            const int32_t v = k[j * (STEP)] ? x[j * (STEP)] : -256;                                \
            top = v > top ? v : top;                                                               \
        }                                                                                          \
        /* (top - code) & 255 stays inside the table for a masked code too; its value is then cleared */ \
        for (int64_t j = 0; j < n; j++)                                                            \
            e[j] = table[(top - (int32_t)x[j * (STEP)]) & 255] & -(int32_t)(k[j * (STEP)] != 0);   \
        int64_t sum = 0;                                                                           \
        for (int64_t j = 0; j < n; j++) sum += e[j];                                               \
        const float r = sum ? (float)(1.0 / (double)sum) : 0.0f; /* nothing kept: every e is 0 */  \
        for (int64_t j = 0; j < n; j++) y[j * (STEP)] = (CODE)REQUANTIZE((float)e[j] * r * mult, lo, hi, zp); \
    }

#define SOFTMAX(NAME, CODE)                                                                        \
    int32_t NAME(const CODE *restrict q, const uint8_t *restrict keep, const int32_t *restrict table, \
                 CODE *restrict out, int64_t outer, int64_t n, int64_t inner, float mult, int32_t zp, \
                 int32_t low, int32_t high) {                                                      \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        SOFTMAX_PLANES                                                                             \
        int32_t failed = 0;                                                                        \
        LUCID_SPLIT(outer * inner, 1, lucid_threads(outer * inner * n, LUCID_PARALLEL_ELEMENTS, outer * inner), { \
            int32_t *restrict e = malloc((size_t)n * sizeof *e);                                    \
            LUCID_CHUNK_NEEDS(e, failed)                                                           \
            for (int64_t at = from; at < to; at++) {                                               \
                const int64_t o = at / inner, i = at % inner;                                      \
                const CODE *restrict x = q + o * n * inner + i;                                    \
                CODE *restrict y = out + o * n * inner + i;                                        \
                if (keep && inner == 1) SOFTMAX_KEPT_ROW(CODE, 1)                                  \
                else if (keep) SOFTMAX_KEPT_ROW(CODE, inner)                                       \
                else if (inner == 1) SOFTMAX_ROW(CODE, 1)                                          \
                else SOFTMAX_ROW(CODE, inner)                                                      \
            }                                                                                      \
            free(e);                                                                               \
        })                                                                                         \
        return failed ? -1 : 0;                                                                    \
    }

SOFTMAX(lucid_softmax_uint8, uint8_t)
SOFTMAX(lucid_softmax_int8, int8_t)

/* softmax_matmul's exponentials (lucid_fx/kernels/softmax_matmul.py), rows of n dense codes:
 *
 *   e[j]     = table[top - q[j]]   (uint8: round(255 * exp(-d * scale)), the row's largest code 255)
 *   out[j]   = e[j] + e_zp         (e's codes on the grid 1/255)
 *   rmult[r] = (float)(mult / (double)sum_j e[j])   (0 for a row that keeps nothing)
 *
 * program_ops.exp_codes's steps, so its codes and multipliers bit for bit. keep (or NULL) as above:
 * a position it does not mark has e 0. With VBMI, 64 lookups are two byte permutes and a blend. */
#if SOFTMAX_VBMI
#define EXP_PLANES                                                                                 \
    __m512i planes[4];                                                                             \
    for (int r = 0; r < 4; r++) planes[r] = _mm512_loadu_si512(table + 64 * r);
#define EXP_FAST                                                                                   \
    {                                                                                              \
        const __m512i zero = _mm512_setzero_si512(), shift = _mm512_set1_epi8((char)e_zp);         \
        __m512i total = zero;                                                                      \
        for (; j + 64 <= n; j += 64) {                                                             \
            const __m512i idx = _mm512_sub_epi8(_mm512_set1_epi8((char)top), _mm512_loadu_si512(x + j)); \
            const __m512i e = softmax_plane(planes, idx, _mm512_movepi8_mask(idx));                \
            total = _mm512_add_epi64(total, _mm512_sad_epu8(e, zero));                             \
            _mm512_storeu_si512(y + j, _mm512_add_epi8(e, shift));                                 \
        }                                                                                          \
        sum += _mm512_reduce_add_epi64(total);                                                     \
    }
#else
#define EXP_PLANES
#define EXP_FAST
#endif

/* A row's multiplier: mult / sum(e), once in double, rounded to float (0 for a row that keeps nothing). */
static inline float exp_row_mult(double mult, int64_t sum) { return sum ? (float)(mult / (double)sum) : 0.0f; }

#define SOFTMAX_EXP(NAME, CODE)                                                                    \
    int32_t NAME(const CODE *restrict q, const uint8_t *restrict keep, const uint8_t *restrict table, \
                 CODE *restrict out, float *restrict rmult, int64_t rows, int64_t n, double mult, int32_t e_zp) { \
        EXP_PLANES                                                                                 \
        LUCID_SPLIT(rows, 1, lucid_threads(rows * n, LUCID_PARALLEL_ELEMENTS, rows), {             \
        for (int64_t r = from; r < to; r++) {                                                      \
            const CODE *restrict x = q + r * n;                                                    \
            CODE *restrict y = out + r * n;                                                        \
            const uint8_t *restrict k = keep ? keep + r * n : NULL;                                \
            int32_t top = -256;                                                                    \
            if (k)                                                                                 \
                for (int64_t j = 0; j < n; j++) {                                                  \
                    const int32_t v = k[j] ? x[j] : -256;                                          \
                    top = v > top ? v : top;                                                       \
                }                                                                                  \
            else {                                                                                 \
                CODE t = x[0];                                                                     \
                for (int64_t j = 1; j < n; j++) t = x[j] > t ? x[j] : t;                           \
                top = t;                                                                           \
            }                                                                                      \
            int64_t sum = 0, j = 0;                                                                \
            if (!k) { EXP_FAST }                                                                   \
            for (; j < n; j++) {                                                                   \
                const int32_t e = (!k || k[j]) ? table[(top - (int32_t)x[j]) & 255] : 0;           \
                sum += e;                                                                          \
                y[j] = (CODE)(e + e_zp);                                                           \
            }                                                                                      \
            rmult[r] = exp_row_mult(mult, sum);                                                    \
        }                                                                                          \
        })                                                                                         \
        return 0;                                                                                  \
    }

SOFTMAX_EXP(lucid_softmax_exp_uint8, uint8_t)
SOFTMAX_EXP(lucid_softmax_exp_int8, int8_t)

/* The same from float32 scores y (dequantized, a mask that is a bias added; rows of n, dense):
 *   e[j] = rint(exp(y[j] - max) * 255), out[j] = e[j] + e_zp, rmult as above,
 * a row whose largest is -inf (masked everywhere) all e 0, multiplier 0. softmax_matmul.py's float
 * route in one pass, where a small masked attention spent ~12 torch ops (2x4x16x16 scores: the whole
 * softmax_matmul call 77 -> 41 us). exp is exp_below_zero's, torch.exp Sleef's: within a few ulp, so a
 * code differs only at a tie (none in 2.6M scores of 16x64x128 rows, against glibc's expf's few).
 *
 * softmax_exp_bias starts from the scores' codes and the bias (BERT's additive padding mask), as the
 * torch route computes them, y[j] = (float)(q[j] - zp) * scale + bias[j]: the same floats, then the
 * same codes, without the two float32 passes torch makes first (BERT-like: its softmax_matmul call 38 -> 29 us). */

/* The largest of n floats (-inf for none), 16 running maxima at a time: a max is exact in any order, but
 * the compiler keeps a float reduction's order (a compare after another, some 4 cycles each) unless told. */
static inline float row_max(const float *restrict x, int64_t n) {
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; l++) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
    for (; j < n; j++) lanes[0] = x[j] > lanes[0] ? x[j] : lanes[0];
    float top = lanes[0];
    for (int l = 1; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

/* Chunks of a row: the exponentials in a loop of floats and int32 only, which the compiler vectorizes 16
 * values a step (with the codes' stores in the same loop it took 64 a step, and a short row, BERT's 16
 * keys, ran its scalar tail), then the sum and the codes. */
#define EXP_CHUNK 256
#define EXP_ROW(CODE)                                                                              \
    static inline float exp_row_##CODE(const float *restrict x, CODE *restrict o, int64_t n, double mult, \
                                       int32_t e_zp) {                                             \
        const float top = row_max(x, n);                                                           \
        int32_t e[EXP_CHUNK];                                                                      \
        int64_t sum = 0;                                                                           \
        for (int64_t j0 = 0; j0 < n; j0 += EXP_CHUNK) {                                            \
            const int64_t m = n - j0 < EXP_CHUNK ? n - j0 : EXP_CHUNK;                               \
            int32_t part = 0;                                                                      \
            for (int64_t j = 0; j < m; j++)                                                        \
                e[j] = top == -INFINITY ? 0 : (int32_t)rintf(exp_below_zero(x[j0 + j] - top) * 255.0f); \
            for (int64_t j = 0; j < m; j++) {                                                      \
                part += e[j];                                                                      \
                o[j0 + j] = (CODE)(e[j] + e_zp);                                                   \
            }                                                                                      \
            sum += part;                                                                           \
        }                                                                                          \
        return exp_row_mult(mult, sum);                                                            \
    }
EXP_ROW(uint8_t)
EXP_ROW(int8_t)

#define SOFTMAX_EXP_FLOAT(NAME, CODE)                                                              \
    int32_t NAME(const float *restrict y, CODE *restrict out, float *restrict rmult, int64_t rows, int64_t n, \
                 double mult, int32_t e_zp) {                                                      \
        LUCID_SPLIT(rows, 1, lucid_threads(rows * n, LUCID_PARALLEL_ELEMENTS, rows), {             \
            for (int64_t r = from; r < to; r++)                                                    \
                rmult[r] = exp_row_##CODE(y + r * n, out + r * n, n, mult, e_zp);                  \
        })                                                                                         \
        return 0;                                                                                  \
    }

SOFTMAX_EXP_FLOAT(lucid_softmax_exp_float_uint8, uint8_t)
SOFTMAX_EXP_FLOAT(lucid_softmax_exp_float_int8, int8_t)

/* g holds, as int64: the rows' three dims (outer first), n, then the bias's strides along those three
 * and along n, in floats (0 where it broadcasts). The codes q are dense. Returns 1 where a thread's row of
 * floats could not be allocated (its rows then unwritten), else 0. */
#define EXP_BIAS_STACK 1024 /* a row of up to this many scores needs no allocation */
#define SOFTMAX_EXP_BIAS(NAME, CODE)                                                               \
    int32_t NAME(const CODE *restrict q, const float *restrict bias, CODE *restrict out, float *restrict rmult, \
                 const int64_t *restrict g, float scale, int32_t zp, double mult, int32_t e_zp) {   \
        const int64_t n = g[3], bn = g[7], rows = g[0] * g[1] * g[2];                              \
        int32_t failed = 0;                                                                        \
        LUCID_SPLIT(rows, 1, lucid_threads(rows * n, LUCID_PARALLEL_ELEMENTS, rows), {             \
            float stack[EXP_BIAS_STACK];                                                           \
            float *restrict y = n <= EXP_BIAS_STACK ? stack : malloc((size_t)n * sizeof(float));  \
            LUCID_CHUNK_NEEDS(y, failed)                                                           \
            for (int64_t r = from; r < to; r++) {                                                  \
                const int64_t i0 = r / (g[1] * g[2]), i1 = r / g[2] % g[1], i2 = r % g[2];         \
                const CODE *restrict x = q + r * n;                                                \
                const float *restrict b = bias + i0 * g[4] + i1 * g[5] + i2 * g[6];                \
                if (bn) /* a bias along the row (dense: the caller's check), or one a row */       \
                    for (int64_t j = 0; j < n; j++) y[j] = (float)((int32_t)x[j] - zp) * scale + b[j]; \
                else                                                                               \
                    for (int64_t j = 0; j < n; j++) y[j] = (float)((int32_t)x[j] - zp) * scale + b[0]; \
                rmult[r] = exp_row_##CODE(y, out + r * n, n, mult, e_zp);                          \
            }                                                                                      \
            if (y != stack)                                                                        \
                free(y);                                                                           \
        })                                                                                         \
        return failed;                                                                             \
    }

SOFTMAX_EXP_BIAS(lucid_softmax_exp_bias_uint8, uint8_t)
SOFTMAX_EXP_BIAS(lucid_softmax_exp_bias_int8, int8_t)
