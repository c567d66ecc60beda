/* Max and average pooling of channels-last 8-bit codes in one pass (lucid_fx/kernels/native_pool.py),
 * where the program otherwise runs max_pool_taps' padded copy and strided maxima, or the reference's
 * dequantize, float pool and quantize. Codes (n, h, w, c) in and out: each pixel's channels are a
 * vector. (Contiguous planes, one window at a time, ran slower than the torch path: they keep it.)
 *
 * g holds, as int64: n, c, h, w, oh, ow, (unused), kh, kw, sh, sw, ph, pw, mode (0: max, 1: average
 * counting the padding, 2: average of the taps in the image), zp, out_zp, low, high. Windows are
 * torch's: a window starts at o * s - p and holds the taps inside the image; every window holds one
 * (the caller's geometry: padding at most half the window).
 *
 * max: the largest code of the window's taps, exactly (the padding never wins in torch's max pool).
 * average: an exact int32 sum of the window's codes, s, then requantize((s - zp * taps) * (ratio /
 * divisor)), ratio = scale / out_scale, the divisor torch's (the window clipped to the padded image,
 * or the taps in the image): at most one code from the reference's float average, at ties.
 * Returns 1, or 0 where its scratch could not be allocated (then not every output is written). */
#include <stdint.h>
#include <stdlib.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_threads.h" /* LUCID_SPLIT */

/* The taps [lo, hi) of one window along one axis inside the image, and its span clipped to the
 * padded image (count_include_pad's divisor), for each output position. */
typedef struct {
    int64_t lo, hi, span;
} range_t;

static void pool_ranges(range_t *restrict r, int64_t outs, int64_t in, int64_t k, int64_t s, int64_t p) {
    for (int64_t o = 0; o < outs; o++) {
        const int64_t start = o * s - p, end = start + k < in + p ? start + k : in + p;
        r[o] = (range_t){start > 0 ? start : 0, end < in ? end : in, end - start};
    }
}

/* Separable: for each output row, the window's rows reduced into acc (one image row of w * c
 * codes: a max in codes, a sum in int32), then each output's columns of acc reduced into tmp. */
#define POOL(NAME, CODE)                                                                           \
    int32_t NAME(const CODE *restrict q, CODE *restrict out, const int64_t *restrict g, float ratio) { \
        const int64_t n = g[0], c = g[1], h = g[2], w = g[3], oh = g[4], ow = g[5], mode = g[13];   \
        const int64_t zp = g[14], row = w * c;                                                     \
        const int32_t out_zp = (int32_t)g[15];                                                     \
        const float lo = (float)(g[16] - out_zp), hi = (float)(g[17] - out_zp);                    \
        range_t *ry = malloc(oh * sizeof *ry), *rx = malloc(ow * sizeof *rx);                      \
        if (!ry || !rx) {                                                                          \
            free(ry), free(rx);                                                                    \
            return 1;                                                                              \
        }                                                                                          \
        pool_ranges(ry, oh, h, g[7], g[9], g[11]);                                                 \
        pool_ranges(rx, ow, w, g[8], g[10], g[12]);                                                \
        int32_t done = 1;                                                                          \
        /* the output rows of every image split among the threads, each with its own scratch */     \
        LUCID_SPLIT(n * oh, 1, lucid_threads(n * oh * ow * c * g[7] * g[8], LUCID_PARALLEL_ELEMENTS, n * oh), { \
        CODE *most = malloc(row * sizeof *most);                                                   \
        int32_t *acc = malloc(row * sizeof *acc), *tmp = malloc(c * sizeof *tmp);                  \
        if (!most || !acc || !tmp) {                                                               \
            free(most), free(acc), free(tmp);                                                      \
            LUCID_ATOMIC                                                                           \
            done &= 0;                                                                             \
            continue;                                                                              \
        }                                                                                          \
        for (int64_t at = from; at < to; at++) {                                                   \
            const int64_t i = at / oh, oy = at % oh;                                               \
            const CODE *restrict p = q + i * h * row;                                              \
            CODE *restrict o = out + i * oh * ow * c;                                              \
            {                                                                                      \
                const range_t y = ry[oy];                                                          \
                const CODE *restrict first = p + y.lo * row;                                       \
                if (mode == 0) {                                                                   \
                    for (int64_t j = 0; j < row; j++) most[j] = first[j];                          \
                    for (int64_t r = y.lo + 1; r < y.hi; r++)                                      \
                        for (int64_t j = 0; j < row; j++) most[j] = p[r * row + j] > most[j] ? p[r * row + j] : most[j]; \
                    for (int64_t ox = 0; ox < ow; ox++) {                                          \
                        const range_t x = rx[ox];                                                  \
                        CODE *restrict dst = o + (oy * ow + ox) * c;                               \
                        for (int64_t k = 0; k < c; k++) dst[k] = most[x.lo * c + k];               \
                        for (int64_t col = x.lo + 1; col < x.hi; col++)                            \
                            for (int64_t k = 0; k < c; k++) dst[k] = most[col * c + k] > dst[k] ? most[col * c + k] : dst[k]; \
                    }                                                                              \
                    continue;                                                                      \
                }                                                                                  \
                for (int64_t j = 0; j < row; j++) acc[j] = first[j];                               \
                for (int64_t r = y.lo + 1; r < y.hi; r++)                                          \
                    for (int64_t j = 0; j < row; j++) acc[j] += p[r * row + j];                    \
                for (int64_t ox = 0; ox < ow; ox++) {                                              \
                    const range_t x = rx[ox];                                                      \
                    CODE *restrict dst = o + (oy * ow + ox) * c;                                   \
                    for (int64_t k = 0; k < c; k++) tmp[k] = acc[x.lo * c + k];                    \
                    for (int64_t col = x.lo + 1; col < x.hi; col++)                                \
                        for (int64_t k = 0; k < c; k++) tmp[k] += acc[col * c + k];                \
                    const int64_t taps = (y.hi - y.lo) * (x.hi - x.lo);                            \
                    const float mult = ratio / (float)(mode == 1 ? y.span * x.span : taps);        \
                    const float zp_taps = (float)(zp * taps);                                      \
                    for (int64_t k = 0; k < c; k++)                                                \
                        dst[k] = (CODE)REQUANTIZE(((float)tmp[k] - zp_taps) * mult, lo, hi, out_zp); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        free(most), free(acc), free(tmp);                                                          \
        })                                                                                         \
        free(ry), free(rx);                                                                        \
        return !done; /* 0: pooled; 1: a thread had no scratch (its rows unwritten) */             \
    }

POOL(lucid_pool_uint8, uint8_t)
POOL(lucid_pool_int8, int8_t)
