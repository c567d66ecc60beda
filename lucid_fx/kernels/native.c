/* lucid_fx's native CPU kernels: compiled by lucid_fx/kernels/native.py with the machine's C
 * compiler on first use, loaded with ctypes. Plain C99 on dense float32 / 8-bit buffers, one pass
 * each, where torch 2.13 needs several ops; the codes must equal the torch kernels' bit for bit
 * (tests/kernels/test_native.py checks them). One function per code dtype: lucid_<kernel>_<dtype>.
 *
 * Quantize: codes = clamp(round_half_even(x * inv) + zp, qmin, qmax), one pass. The same pass counts
 * the NaN and +-inf of x (an exponent of all ones), so the finite check costs no second read; the
 * caller raises when the count is not 0 and never uses the codes then. A finite x whose product
 * overflows to +-inf is clamped like any other value. Clamping before rounding gives the same codes
 * for integer bounds, and keeps the float -> int32 conversion in range (NaN clamps to qmin). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_threads.h" /* LUCID_SPLIT */

/* How many threads a split pass takes now (native_threads.h's lucid_threads; least 0: a pass over elements). */
int32_t lucid_split_threads(int64_t work, int64_t least, int64_t parts) {
    return lucid_threads(work, least ? least : LUCID_PARALLEL_ELEMENTS, parts);
}

#define QUANTIZE(NAME, CODE)                                                                       \
    int64_t NAME(const float *restrict x, CODE *restrict out, int64_t n, float inv, int32_t zp,   \
                 int32_t qmin, int32_t qmax, int32_t check) {                                     \
        const float lo = (float)(qmin - zp), hi = (float)(qmax - zp);                             \
        uint32_t nonfinite = 0; /* an OR, not a count: a 64-bit count made the check cost 40% more */ \
        LUCID_SPLIT(n, 64, lucid_threads(n, LUCID_PARALLEL_ELEMENTS, n), {                         \
            uint32_t mine = 0;                                                                     \
            if (check) {                                                                           \
                for (int64_t i = from; i < to; i++) {                                              \
                    uint32_t bits;                                                                 \
                    memcpy(&bits, &x[i], sizeof bits);                                             \
                    mine |= (bits & 0x7f800000u) == 0x7f800000u;                                   \
                    out[i] = (CODE)REQUANTIZE(x[i] * inv, lo, hi, zp); /* NaN -> qmin */          \
                }                                                                                  \
            } else {                                                                               \
                for (int64_t i = from; i < to; i++) {                                              \
                    out[i] = (CODE)REQUANTIZE(x[i] * inv, lo, hi, zp); /* NaN -> qmin */          \
                }                                                                                  \
            }                                                                                      \
            LUCID_ATOMIC                                                                           \
            nonfinite |= mine;                                                                     \
        })                                                                                         \
        return nonfinite;                                                                          \
    }

QUANTIZE(lucid_quantize_uint8, uint8_t)
QUANTIZE(lucid_quantize_int8, int8_t)

/* The same codes written channels-last: x is (n, c, hw) float32, out (n, hw, c), so a convolution
 * reads them without a copy (an RGB image's quantize and copy to channels-last took 259 us for
 * 1x3x224x224, the quantize alone 50; this, 59). Blocks of 64 pixels: each channel's codes a vector, then
 * interleaved; three channels (an RGB image) with AVX512-VBMI by two byte permutes per 64 bytes
 * written, others one code at a time. NaN/+-inf are flagged as by QUANTIZE. */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
/* Byte t of 64 three-channel pixels (192 bytes) is channel t % 3 of pixel t / 3. For the q-th 64
 * bytes written, CL3_PAIR[q] picks channels 0 and 1 from rows 0 and 1 (an index past 63: row 1),
 * then CL3_LAST[q] picks channel 2 from row 2 where CL3_MASK[q] has the byte's bit. */
static const uint8_t CL3_PAIR[3][64] = {
    {0, 64, 0, 1, 65, 0, 2, 66, 0, 3, 67, 0, 4, 68, 0, 5, 69, 0, 6, 70, 0, 7, 71, 0, 8, 72, 0, 9, 73, 0, 10, 74, 0, 11, 75, 0, 12, 76, 0, 13, 77, 0, 14, 78, 0, 15, 79, 0, 16, 80, 0, 17, 81, 0, 18, 82, 0, 19, 83, 0, 20, 84, 0, 21},
    {85, 0, 22, 86, 0, 23, 87, 0, 24, 88, 0, 25, 89, 0, 26, 90, 0, 27, 91, 0, 28, 92, 0, 29, 93, 0, 30, 94, 0, 31, 95, 0, 32, 96, 0, 33, 97, 0, 34, 98, 0, 35, 99, 0, 36, 100, 0, 37, 101, 0, 38, 102, 0, 39, 103, 0, 40, 104, 0, 41, 105, 0, 42, 106},
    {0, 43, 107, 0, 44, 108, 0, 45, 109, 0, 46, 110, 0, 47, 111, 0, 48, 112, 0, 49, 113, 0, 50, 114, 0, 51, 115, 0, 52, 116, 0, 53, 117, 0, 54, 118, 0, 55, 119, 0, 56, 120, 0, 57, 121, 0, 58, 122, 0, 59, 123, 0, 60, 124, 0, 61, 125, 0, 62, 126, 0, 63, 127, 0}};
static const uint8_t CL3_LAST[3][64] = {
    {0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6, 7, 7, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10, 11, 11, 11, 12, 12, 12, 13, 13, 13, 14, 14, 14, 15, 15, 15, 16, 16, 16, 17, 17, 17, 18, 18, 18, 19, 19, 19, 20, 20, 20, 21},
    {21, 21, 22, 22, 22, 23, 23, 23, 24, 24, 24, 25, 25, 25, 26, 26, 26, 27, 27, 27, 28, 28, 28, 29, 29, 29, 30, 30, 30, 31, 31, 31, 32, 32, 32, 33, 33, 33, 34, 34, 34, 35, 35, 35, 36, 36, 36, 37, 37, 37, 38, 38, 38, 39, 39, 39, 40, 40, 40, 41, 41, 41, 42, 42},
    {42, 43, 43, 43, 44, 44, 44, 45, 45, 45, 46, 46, 46, 47, 47, 47, 48, 48, 48, 49, 49, 49, 50, 50, 50, 51, 51, 51, 52, 52, 52, 53, 53, 53, 54, 54, 54, 55, 55, 55, 56, 56, 56, 57, 57, 57, 58, 58, 58, 59, 59, 59, 60, 60, 60, 61, 61, 61, 62, 62, 62, 63, 63, 63}};
static const uint64_t CL3_MASK[3] = {0x4924924924924924ull, 0x2492492492492492ull, 0x9249249249249249ull};

static int interleave3(const uint8_t *restrict rows, uint8_t *restrict out) {
    const __m512i r0 = _mm512_loadu_si512(rows), r1 = _mm512_loadu_si512(rows + 64), r2 = _mm512_loadu_si512(rows + 128);
    for (int q = 0; q < 3; q++) {
        __m512i v = _mm512_permutex2var_epi8(r0, _mm512_loadu_si512(CL3_PAIR[q]), r1);
        v = _mm512_mask_permutexvar_epi8(v, (__mmask64)CL3_MASK[q], _mm512_loadu_si512(CL3_LAST[q]), r2);
        _mm512_storeu_si512(out + 64 * q, v);
    }
    return 1;
}
#define INTERLEAVE3(rows, out) interleave3(rows, out)
#else
#define INTERLEAVE3(rows, out) 0
#endif

#define QUANTIZE_CL_BLOCK 64
#define QUANTIZE_CL(NAME, CODE)                                                                    \
    int64_t NAME(const float *restrict x, CODE *restrict out, int64_t n, int64_t c, int64_t hw,     \
                 float inv, int32_t zp, int32_t qmin, int32_t qmax, int32_t check) {               \
        const float lo = (float)(qmin - zp), hi = (float)(qmax - zp);                             \
        uint32_t nonfinite = 0;                                                                    \
        const int64_t blocks = (hw + QUANTIZE_CL_BLOCK - 1) / QUANTIZE_CL_BLOCK; /* an image's */  \
        LUCID_SPLIT(n * blocks, 1, lucid_threads(n * c * hw, LUCID_PARALLEL_ELEMENTS, n * blocks), { \
            uint32_t mine = 0;                                                                     \
            CODE block[3 * QUANTIZE_CL_BLOCK];                                                     \
            for (int64_t at = from; at < to; at++) {                                               \
                const int64_t i = at / blocks, p0 = at % blocks * QUANTIZE_CL_BLOCK;               \
                const int64_t m = hw - p0 < QUANTIZE_CL_BLOCK ? hw - p0 : QUANTIZE_CL_BLOCK;       \
                const int rgb = c == 3 && m == QUANTIZE_CL_BLOCK; /* three rows, then interleaved */ \
                CODE *restrict o = out + (i * hw + p0) * c;                                        \
                for (int64_t k = 0; k < c; k++) {                                                  \
                    const float *restrict xs = x + (i * c + k) * hw + p0;                          \
                    CODE *restrict b = block + (rgb ? k * QUANTIZE_CL_BLOCK : 0);                  \
                    for (int64_t j = 0; j < m; j++) {                                              \
                        uint32_t bits;                                                             \
                        memcpy(&bits, &xs[j], sizeof bits);                                        \
                        mine |= (bits & 0x7f800000u) == 0x7f800000u;                               \
                        b[j] = (CODE)REQUANTIZE(xs[j] * inv, lo, hi, zp); /* NaN -> qmin */        \
                    }                                                                              \
                    if (!rgb)                                                                      \
                        for (int64_t j = 0; j < m; j++) o[j * c + k] = b[j];                       \
                }                                                                                  \
                if (rgb && !INTERLEAVE3((const uint8_t *)block, (uint8_t *)o))                     \
                    for (int64_t j = 0; j < QUANTIZE_CL_BLOCK; j++)                                \
                        for (int64_t k = 0; k < 3; k++) o[j * 3 + k] = block[k * QUANTIZE_CL_BLOCK + j]; \
            }                                                                                      \
            LUCID_ATOMIC                                                                           \
            nonfinite |= mine;                                                                     \
        })                                                                                         \
        return check ? nonfinite : 0;                                                              \
    }

QUANTIZE_CL(lucid_quantize_cl_uint8, uint8_t)
QUANTIZE_CL(lucid_quantize_cl_int8, int8_t)

/* Squeeze-excite's gate: out = requantize((a - a_zp) * (g - g_zp) * mult) for 8-bit codes a of n
 * images, c channels and hw positions, and one gate code g per image and channel. a is
 * channels-last (n, hw, c) when channels_last is set, else (n, c, hw); out has a's layout. The
 * product of two centred 8-bit codes is exact in float32, then one float32 multiply:
 * program_ops.mul_codes's values, bit for bit. */
#define GATE_MUL(NAME, CODE)                                                                       \
    void NAME(const CODE *restrict a, const CODE *restrict g, CODE *restrict out, int64_t n,         \
              int64_t hw, int64_t c, int32_t channels_last, int32_t a_zp, int32_t g_zp, float mult,  \
              int32_t zp, int32_t low, int32_t high) {                                             \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        const int threads = lucid_threads(n * hw * c, LUCID_PARALLEL_ELEMENTS, n * (channels_last ? hw : c)); \
        if (channels_last) {                                                                       \
            LUCID_SPLIT(n * hw, 1, threads, {                                                      \
                for (int64_t pixel = from; pixel < to; pixel++) {                                  \
                    const int64_t row = pixel * c, gate = pixel / hw * c; /* its image's gates */  \
                    for (int64_t k = 0; k < c; k++) {                                              \
                        int32_t prod = ((int32_t)a[row + k] - a_zp) * ((int32_t)g[gate + k] - g_zp); \
                        out[row + k] = (CODE)REQUANTIZE((float)prod * mult, lo, hi, zp);           \
                    }                                                                              \
                }                                                                                  \
            })                                                                                     \
        } else {                                                                                   \
            LUCID_SPLIT(n * c, 1, threads, {                                                       \
                for (int64_t plane = from; plane < to; plane++) {                                  \
                    const int32_t gate = (int32_t)g[plane] - g_zp;                                 \
                    for (int64_t p = 0; p < hw; p++) {                                             \
                        int32_t prod = ((int32_t)a[plane * hw + p] - a_zp) * gate;                 \
                        out[plane * hw + p] = (CODE)REQUANTIZE((float)prod * mult, lo, hi, zp);    \
                    }                                                                              \
                }                                                                                  \
            })                                                                                     \
        }                                                                                          \
    }

GATE_MUL(lucid_gate_mul_uint8, uint8_t)
GATE_MUL(lucid_gate_mul_int8, int8_t)

/* The global average pool of 8-bit codes (channels-last or not, as above): an exact int32 sum per
 * image and channel, then requantize((sum - zp * hw) * mult), mult = scale / (out_scale * hw) in
 * float32: program_ops.global_avg_pool_codes's values, bit for bit (the caller keeps the sums below
 * 2**24, where float32 holds them exactly). acc is scratch for c sums. */
#define GLOBAL_AVG_POOL(NAME, CODE)                                                                \
    void NAME(const CODE *restrict q, CODE *restrict out, int32_t *restrict acc, int64_t n,          \
              int64_t hw, int64_t c, int32_t channels_last, float zp_hw, float mult, int32_t zp,     \
              int32_t low, int32_t high) {                                                         \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        for (int64_t i = 0; i < n; i++) {                                                          \
            if (channels_last) { /* each thread sums its pixels, then the threads' sums are added */ \
                int threads = lucid_threads(hw * c, LUCID_PARALLEL_ELEMENTS, hw);                  \
                const int64_t apart = (c + 31) / 16 * 16; /* no cache line shared: each 64 bytes apart */ \
                int32_t *part = threads > 1 ? malloc((size_t)(threads * apart) * sizeof *part) : NULL; \
                threads = part ? threads : 1;                                                      \
                LUCID_SPLIT(hw, 1, threads, {                                                      \
                    int32_t *restrict sums = part ? part + chunk * apart : acc;                    \
                    for (int64_t k = 0; k < c; k++) sums[k] = 0;                                   \
                    for (int64_t p = from; p < to; p++)                                            \
                        for (int64_t k = 0; k < c; k++) sums[k] += q[(i * hw + p) * c + k];        \
                })                                                                                 \
                if (part) {                                                                        \
                    for (int64_t k = 0; k < c; k++) acc[k] = 0;                                    \
                    for (int t = 0; t < threads; t++)                                              \
                        for (int64_t k = 0; k < c; k++) acc[k] += part[t * apart + k];             \
                    free(part);                                                                    \
                }                                                                                  \
            } else                                                                                 \
                LUCID_SPLIT(c, 1, lucid_threads(hw * c, LUCID_PARALLEL_ELEMENTS, c), {             \
                    for (int64_t k = from; k < to; k++) {                                          \
                        int32_t sum = 0;                                                           \
                        for (int64_t p = 0; p < hw; p++) sum += q[(i * c + k) * hw + p];           \
                        acc[k] = sum;                                                              \
                    }                                                                              \
                })                                                                                 \
            for (int64_t k = 0; k < c; k++)                                                        \
                out[i * c + k] = (CODE)REQUANTIZE(((float)acc[k] - zp_hw) * mult, lo, hi, zp);     \
        }                                                                                          \
    }

GLOBAL_AVG_POOL(lucid_global_avg_pool_uint8, uint8_t)
GLOBAL_AVG_POOL(lucid_global_avg_pool_int8, int8_t)

/* A one-row linear's float steps after its int32 sums (lucid_fx.kernels.linear_row, oneDNN's order,
 * one float32 rounding at a time), for rows x cols sums: y = (acc + offset) * x_scale * w_scale +
 * bias per column; then codes rint(y * inv_out + zp) clamped to [low, high], or, for a float result,
 * y clamped. bias may be NULL. Compiled with -ffp-contract=off: a fused multiply-add would round
 * once where oneDNN rounds twice. */
#define ROW_EPILOGUE(NAME, CODE, FINISH)                                                           \
    void NAME(const int32_t *restrict acc, const int32_t *restrict offset, const float *restrict w_scale, \
              const float *restrict bias, CODE *restrict out, int64_t rows, int64_t cols, float x_scale, \
              float inv_out, int32_t zp, float low, float high) {                                  \
        for (int64_t r = 0; r < rows; r++)                                                         \
            for (int64_t j = 0; j < cols; j++) {                                                   \
                float y = (float)(acc[r * cols + j] + offset[j]) * x_scale;                        \
                y = y * w_scale[j];                                                                \
                if (bias) y = y + bias[j];                                                         \
                out[r * cols + j] = FINISH(y);                                                     \
            }                                                                                      \
    }
#define CLAMPED(v) ((v) >= low ? ((v) <= high ? (v) : high) : low) /* float results: the sign of a zero kept */
#define TO_CODE(y) (int32_t)__builtin_rintf(CLAMP_HI(CLAMP_LO((y) * inv_out + (float)zp, low), high)) /* two roundings: no FMA */

ROW_EPILOGUE(lucid_row_epilogue_uint8, uint8_t, TO_CODE)
ROW_EPILOGUE(lucid_row_epilogue_int8, int8_t, TO_CODE)
ROW_EPILOGUE(lucid_row_epilogue_float32, float, CLAMPED)

/* A 256-entry table lookup per 8-bit code (lucid_fx::lut): out[i] = table[q[i] ^ flip], flip = 128
 * for int8 codes (their bit pattern with the sign flipped is code + 128). One function per table
 * dtype: 8-bit codes, or float32 values (a lookup with its dequantize folded in). With AVX512-VBMI
 * an 8-bit table is four 64-byte registers and 64 codes are looked up at once (two vpermi2b and a
 * blend on the index's top bit); with AVX2, 32 codes through 16 vpshufb; lucid_lut_vectorized() says
 * whether this build has either path. */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LUT_VBMI 1
static int64_t lut_bytes_vbmi(const uint8_t *restrict q, const uint8_t *restrict table, uint8_t *restrict out,
                              int64_t n, uint8_t flip) {
    const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 64);
    const __m512i t2 = _mm512_loadu_si512(table + 128), t3 = _mm512_loadu_si512(table + 192);
    const __m512i f = _mm512_set1_epi8((char)flip);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512i idx = _mm512_xor_si512(_mm512_loadu_si512(q + i), f);
        const __m512i lo = _mm512_permutex2var_epi8(t0, idx, t1); /* the index's low 7 bits */
        const __m512i hi = _mm512_permutex2var_epi8(t2, idx, t3);
        _mm512_storeu_si512(out + i, _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi));
    }
    return i;
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define LUT_AVX2 1
/* AVX2 has no 256-byte permute: the table is 16 rows of 16 bytes, each looked up by the codes' low
 * nibble (vpshufb) and kept where the high nibble names its row, 32 codes at a time. */
static int64_t lut_bytes_avx2(const uint8_t *restrict q, const uint8_t *restrict table, uint8_t *restrict out,
                              int64_t n, uint8_t flip) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), f = _mm256_set1_epi8((char)flip);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i idx = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + i)), f);
        const __m256i lo = _mm256_and_si256(idx, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(idx, 4), nibble);
        __m256i got = _mm256_setzero_si256();
        for (int r = 0; r < 16; r++) {
            const __m256i row = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(table + 16 * r)));
            const __m256i mine = _mm256_cmpeq_epi8(hi, _mm256_set1_epi8((char)r));
            got = _mm256_or_si256(got, _mm256_and_si256(mine, _mm256_shuffle_epi8(row, lo)));
        }
        _mm256_storeu_si256((__m256i *)(out + i), got);
    }
    return i;
}
#endif
#ifndef LUT_AVX2
#define LUT_AVX2 0
#endif
#ifndef LUT_VBMI
#define LUT_VBMI 0
#endif

int32_t lucid_lut_vectorized(void) { return LUT_VBMI || LUT_AVX2; }

#define LUT(NAME, OUT, FAST)                                                                       \
    void NAME(const uint8_t *restrict q, const OUT *restrict table, OUT *restrict out, int64_t n,    \
              int32_t flip) {                                                                      \
        const uint8_t f = (uint8_t)flip;                                                           \
        LUCID_SPLIT(n, 64, lucid_threads(n, LUCID_PARALLEL_ELEMENTS, n), {                         \
            int64_t i = from + FAST;                                                               \
            for (; i < to; i++) out[i] = table[(uint8_t)(q[i] ^ f)];                               \
        })                                                                                         \
    }

#if LUT_VBMI
#define BYTES_FAST lut_bytes_vbmi(q + from, (const uint8_t *)table, (uint8_t *)out + from, to - from, f)
#elif LUT_AVX2
#define BYTES_FAST lut_bytes_avx2(q + from, (const uint8_t *)table, (uint8_t *)out + from, to - from, f)
#else
#define BYTES_FAST 0
#endif
LUT(lucid_lut_uint8, uint8_t, BYTES_FAST)
LUT(lucid_lut_int8, int8_t, BYTES_FAST)
LUT(lucid_lut_float32, float, 0)

/* A gated product of two lookups (a gated MLP's act(x) * gate(y)): out = requantize((ta[a ^ fa] -
 * a_zp) * (tb[b ^ fb] - b_zp) * mult) for n 8-bit codes a and b in the same layout: lut, lut and
 * program_ops.mul_codes in one pass, the same codes bit for bit (the product of two centred 8-bit
 * codes is exact in float32, then one float32 multiply). With VBMI, blocks of 256 codes: both
 * lookups by lut_bytes_vbmi, then the products as vectors, which the compiler
 * vectorizes: 64x1024 codes in 25 us, against 84 one at a time (AVX512-VBMI EPYC, measured). */
#define LUT_MUL_BLOCK 256
#if LUT_VBMI
#define LUT_MUL_BYTES(q, t, o, f) lut_bytes_vbmi(q, (const uint8_t *)(t), (uint8_t *)(o), LUT_MUL_BLOCK, (uint8_t)(f))
#endif /* AVX2's sixteen-row lookups made it slower there: 78 us against 58 one at a time */
#define LUT_MUL_CODE(CODE, x, y) (CODE)REQUANTIZE((float)((x) * (y)) * mult, lo, hi, zp)
#ifdef LUT_MUL_BYTES
#define LUT_MUL_FAST(CODE)                                                                         \
    for (; i + LUT_MUL_BLOCK <= to; i += LUT_MUL_BLOCK) {                                           \
        CODE la[LUT_MUL_BLOCK], lb[LUT_MUL_BLOCK];                                                 \
        LUT_MUL_BYTES(a + i, ta, la, fa);                                                          \
        LUT_MUL_BYTES(b + i, tb, lb, fb);                                                          \
        for (int32_t j = 0; j < LUT_MUL_BLOCK; j++)                                                \
            out[i + j] = LUT_MUL_CODE(CODE, (int32_t)la[j] - a_zp, (int32_t)lb[j] - b_zp);               \
    }
#else
#define LUT_MUL_FAST(CODE)
#endif
#define LUT_MUL(NAME, CODE)                                                                        \
    void NAME(const uint8_t *restrict a, const CODE *restrict ta, int32_t fa, const uint8_t *restrict b, \
              const CODE *restrict tb, int32_t fb, CODE *restrict out, int64_t n, int32_t a_zp,      \
              int32_t b_zp, float mult, int32_t zp, int32_t low, int32_t high) {                   \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        LUCID_SPLIT(n, LUT_MUL_BLOCK, lucid_threads(n, LUCID_PARALLEL_ELEMENTS, n), {              \
            int64_t i = from;                                                                      \
            LUT_MUL_FAST(CODE)                                                                     \
            if (i < to) {                                                                          \
                int32_t ca[256], cb[256];                                                          \
                for (int32_t c = 0; c < 256; c++) {                                                \
                    ca[c] = (int32_t)ta[(uint8_t)(c ^ fa)] - a_zp;                                 \
                    cb[c] = (int32_t)tb[(uint8_t)(c ^ fb)] - b_zp;                                 \
                }                                                                                  \
                for (; i < to; i++) out[i] = LUT_MUL_CODE(CODE, ca[a[i]], cb[b[i]]);               \
            }                                                                                      \
        })                                                                                         \
    }

LUT_MUL(lucid_lut_mul_uint8, uint8_t)
LUT_MUL(lucid_lut_mul_int8, int8_t)

/* Requantize float32 values y (a float matmul's or softmax's result) to codes in one pass:
 * rint(clamp(y * mult)) + zp, program_ops.requantize_codes(y.mul_(mult), ...) bit for bit. */
#define REQUANTIZE_SCALED(NAME, CODE)                                                              \
    void NAME(const float *restrict y, CODE *restrict out, int64_t n, float mult, int32_t zp,        \
              int32_t low, int32_t high) {                                                         \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        LUCID_SPLIT(n, 64, lucid_threads(n, LUCID_PARALLEL_ELEMENTS, n), {                         \
            for (int64_t i = from; i < to; i++) out[i] = (CODE)REQUANTIZE(y[i] * mult, lo, hi, zp); \
        })                                                                                         \
    }

REQUANTIZE_SCALED(lucid_requantize_uint8, uint8_t)
REQUANTIZE_SCALED(lucid_requantize_int8, int8_t)

/* Dequantize n dense 8-bit codes: out = ((float)q - zp) * scale, lucid_fx.kernels.codes.dequant's
 * two float32 steps (the subtraction is exact), one pass. */
#define DEQUANTIZE(NAME, CODE)                                                                     \
    void NAME(const CODE *restrict q, float *restrict out, int64_t n, int32_t zp, float scale) {   \
        const float z = (float)zp;                                                                 \
        LUCID_SPLIT(n, 64, lucid_threads(n, LUCID_PARALLEL_ELEMENTS, n), {                         \
            for (int64_t i = from; i < to; i++) out[i] = ((float)q[i] - z) * scale;                \
        })                                                                                         \
    }

DEQUANTIZE(lucid_dequantize_uint8, uint8_t)
DEQUANTIZE(lucid_dequantize_int8, int8_t)

/* Binary steps on two 8-bit code tensors of any strides, broadcast to a 6-d shape: geometry g holds
 * the shape, then a's, b's and out's strides in elements (0 along a broadcast dim), 6 each. ELEMENT
 * writes out[io] from a[ia] and b[ib]. */
#define BROADCAST_LOOP(g, ELEMENT)                                                                 \
    const int64_t *s = g, *sa = g + 6, *sb = g + 12, *so = g + 18;                                  \
    for (int64_t i0 = 0; i0 < s[0]; i0++)                                                          \
    for (int64_t i1 = 0; i1 < s[1]; i1++)                                                          \
    for (int64_t i2 = 0; i2 < s[2]; i2++)                                                          \
    for (int64_t i3 = 0; i3 < s[3]; i3++)                                                          \
    for (int64_t i4 = 0; i4 < s[4]; i4++) {                                                        \
        const int64_t oa = i0 * sa[0] + i1 * sa[1] + i2 * sa[2] + i3 * sa[3] + i4 * sa[4];          \
        const int64_t ob = i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + i3 * sb[3] + i4 * sb[4];          \
        const int64_t oo = i0 * so[0] + i1 * so[1] + i2 * so[2] + i3 * so[3] + i4 * so[4];          \
        for (int64_t i5 = 0; i5 < s[5]; i5++) {                                                    \
            const int64_t ia = oa + i5 * sa[5], ib = ob + i5 * sb[5], io = oo + i5 * so[5];        \
            ELEMENT;                                                                               \
        }                                                                                          \
    }

/* out = requantize((a - a_zp) * (b - b_zp) * mult): program_ops.mul_codes's values bit for bit (the
 * product of two centred codes is exact in float32, then one float32 multiply). A run of the last dim
 * dense in all three is a loop of its own, which the compiler vectorizes: a gated MLP's 64x1024
 * product of two code tensors 175 -> 21 us (AVX512-VNNI EPYC), where the strided loop stays scalar. */
#define MUL_ROW(CODE)                                                                              \
    static void mul_row_##CODE(const CODE *restrict a, const CODE *restrict b, CODE *restrict out, int64_t n, \
                               int32_t a_zp, int32_t b_zp, float mult, float lo, float hi, int32_t zp) { \
        for (int64_t i = 0; i < n; i++)                                                            \
            out[i] = (CODE)REQUANTIZE((float)(((int32_t)a[i] - a_zp) * ((int32_t)b[i] - b_zp)) * mult, lo, hi, zp); \
    }
MUL_ROW(uint8_t)
MUL_ROW(int8_t)
#define MUL_STRIDED(NAME, CODE)                                                                    \
    void NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out,                   \
              const int64_t *restrict g, int32_t a_zp, int32_t b_zp, float mult, int32_t zp,         \
              int32_t low, int32_t high) {                                                         \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        if (g[11] == 1 && g[17] == 1 && g[23] == 1) { /* the last dim dense in a, b and out */      \
            int64_t rows[6] = {g[0], g[1], g[2], g[3], g[4], 1}, step[24];                         \
            memcpy(step, g, sizeof step);                                                          \
            memcpy(step, rows, sizeof rows);                                                       \
            BROADCAST_LOOP(step, mul_row_##CODE(a + ia, b + ib, out + io, g[5], a_zp, b_zp, mult, lo, hi, zp)) \
            return;                                                                                \
        }                                                                                          \
        BROADCAST_LOOP(g, {                                                                        \
            const int32_t prod = ((int32_t)a[ia] - a_zp) * ((int32_t)b[ib] - b_zp);                \
            out[io] = (CODE)REQUANTIZE((float)prod * mult, lo, hi, zp);                            \
        })                                                                                         \
    }

MUL_STRIDED(lucid_mul_strided_uint8, uint8_t)
MUL_STRIDED(lucid_mul_strided_int8, int8_t)

/* out = requantize(fma(b - b_zp, b_mult, (a - a_zp) * a_mult)): program_ops.add_codes's values bit for
 * bit where torch's vectorized add (torch.add(x, y, alpha=b_mult)) fuses its multiply-add, as its
 * AVX2 and AVX-512 kernels do (the caller checks; fmaf rounds once whatever the flags). */
#define ADD_STRIDED(NAME, CODE)                                                                    \
    void NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out,                   \
              const int64_t *restrict g, int32_t a_zp, float a_mult, int32_t b_zp, float b_mult,     \
              int32_t zp, int32_t low, int32_t high) {                                             \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        BROADCAST_LOOP(g, {                                                                        \
            const float ya = (float)((int32_t)a[ia] - a_zp) * a_mult;                              \
            const float y = fmaf((float)((int32_t)b[ib] - b_zp), b_mult, ya);                      \
            out[io] = (CODE)REQUANTIZE(y, lo, hi, zp);                                             \
        })                                                                                         \
    }

ADD_STRIDED(lucid_add_strided_uint8, uint8_t)
ADD_STRIDED(lucid_add_strided_int8, int8_t)

/* A 256-entry table per channel (lucid_fx::channel_lut): codes laid out as (outer, c, inner), dense;
 * out[o, k, i] = tables[k][q[o, k, i] ^ flip]. Contiguous (N, C, H, W) codes are outer N, inner H*W:
 * each plane takes the vectorized lookup of its own table, as LUT. Channels-last ones are outer
 * N*H*W, inner 1: one pixel's channels in a row, each code beside its table's offset, with no inner
 * loop per code (a loop of one per code took 3.7 ns a code: 1x256x56x56 in 2942 us, measured). One
 * function per table dtype. */
#define CHANNEL_LUT(NAME, OUT, FAST, GATHER)                                                               \
    void NAME(const uint8_t *restrict q, const OUT *restrict tables, OUT *restrict out, int64_t outer, \
              int64_t c, int64_t inner, int32_t flip) {                                            \
        const uint8_t f = (uint8_t)flip;                                                           \
        if (inner == 1) {                                                                          \
            for (int64_t o = GATHER; o < outer; o++) {                                             \
                const uint8_t *restrict qo = q + o * c;                                            \
                OUT *restrict oo = out + o * c;                                                    \
                for (int64_t k = 0; k < c; k++) oo[k] = tables[k * 256 + (uint8_t)(qo[k] ^ f)];    \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (int64_t o = 0; o < outer; o++)                                                        \
            for (int64_t k = 0; k < c; k++) {                                                      \
                const OUT *restrict t = tables + k * 256;                                          \
                const int64_t base = (o * c + k) * inner;                                          \
                int64_t i = FAST;                                                                  \
                for (; i < inner; i++) out[base + i] = t[(uint8_t)(q[base + i] ^ f)];              \
            }                                                                                      \
    }

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Channels-last 8-bit codes with AVX-512: 16 codes a step, each a 4-byte gather at its channel's
 * table offset plus its code (the low byte is the entry). gather_span looks up count codes of the
 * channels first, first + 1, ...: one pixel's channels, or one cat input's share of them. A gather
 * reads 3 bytes past its entry, so the lanes whose read could pass the tables' end (channel c - 1's
 * top three codes) are masked off and read one byte each. */
static void gather_span(const uint8_t *restrict qs, const uint8_t *restrict tables, int64_t first, int64_t count,
                        uint8_t *restrict os, int64_t c, uint8_t flip) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i f = _mm512_set1_epi32(flip), last = _mm512_set1_epi32((int32_t)(c * 256 - 4));
    __mmask16 unsafe = 0;
    for (int64_t k = 0; k < count; k += 16) {
        const __mmask16 m = k + 16 <= count ? (__mmask16)0xffff : (__mmask16)((1u << (count - k)) - 1u);
        const __m512i code = _mm512_xor_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, qs + k)), f);
        const __m512i idx = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(first + k))), 8), code);
        const __mmask16 safe = _mm512_mask_cmple_epi32_mask(m, idx, last);
        unsafe |= m & (__mmask16)~safe;
        const __m512i got = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), safe, idx, (const int *)tables, 1);
        _mm_mask_storeu_epi8(os + k, m, _mm512_cvtepi32_epi8(got));
    }
    if (unsafe) /* a top code of channel c - 1: the span's last code */
        os[count - 1] = tables[(first + count - 1) * 256 + (uint8_t)(qs[count - 1] ^ flip)];
}

static int64_t channel_lut_gather(const uint8_t *restrict q, const uint8_t *restrict tables, uint8_t *restrict out,
                                  int64_t outer, int64_t c, uint8_t flip) {
    if (c > (1 << 20)) return 0; /* the lanes' indices stay in int32 */
    for (int64_t o = 0; o < outer; o++) gather_span(q + o * c, tables, 0, c, out + o * c, c, flip);
    return outer;
}
#define PIXEL_GATHER channel_lut_gather(q, (const uint8_t *)tables, (uint8_t *)out, outer, c, f)
#else
#define PIXEL_GATHER 0
#endif
#if LUT_VBMI
#define PLANE_FAST lut_bytes_vbmi(q + base, (const uint8_t *)t, (uint8_t *)out + base, inner, f)
#elif LUT_AVX2
#define PLANE_FAST lut_bytes_avx2(q + base, (const uint8_t *)t, (uint8_t *)out + base, inner, f)
#else
#define PLANE_FAST 0
#endif
CHANNEL_LUT(lucid_channel_lut_uint8, uint8_t, PLANE_FAST, PIXEL_GATHER)
CHANNEL_LUT(lucid_channel_lut_int8, int8_t, PLANE_FAST, PIXEL_GATHER)
CHANNEL_LUT(lucid_channel_lut_float32, float, 0, 0)

/* channel_lut of a channel cat of channels-last codes (DenseNet's cat -> batch norm -> relu), without
 * the cat: source j holds pixels x chans[j] codes, channels off_j .. off_j + chans[j] - 1 of the
 * (pixels, c) output, and each code is looked up straight from its source (8-bit tables: the
 * AVX-512 gathers above where this build has them). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static int span_bytes(const uint8_t *qs, const void *tables, int64_t off, int64_t n, void *os, int64_t c, uint8_t f) {
    if (c > (1 << 20)) return 0; /* the lanes' indices stay in int32 */
    gather_span(qs, (const uint8_t *)tables, off, n, (uint8_t *)os, c, f);
    return 1;
}
#else
static int span_bytes(const uint8_t *qs, const void *tables, int64_t off, int64_t n, void *os, int64_t c, uint8_t f) {
    (void)qs, (void)tables, (void)off, (void)n, (void)os, (void)c, (void)f;
    return 0;
}
#endif
#define CHANNEL_LUT_CAT(NAME, OUT, BYTES)                                                          \
    void NAME(const uint8_t *const *srcs, const int64_t *restrict chans, int32_t nsrc,              \
              const OUT *restrict tables, OUT *restrict out, int64_t pixels, int64_t c, int32_t flip) { \
        const uint8_t f = (uint8_t)flip;                                                           \
        for (int64_t o = 0; o < pixels; o++)                                                       \
            for (int64_t j = 0, off = 0; j < nsrc; off += chans[j], j++) {                         \
                const uint8_t *restrict qs = srcs[j] + o * chans[j];                               \
                OUT *restrict os = out + o * c + off;                                              \
                if (BYTES && span_bytes(qs, tables, off, chans[j], os, c, f)) continue;            \
                for (int64_t k = 0; k < chans[j]; k++) os[k] = tables[(off + k) * 256 + (uint8_t)(qs[k] ^ f)]; \
            }                                                                                      \
    }

CHANNEL_LUT_CAT(lucid_channel_lut_cat_uint8, uint8_t, 1)
CHANNEL_LUT_CAT(lucid_channel_lut_cat_int8, int8_t, 1)
CHANNEL_LUT_CAT(lucid_channel_lut_cat_float32, float, 0)
