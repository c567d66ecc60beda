/* What lucid_fx's native GEMM (native_gemm.c) and convolutions (native_conv.c) share: the float
 * steps after the int32 sums, scalar and 8 at a time (see native_gemm.c for their arithmetic). */
#ifndef LUCID_NATIVE_GEMM_H
#define LUCID_NATIVE_GEMM_H
#include <stdint.h>
#include <string.h>

#define GEMM_NB 16 /* outputs per packed block */
/* From this many multiply-adds a product is split among the caller's OpenMP threads (native_threads.h): below it
 * waking the pool costs more than the split saves. */
#define GEMM_PARALLEL_MNK 1048576
#define GEMM_KB 4  /* inputs per step */

enum { GEMM_UINT8, GEMM_INT8, GEMM_FLOAT32 };
/* The post-op on y before the clamp or requantization (lucid_fx.kernels.linear_native.POST). */
enum { GEMM_POST_NONE, GEMM_POST_HARDSWISH, GEMM_POST_TANH };

typedef struct {
    const int32_t *offset;
    const float *w_scale, *bias;
    float x_scale, inv_out, zp, low, high;
    int kind, post; /* GEMM_POST_*: hardswish is oneDNN's, y * min(max(y * (1/6) + 1/2, 0), 1); tanh gemm_tanh1's */
    /* A residual's uint8 codes (oneDNN's "sum" post-op): y = fma(accum - sum_zp, sum_scale, y), one
     * rounding, as oneDNN's VNNI and AVX2 kernels (measured equal on 30M outputs of each); accum[i]
     * is added to the output at out_base + i. NULL: none. */
    const uint8_t *accum, *out_base;
    float sum_scale;
    int32_t sum_zp;
    /* A float32 result's addend (a residual connection, oneDNN's binary "add" post-op): out = y + addend[i] after the
     * clamp, addend[i] read where out_base + 4 * i is written. NULL: none. */
    const float *addend;
} gemm_finish_t;

/* Where f's addend is read for the float32 result written at out. */
#define GEMM_ADDEND(f, out) ((f)->addend + ((const uint8_t *)(out) - (f)->out_base) / sizeof(float))

#include <math.h> /* fmaf */

#define GEMM_SIXTH (1.0f / 6.0f)
#define GEMM_CLAMP(v, lo, hi) ((v) >= (lo) ? ((v) <= (hi) ? (v) : (hi)) : (lo))

/* tanh in float32 steps, one rounding each (no fused multiply-add), the same operations in every width below
 * (so the scalar tails, AVX2 and AVX-512 give equal values) and as torch steps in linear_native.tanh_steps:
 * Eigen's rational approximation, x * P(x^2) / Q(x^2) with x = y clamped to +-7.905 (where it reaches +-1),
 * y itself below 0.0004 in magnitude. Within 4 ulp of tanh (3.3 measured; Cephes's tanhf, exp-based, was within
 * 1.2 at twice the operations: the gated MLP's two tanh linears spent 130 us of the model's 1150 in it). */
#define GEMM_TANH_CLAMP 7.90531110763549805f
#define GEMM_TANH_TINY 0.0004f
#define GEMM_TANH_A13 -2.76076847742355e-16f
#define GEMM_TANH_A11 2.00018790482477e-13f
#define GEMM_TANH_A9 -8.60467152213735e-11f
#define GEMM_TANH_A7 5.12229709037114e-08f
#define GEMM_TANH_A5 1.48572235717979e-05f
#define GEMM_TANH_A3 6.37261928875436e-04f
#define GEMM_TANH_A1 4.89352455891786e-03f
#define GEMM_TANH_B6 1.19825839466702e-06f
#define GEMM_TANH_B4 1.18534705686654e-04f
#define GEMM_TANH_B2 2.26843463243900e-03f
#define GEMM_TANH_B0 4.89352518554385e-03f

static inline float gemm_tanh1(float y) {
    const float x = GEMM_CLAMP(y, -GEMM_TANH_CLAMP, GEMM_TANH_CLAMP), x2 = x * x;
    float p = GEMM_TANH_A13;
    p = p * x2 + GEMM_TANH_A11;
    p = p * x2 + GEMM_TANH_A9;
    p = p * x2 + GEMM_TANH_A7;
    p = p * x2 + GEMM_TANH_A5;
    p = p * x2 + GEMM_TANH_A3;
    p = p * x2 + GEMM_TANH_A1;
    p = p * x;
    float q = GEMM_TANH_B6;
    q = q * x2 + GEMM_TANH_B4;
    q = q * x2 + GEMM_TANH_B2;
    q = q * x2 + GEMM_TANH_B0;
    return fabsf(y) < GEMM_TANH_TINY ? y : p / q;
}

/* The float steps of one sum for output j, written to out[0] (scalar: tails and builds without AVX2). */
static inline void gemm_finish1(int32_t acc, int64_t j, const gemm_finish_t *f, void *out) {
    float y = (float)(acc + f->offset[j]) * f->x_scale;
    y = y * f->w_scale[j];
    if (f->bias) y = y + f->bias[j];
    if (f->accum) y = fmaf((float)((int32_t)f->accum[(const uint8_t *)out - f->out_base] - f->sum_zp), f->sum_scale, y);
    if (f->post == GEMM_POST_HARDSWISH) {
        const float gate = y * GEMM_SIXTH + 0.5f; /* two roundings: -ffp-contract=off */
        y = y * (gate > 0.0f ? (gate < 1.0f ? gate : 1.0f) : 0.0f);
    } else if (f->post == GEMM_POST_TANH) {
        y = gemm_tanh1(y);
    }
    if (f->kind == GEMM_FLOAT32) {
        const float v = GEMM_CLAMP(y, f->low, f->high);
        *(float *)out = f->addend ? v + *GEMM_ADDEND(f, out) : v;
        return;
    }
    const float v = y * f->inv_out + f->zp;
    const int32_t code = (int32_t)__builtin_rintf(GEMM_CLAMP(v, f->low, f->high));
    if (f->kind == GEMM_UINT8) *(uint8_t *)out = (uint8_t)code;
    else *(int8_t *)out = (int8_t)code;
}

static inline size_t gemm_size(int kind) { return kind == GEMM_FLOAT32 ? 4 : 1; }

/* Rows per tile, a multiple of 4. Rows of m x k codes that fit in L2 (256 KiB) are one tile: the
 * weight is then read once, block by block. Else a tile is about 64 KiB of rows, which stay in cache
 * while it meets every block of the weight (a large image is read once, not once per 16 outputs). */
static inline int64_t gemm_tile(int64_t m, int64_t k) {
    if (m * k <= 262144) return m + 3 - (m + 3) % 4;
    const int64_t rows = (65536 / (k > 0 ? k : 1)) & ~(int64_t)3;
    return rows > 4 ? rows : 4;
}

#if defined(__AVX2__)
#include <immintrin.h>
#define GEMM_AVX2 1
#else
#define GEMM_AVX2 0
#endif

#if GEMM_AVX2

/* The 4 input codes of a row at step g: one load, or the k % 4 last ones and zeros (where the
 * packed weights are 0 too). */
static inline int32_t gemm_x4(const uint8_t *x, int64_t g, int64_t k) {
    int32_t v = 0;
    memcpy(&v, x + g * GEMM_KB, (g + 1) * GEMM_KB <= k ? GEMM_KB : (size_t)(k - g * GEMM_KB));
    return v;
}

static inline __m256 gemm_clamp8(__m256 v, __m256 lo, __m256 hi) {
    const __m256 upper = _mm256_blendv_ps(hi, v, _mm256_cmp_ps(v, hi, _CMP_LE_OQ));
    return _mm256_blendv_ps(lo, upper, _mm256_cmp_ps(v, lo, _CMP_GE_OQ));
}

/* a * b + c rounded once, 8 lanes (FMA3, or fmaf lane by lane where the build has no FMA). */
static inline __m256 gemm_fma8(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    float x[8], y[8], z[8];
    _mm256_storeu_ps(x, a), _mm256_storeu_ps(y, b), _mm256_storeu_ps(z, c);
    for (int i = 0; i < 8; i++) z[i] = fmaf(x[i], y[i], z[i]);
    return _mm256_loadu_ps(z);
#endif
}

/* gemm_tanh1 on 8 lanes: the same steps (separate multiplies and adds, vroundps to nearest even as rintf). */
static inline __m256 gemm_tanh8(__m256 y) {
#define T8(c) _mm256_set1_ps(c)
#define STEP8(v, c) v = _mm256_add_ps(_mm256_mul_ps(v, x2), T8(c))
    const __m256 x = gemm_clamp8(y, T8(-GEMM_TANH_CLAMP), T8(GEMM_TANH_CLAMP)), x2 = _mm256_mul_ps(x, x);
    __m256 p = T8(GEMM_TANH_A13), q = T8(GEMM_TANH_B6);
    STEP8(p, GEMM_TANH_A11); STEP8(p, GEMM_TANH_A9); STEP8(p, GEMM_TANH_A7); STEP8(p, GEMM_TANH_A5);
    STEP8(p, GEMM_TANH_A3); STEP8(p, GEMM_TANH_A1);
    p = _mm256_mul_ps(p, x);
    STEP8(q, GEMM_TANH_B4); STEP8(q, GEMM_TANH_B2); STEP8(q, GEMM_TANH_B0);
    const __m256 tiny = _mm256_cmp_ps(_mm256_andnot_ps(T8(-0.0f), y), T8(GEMM_TANH_TINY), _CMP_LT_OQ);
    return _mm256_blendv_ps(_mm256_div_ps(p, q), y, tiny);
#undef STEP8
#undef T8
}

/* The float steps of 8 sums for outputs j..j+7, written to out (8 codes or floats). */
static inline void gemm_finish8(__m256i acc, int64_t j, const gemm_finish_t *f, void *out) {
    __m256 y = _mm256_cvtepi32_ps(_mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(f->offset + j))));
    y = _mm256_mul_ps(y, _mm256_set1_ps(f->x_scale));
    y = _mm256_mul_ps(y, _mm256_loadu_ps(f->w_scale + j));
    if (f->bias) y = _mm256_add_ps(y, _mm256_loadu_ps(f->bias + j));
    if (f->accum) {
        int64_t codes;
        memcpy(&codes, f->accum + ((const uint8_t *)out - f->out_base), sizeof codes);
        const __m256i centred = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(codes)), _mm256_set1_epi32(f->sum_zp));
        y = gemm_fma8(_mm256_cvtepi32_ps(centred), _mm256_set1_ps(f->sum_scale), y);
    }
    if (f->post == GEMM_POST_HARDSWISH) {
        const __m256 gate = _mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(GEMM_SIXTH)), _mm256_set1_ps(0.5f));
        y = _mm256_mul_ps(y, _mm256_min_ps(_mm256_max_ps(gate, _mm256_setzero_ps()), _mm256_set1_ps(1.0f)));
    } else if (f->post == GEMM_POST_TANH) {
        y = gemm_tanh8(y);
    }
    const __m256 lo = _mm256_set1_ps(f->low), hi = _mm256_set1_ps(f->high);
    if (f->kind == GEMM_FLOAT32) {
        const __m256 v = gemm_clamp8(y, lo, hi);
        _mm256_storeu_ps((float *)out, f->addend ? _mm256_add_ps(v, _mm256_loadu_ps(GEMM_ADDEND(f, out))) : v);
        return;
    }
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(f->inv_out)), _mm256_set1_ps(f->zp));
    const __m256i codes = _mm256_cvtps_epi32(gemm_clamp8(v, lo, hi)); /* in [low, high]: no saturation below */
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    const __m128i bytes = f->kind == GEMM_UINT8 ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words);
    _mm_storel_epi64((__m128i *)out, bytes);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* gemm_tanh1 on 16 lanes. */
static inline __m512 gemm_tanh16(__m512 y) {
#define T16(c) _mm512_set1_ps(c)
#define STEP16(v, c) v = _mm512_add_ps(_mm512_mul_ps(v, x2), T16(c))
    const __m512 hi = T16(GEMM_TANH_CLAMP), lo = T16(-GEMM_TANH_CLAMP);
    const __m512 upper = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y, hi, _CMP_LE_OQ), hi, y); /* gemm_clamp8's order */
    const __m512 x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(y, lo, _CMP_GE_OQ), lo, upper), x2 = _mm512_mul_ps(x, x);
    __m512 p = T16(GEMM_TANH_A13), q = T16(GEMM_TANH_B6);
    STEP16(p, GEMM_TANH_A11); STEP16(p, GEMM_TANH_A9); STEP16(p, GEMM_TANH_A7); STEP16(p, GEMM_TANH_A5);
    STEP16(p, GEMM_TANH_A3); STEP16(p, GEMM_TANH_A1);
    p = _mm512_mul_ps(p, x);
    STEP16(q, GEMM_TANH_B4); STEP16(q, GEMM_TANH_B2); STEP16(q, GEMM_TANH_B0);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(y), T16(GEMM_TANH_TINY), _CMP_LT_OQ), _mm512_div_ps(p, q), y);
#undef STEP16
#undef T16
}

/* gemm_finish8's steps on 16 sums at once (AVX-512): the same operations in the same order, the
 * clamp as compare-and-select, the codes' low bytes written (they are within the code range). */
static inline void gemm_finish16_avx512(__m256i lo8, __m256i hi8, int64_t j, const gemm_finish_t *f, void *out) {
    const __m512i acc = _mm512_inserti64x4(_mm512_castsi256_si512(lo8), hi8, 1);
    __m512 y = _mm512_cvtepi32_ps(_mm512_add_epi32(acc, _mm512_loadu_si512(f->offset + j)));
    y = _mm512_mul_ps(y, _mm512_set1_ps(f->x_scale));
    y = _mm512_mul_ps(y, _mm512_loadu_ps(f->w_scale + j));
    if (f->bias) y = _mm512_add_ps(y, _mm512_loadu_ps(f->bias + j));
    if (f->accum) {
        const __m128i codes = _mm_loadu_si128((const __m128i *)(f->accum + ((const uint8_t *)out - f->out_base)));
        const __m512i centred = _mm512_sub_epi32(_mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(f->sum_zp));
        y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(f->sum_scale), y);
    }
    if (f->post == GEMM_POST_HARDSWISH) {
        const __m512 gate = _mm512_add_ps(_mm512_mul_ps(y, _mm512_set1_ps(GEMM_SIXTH)), _mm512_set1_ps(0.5f));
        y = _mm512_mul_ps(y, _mm512_min_ps(_mm512_max_ps(gate, _mm512_setzero_ps()), _mm512_set1_ps(1.0f)));
    } else if (f->post == GEMM_POST_TANH) {
        y = gemm_tanh16(y);
    }
    const __m512 lo = _mm512_set1_ps(f->low), hi = _mm512_set1_ps(f->high);
    __m512 v = y;
    if (f->kind != GEMM_FLOAT32) v = _mm512_add_ps(_mm512_mul_ps(y, _mm512_set1_ps(f->inv_out)), _mm512_set1_ps(f->zp));
    const __m512 upper = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, hi, _CMP_LE_OQ), hi, v);
    const __m512 clamped = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ), lo, upper);
    if (f->kind == GEMM_FLOAT32) {
        _mm512_storeu_ps((float *)out, f->addend ? _mm512_add_ps(clamped, _mm512_loadu_ps(GEMM_ADDEND(f, out))) : clamped);
        return;
    }
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(clamped)));
}
#define GEMM_FINISH16(lo8, hi8, j, f, out) (gemm_finish16_avx512(lo8, hi8, j, f, out), 1)
#else
#define GEMM_FINISH16(lo8, hi8, j, f, out) 0
#endif

/* The float steps of row r's 16 sums (two vectors) for outputs j0..j0+15, or the ones below n: the
 * first 8 as a vector where all 8 are (n % 16 == 8 is common: 24, 40, 72, 88 outputs; one at a time
 * they took most of a (3136, 16) x (16, 72) product's time), the rest one at a time. */
static inline void gemm_finish16(__m256i lo8, __m256i hi8, int64_t j0, int64_t n, const gemm_finish_t *f, char *row) {
    const size_t size = gemm_size(f->kind);
    if (j0 + GEMM_NB <= n) {
        if (GEMM_FINISH16(lo8, hi8, j0, f, row)) return;
        gemm_finish8(lo8, j0, f, row);
        gemm_finish8(hi8, j0 + 8, f, row + 8 * size);
        return;
    }
    int32_t sums[GEMM_NB];
    _mm256_storeu_si256((__m256i *)sums, lo8);
    _mm256_storeu_si256((__m256i *)(sums + 8), hi8);
    int64_t c = 0;
    if (j0 + 8 <= n) {
        gemm_finish8(lo8, j0, f, row);
        c = 8;
    }
    for (; j0 + c < n; c++) gemm_finish1(sums[c], j0 + c, f, row + c * size);
}

/* VNNI's vpdpbusd adds the four u8 x s8 products of each 32-bit lane to its int32 sum in one step,
 * exact for every int8 weight (no int16 pair sums): the full grid. AVX512-VNNI with AVX512VL, or AVX-VNNI. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GEMM_VNNI 1
#define GEMM_DOT(acc, x, w) _mm256_dpbusd_epi32(acc, x, w)
#elif defined(__AVXVNNI__)
#define GEMM_VNNI 1
#define GEMM_DOT(acc, x, w) _mm256_dpbusd_avx_epi32(acc, x, w)
#else
#define GEMM_VNNI 0
#endif

/* One step of row r: its 4 codes v times the block's weights w0, w1, added to its sums a<r>0, a<r>1. */
#if GEMM_VNNI
#define GEMM_STEP(r, v)                                                                               \
    {                                                                                                 \
        const __m256i xv = _mm256_set1_epi32(v);                                                      \
        a##r##0 = GEMM_DOT(a##r##0, xv, w0);                                                          \
        a##r##1 = GEMM_DOT(a##r##1, xv, w1);                                                          \
        (void)ones;                                                                                   \
    }
#else
#define GEMM_STEP(r, v)                                                                               \
    {                                                                                                 \
        const __m256i xv = _mm256_set1_epi32(v);                                                      \
        a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w0), ones));  \
        a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w1), ones));  \
    }
#endif
#else
#define GEMM_VNNI 0
#endif /* __AVX2__ */

/* native_gemm.c: the product on the VNNI / AVX2 kernels (or the plain loop). */
void lucid_gemm_kernels(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                        const gemm_finish_t *f);
/* native_amx.c: the product on AMX tiles where this build has them and they are on (1), else 0 (nothing written). */
int lucid_amx_gemm(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                   const gemm_finish_t *f);
/* native_amx.c: its tiles for other kernels' products (native_matmul.c). */
int lucid_amx_ready(void);
void lucid_amx_begin(void);
void lucid_amx_end(void);
void lucid_amx_sums(const uint8_t *x, int64_t stride, int64_t k, const int8_t *w0, const int8_t *w1, int32_t *c);
void lucid_amx_counted(void);
#define AMX_TILE_ROWS 32 /* rows of x a step takes (lucid_amx_sums): two x tiles */
#define AMX_TILE_K 64    /* inputs a tile takes: products of a multiple of it only */
#endif /* LUCID_NATIVE_GEMM_H */
