/* lucid_fx's native int8 convolutions (lucid_fx.kernels.conv_native): uint8 channels-last codes,
 * weights of 7 bits for dense ones without VNNI (any with VNNI's steps, native_gemm.h; depthwise any),
 * the float steps of native_gemm.h fused in, a channels-last result. Without VNNI they serve every
 * small convolution; with it, those of few output pixels (conv_native.VNNI_PIXELS).
 * geometry = {n, h, w, c, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, cout}.
 *
 * Dense (groups 1): an implicit GEMM, native_gemm.c's blocks of 4 output pixels by 16 output channels.
 * A pixel's row is read tap by tap from the image where the tap falls inside it, else from a row of
 * x_zp codes (the padding's real 0); the weight is packed as a linear of (kh, kw, cp) inputs, cp = c
 * rounded up to 4 with zero weights. The sums thus hold x_zp * (row sum) too, which the caller's
 * offset takes away: exact int32, as in native_gemm.c (|w| <= 64 without VNNI).
 *
 * Depthwise (groups = c = cout): per pixel and channel, the sum over the taps inside the image of
 * (x - x_zp) * w (the padding adds 0), exact in int32 for any int8 weights (see conv_depthwise). */
#include <stdlib.h>

#include "native_gemm.h"
#include "native_threads.h" /* LUCID_SPLIT */

enum { G_N, G_H, G_W, G_C, G_KH, G_KW, G_SH, G_SW, G_PH, G_PW, G_DH, G_DW, G_HO, G_WO, G_COUT };

/* Where output pixel p's taps start: its image's first code, and the input row and column of tap (0, 0). */
typedef struct {
    const uint8_t *image;
    int64_t h0, w0;
} conv_pixel_t;

static inline conv_pixel_t conv_pixel(const uint8_t *x, const int64_t *g, int64_t p) {
    const int64_t ow = p % g[G_WO], oh = (p / g[G_WO]) % g[G_HO], img = p / (g[G_WO] * g[G_HO]);
    return (conv_pixel_t){x + img * g[G_H] * g[G_W] * g[G_C], oh * g[G_SH] - g[G_PH], ow * g[G_SW] - g[G_PW]};
}

/* The codes of a pixel's tap (i, j), or `pad` where it falls in the padding. */
static inline const uint8_t *conv_tap(conv_pixel_t px, const int64_t *g, int64_t i, int64_t j, const uint8_t *pad) {
    const int64_t ih = px.h0 + i * g[G_DH], iw = px.w0 + j * g[G_DW];
    if (ih < 0 || ih >= g[G_H] || iw < 0 || iw >= g[G_W]) return pad;
    return px.image + (ih * g[G_W] + iw) * g[G_C];
}

/* 4 codes of a tap's row from channel 4 * q: the c % 4 last ones, then zeros. */
static inline int32_t conv_tail4(const uint8_t *row, int64_t q, int64_t c) {
    uint32_t v = 0;
    for (int64_t k = 4 * q; k < c; k++) v |= (uint32_t)row[k] << (8 * (k - 4 * q));
    return (int32_t)v;
}

#if GEMM_AVX2
#define CONV_LOAD(r) (memcpy(&v, s##r + 4 * q, 4), v)
#define CONV_TAIL(r) conv_tail4(s##r, q, c)
#define CONV_STEPS(LOAD)                                                                              \
    {                                                                                                 \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wt + q * 64));                       \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wt + q * 64 + 32));                  \
        GEMM_STEP(0, LOAD(0)) GEMM_STEP(1, LOAD(1)) GEMM_STEP(2, LOAD(2)) GEMM_STEP(3, LOAD(3))       \
    }

/* Output pixels i..i+rows-1 (rows <= 4) by the 16 output channels of block b. */
static void conv_block4(const uint8_t *x, const int64_t *g, int64_t i, int64_t rows, const int8_t *wb,
                        const uint8_t *pad, int64_t j0, const gemm_finish_t *f, char *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const int64_t c = g[G_C], cq = (c + 3) / 4, full = c / 4, n = g[G_COUT];
    conv_pixel_t px[4];
    for (int64_t r = 0; r < 4; r++) px[r] = conv_pixel(x, g, i + (r < rows ? r : 0));
    int32_t v;
    for (int64_t ki = 0; ki < g[G_KH]; ki++)
        for (int64_t kj = 0; kj < g[G_KW]; kj++) {
            const uint8_t *s0 = conv_tap(px[0], g, ki, kj, pad), *s1 = conv_tap(px[1], g, ki, kj, pad);
            const uint8_t *s2 = conv_tap(px[2], g, ki, kj, pad), *s3 = conv_tap(px[3], g, ki, kj, pad);
            const int8_t *wt = wb + (ki * g[G_KW] + kj) * cq * 64;
            int64_t q = 0;
            for (; q < full; q++) CONV_STEPS(CONV_LOAD)
            if (q < cq) CONV_STEPS(CONV_TAIL)
        }
    const size_t row = n * gemm_size(f->kind), at = j0 * gemm_size(f->kind);
    gemm_finish16(a00, a01, j0, n, f, out + at);
    if (rows > 1) gemm_finish16(a10, a11, j0, n, f, out + row + at);
    if (rows > 2) gemm_finish16(a20, a21, j0, n, f, out + 2 * row + at);
    if (rows > 3) gemm_finish16(a30, a31, j0, n, f, out + 3 * row + at);
}
#endif

/* Pixels [i0, end) with packed block b (16 output channels). */
static void conv_dense_block(const uint8_t *x, const int8_t *packed, char *out, const int64_t *g, const uint8_t *pad,
                             const gemm_finish_t *f, int64_t i0, int64_t end, int64_t b) {
    const int64_t c = g[G_C], cq = (c + 3) / 4, n = g[G_COUT], kg = g[G_KH] * g[G_KW] * cq;
    const size_t size = gemm_size(f->kind);
    for (int64_t i = i0; i < end; i += 4) {
#if GEMM_AVX2
        conv_block4(x, g, i, end - i < 4 ? end - i : 4, packed + b * kg * 64, pad, b * GEMM_NB, f, out + i * n * size);
#else
        for (int64_t p = i; p < end && p < i + 4; p++) {
            const conv_pixel_t px = conv_pixel(x, g, p);
            for (int64_t o = b * GEMM_NB; o < n && o < (b + 1) * GEMM_NB; o++) {
                int32_t s = 0;
                for (int64_t t = 0; t < g[G_KH] * g[G_KW]; t++) {
                    const uint8_t *src = conv_tap(px, g, t / g[G_KW], t % g[G_KW], pad);
                    const int8_t *wt = packed + (b * kg + t * cq) * 64 + (o % GEMM_NB) * 4;
                    for (int64_t k = 0; k < c; k++) s += (int32_t)src[k] * wt[(k / 4) * 64 + k % 4];
                }
                gemm_finish1(s, o, f, out + (p * n + o) * size);
            }
        }
#endif
    }
}

/* A tile of pixels meets every block while in cache; the blocks of a tile are split among the threads. */
static void conv_dense(const uint8_t *x, const int8_t *packed, char *out, const int64_t *g, int32_t x_zp,
                       const gemm_finish_t *f) {
    const int64_t cq = (g[G_C] + 3) / 4, m = g[G_N] * g[G_HO] * g[G_WO], n = g[G_COUT];
    const int64_t nb = (n + GEMM_NB - 1) / GEMM_NB, kg = g[G_KH] * g[G_KW] * cq;
    uint8_t *pad = malloc((size_t)(4 * cq));
    if (!pad) return;
    memset(pad, x_zp, (size_t)(4 * cq));
    const int64_t tile = gemm_tile(m, kg * 4);
    const int threads = lucid_threads(m * n * kg * 4, GEMM_PARALLEL_MNK, nb);
    for (int64_t i0 = 0; i0 < m; i0 += tile) {
        const int64_t end = i0 + tile < m ? i0 + tile : m;
        LUCID_SPLIT(nb, 1, threads, for (int64_t b = from; b < to; b++) conv_dense_block(x, packed, out, g, pad, f, i0, end, b);)
    }
    free(pad);
}

/* With AVX512-VNNI, 32 channels at a time: the same pairs of taps in 512-bit vectors, multiplied and
 * added into int32 by vpdpwssd (exact, as vpmaddwd and the add it fuses). */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DW_AVX512 1
#else
#define DW_AVX512 0
#endif

/* w: int16 (kh * kw, c16) weights, c16 = c rounded up to 16 with zeros: any int8 codes, the full grid
 * included (the depthwise kernels of every CPU kind take the full grid, docs/convert.md#weights). With
 * AVX2, 16 channels at a time: two taps' (x - x_zp) (|.| <= 255) interleaved with their weights and
 * multiplied-and-added by vpmaddwd into int32 (|2 * 255 * 128| < 2^31, exact), which leaves channels
 * 0-3 and 8-11 in one sum and 4-7 and 12-15 in the other; the last c % 16 channels 8 at a time in int32. */
/* Output pixels [from, to); offset[t]: where tap t lies from a pixel's tap (0, 0), inside the image or not. */
static void conv_depthwise_pixels(const uint8_t *x, const int16_t *w, char *out, const int64_t *g, int32_t x_zp,
                                  const gemm_finish_t *f, const int64_t *offset, int64_t from, int64_t to) {
    const int64_t c = g[G_C], c16 = (c + 15) / 16 * 16, taps = g[G_KH] * g[G_KW];
    const size_t size = gemm_size(f->kind);
    const uint8_t **src = malloc((size_t)taps * sizeof *src);
    const int16_t **wt = malloc((size_t)taps * sizeof *wt);
    if (!src || !wt) {
        free(src), free(wt);
        return;
    }
    const int64_t kh = g[G_KH], kw = g[G_KW], dh = g[G_DH], dw = g[G_DW], height = g[G_H], width = g[G_W];
    for (int64_t p = from; p < to; p++) {
        const conv_pixel_t px = conv_pixel(x, g, p);
        /* the taps inside the image, rows i0..i1-1 by columns j0..j1-1: the padding adds 0 */
        int64_t i0 = 0, i1 = kh, j0 = 0, j1 = kw, valid = 0;
        while (i0 < kh && px.h0 + i0 * dh < 0) i0++;
        while (i1 > i0 && px.h0 + (i1 - 1) * dh >= height) i1--;
        while (j0 < kw && px.w0 + j0 * dw < 0) j0++;
        while (j1 > j0 && px.w0 + (j1 - 1) * dw >= width) j1--;
        const int64_t first = (px.h0 * width + px.w0) * c; /* tap (0, 0)'s codes, maybe in the padding */
        for (int64_t i = i0; i < i1; i++)
            for (int64_t j = j0; j < j1; j++, valid++) {
                const int64_t t = i * kw + j;
                src[valid] = px.image + (first + offset[t]), wt[valid] = w + t * c16;
            }
        char *row = out + p * c * size;
        int64_t c0 = 0;
#if DW_AVX512
        const __m512i zp32x16 = _mm512_set1_epi16((int16_t)x_zp), zero512 = _mm512_setzero_si512();
        const __m512i lanes_lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        const __m512i lanes_hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
#define DW_CENTRED32(t)                                                                               \
    _mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src[t] + c0))), zp32x16)
#define DW_WEIGHT32(t) _mm512_loadu_si512((const void *)(wt[t] + c0))
        for (; c0 + 32 <= c; c0 += 32) {
            __m512i a = zero512, b = zero512; /* per 128-bit lane L: channels 8L..8L+3 in a, 8L+4..8L+7 in b */
            for (int64_t t = 0; t < valid; t += 2) {
                const int pair = t + 1 < valid;
                const __m512i x0 = DW_CENTRED32(t), x1 = pair ? DW_CENTRED32(t + 1) : zero512;
                const __m512i w0 = DW_WEIGHT32(t), w1 = pair ? DW_WEIGHT32(t + 1) : zero512;
                a = _mm512_dpwssd_epi32(a, _mm512_unpacklo_epi16(x0, x1), _mm512_unpacklo_epi16(w0, w1));
                b = _mm512_dpwssd_epi32(b, _mm512_unpackhi_epi16(x0, x1), _mm512_unpackhi_epi16(w0, w1));
            }
            const __m512i lo = _mm512_permutex2var_epi64(a, lanes_lo, b), hi = _mm512_permutex2var_epi64(a, lanes_hi, b);
            char *at = row + c0 * size;
            gemm_finish16(_mm512_castsi512_si256(lo), _mm512_extracti64x4_epi64(lo, 1), c0, c, f, at);
            gemm_finish16(_mm512_castsi512_si256(hi), _mm512_extracti64x4_epi64(hi, 1), c0 + 16, c, f, at + 16 * size);
        }
#endif
#if GEMM_AVX2
        const __m256i zp16 = _mm256_set1_epi16((int16_t)x_zp), zp32 = _mm256_set1_epi32(x_zp), zero = _mm256_setzero_si256();
#define DW_CENTRED(t) _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src[t] + c0))), zp16)
#define DW_WEIGHT(t) _mm256_loadu_si256((const __m256i *)(wt[t] + c0))
        for (; c0 + 16 <= c; c0 += 16) {
            __m256i a = zero, b = zero; /* channels {0-3, 8-11} and {4-7, 12-15} */
            for (int64_t t = 0; t < valid; t += 2) {
                const int pair = t + 1 < valid;
                const __m256i x0 = DW_CENTRED(t), x1 = pair ? DW_CENTRED(t + 1) : zero;
                const __m256i w0 = DW_WEIGHT(t), w1 = pair ? DW_WEIGHT(t + 1) : zero;
                a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_unpacklo_epi16(x0, x1), _mm256_unpacklo_epi16(w0, w1)));
                b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_unpackhi_epi16(x0, x1), _mm256_unpackhi_epi16(w0, w1)));
            }
            gemm_finish8(_mm256_permute2x128_si256(a, b, 0x20), c0, f, row + c0 * size);
            gemm_finish8(_mm256_permute2x128_si256(a, b, 0x31), c0 + 8, f, row + (c0 + 8) * size);
        }
        for (; c0 + 8 <= c; c0 += 8) {
            __m256i acc = _mm256_setzero_si256();
            for (int64_t t = 0; t < valid; t++) {
                int64_t bytes;
                memcpy(&bytes, src[t] + c0, 8);
                const __m256i xv = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes)), zp32);
                const __m256i wv = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(wt[t] + c0)));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(xv, wv));
            }
            gemm_finish8(acc, c0, f, row + c0 * size);
        }
#endif
        for (; c0 < c; c0++) {
            int32_t sum = 0;
            for (int64_t t = 0; t < valid; t++) sum += ((int32_t)src[t][c0] - x_zp) * wt[t][c0];
            gemm_finish1(sum, c0, f, row + c0 * size);
        }
    }
    free(src), free(wt);
}

/* The output pixels are split among the threads. */
static void conv_depthwise(const uint8_t *x, const int16_t *w, char *out, const int64_t *g, int32_t x_zp,
                           const gemm_finish_t *f) {
    const int64_t c = g[G_C], m = g[G_N] * g[G_HO] * g[G_WO], taps = g[G_KH] * g[G_KW];
    int64_t *offset = malloc((size_t)taps * sizeof *offset);
    if (!offset) return;
    for (int64_t t = 0; t < taps; t++) offset[t] = ((t / g[G_KW]) * g[G_DH] * g[G_W] + (t % g[G_KW]) * g[G_DW]) * c;
    LUCID_SPLIT(m, 1, lucid_threads(m * c * taps, GEMM_PARALLEL_MNK, m), conv_depthwise_pixels(x, w, out, g, x_zp, f, offset, from, to);)
    free(offset);
}

#define CONV_EXPORT(NAME, CODE, KIND)                                                                 \
    void NAME(const uint8_t *x, const void *w, CODE *out, const int64_t *geometry, int32_t depthwise,  \
              int32_t x_zp, const int32_t *offset, const float *w_scale, const float *bias,             \
              float x_scale, float inv_out, int32_t zp, float low, float high, \
              int32_t post) { \
        const gemm_finish_t f = {offset, w_scale, bias, x_scale, inv_out, (float)zp, low, high, KIND, post}; \
        if (depthwise) conv_depthwise(x, (const int16_t *)w, (char *)out, geometry, x_zp, &f);        \
        else conv_dense(x, (const int8_t *)w, (char *)out, geometry, x_zp, &f);                        \
    }
CONV_EXPORT(lucid_conv_uint8, uint8_t, GEMM_UINT8)
CONV_EXPORT(lucid_conv_int8, int8_t, GEMM_INT8)
CONV_EXPORT(lucid_conv_float32, float, GEMM_FLOAT32)
