/* Rotary embedding on codes, llama's q * cos + rotate_half(q) * sin (lucid_fx/kernels/native_rotary.py):
 * the unfused program's mul_strided(x, c), the lookups of rotate_half's two halves (negation and
 * requantization, one table each: program_cpu_elementwise.cat), mul_strided(r, s) and add_strided of
 * the two products, in one pass and one call, the same codes bit for bit (native.c has those kernels).
 *
 * g holds the 4-d shape, then x's, c's, s's and out's strides in elements (4 each; 0 along a dim c
 * or s broadcast). The last dim is rotated: r[j] = t_hi[x[j + h]] for j < h, t_lo[x[j - h]] after
 * (h = shape[3] / 2). n holds, as int32: x_zp, c_zp, zp1, low1, high1 (x * c); r_zp, s_zp, zp2,
 * low2, high2 (r * s); a_zp, b_zp, zp, low, high (the sum); the tables' index flip (128 for int8);
 * and whether the sum's first operand is x * c. f holds mult1, mult2, a_mult, b_mult. */
#include <math.h>
#include <stdint.h>

#include "native_codes.h" /* REQUANTIZE */

#define ROTARY(NAME, CODE)                                                                         \
    void NAME(const CODE *restrict x, const CODE *restrict c, const CODE *restrict s,               \
              const CODE *restrict t_hi, const CODE *restrict t_lo, CODE *restrict out,             \
              const int64_t *restrict g, const int32_t *restrict n, const float *restrict f) {      \
        const int64_t *sh = g, *sx = g + 4, *sc = g + 8, *ss = g + 12, *so = g + 16;                \
        const int64_t h = sh[3] / 2;                                                               \
        const int32_t x_zp = n[0], c_zp = n[1], zp1 = n[2], r_zp = n[5], s_zp = n[6], zp2 = n[7];  \
        const int32_t a_zp = n[10], b_zp = n[11], zp = n[12], first = n[16];                       \
        const float lo1 = (float)(n[3] - zp1), hi1 = (float)(n[4] - zp1);                          \
        const float lo2 = (float)(n[8] - zp2), hi2 = (float)(n[9] - zp2);                          \
        const float lo = (float)(n[13] - zp), hi = (float)(n[14] - zp);                            \
        const uint8_t flip = (uint8_t)n[15];                                                       \
        for (int64_t i0 = 0; i0 < sh[0]; i0++)                                                     \
        for (int64_t i1 = 0; i1 < sh[1]; i1++)                                                     \
        for (int64_t i2 = 0; i2 < sh[2]; i2++) {                                                   \
            const CODE *xr = x + i0 * sx[0] + i1 * sx[1] + i2 * sx[2];                             \
            const CODE *cr = c + i0 * sc[0] + i1 * sc[1] + i2 * sc[2];                             \
            const CODE *sr = s + i0 * ss[0] + i1 * ss[1] + i2 * ss[2];                             \
            CODE *o = out + i0 * so[0] + i1 * so[1] + i2 * so[2];                                  \
            for (int64_t j = 0; j < sh[3]; j++) {                                                  \
                const int32_t p1 = ((int32_t)xr[j * sx[3]] - x_zp) * ((int32_t)cr[j * sc[3]] - c_zp); \
                const int32_t m1 = (CODE)REQUANTIZE((float)p1 * f[0], lo1, hi1, zp1);              \
                const uint8_t k = (uint8_t)((uint8_t)xr[(j < h ? j + h : j - h) * sx[3]] ^ flip);  \
                const int32_t r = (int32_t)(j < h ? t_hi : t_lo)[k];                               \
                const int32_t p2 = (r - r_zp) * ((int32_t)sr[j * ss[3]] - s_zp);                  \
                const int32_t m2 = (CODE)REQUANTIZE((float)p2 * f[1], lo2, hi2, zp2);              \
                const int32_t a = first ? m1 : m2, b = first ? m2 : m1;                            \
                const float ya = (float)(a - a_zp) * f[2];                                         \
                o[j * so[3]] = (CODE)REQUANTIZE(fmaf((float)(b - b_zp), f[3], ya), lo, hi, zp);     \
            }                                                                                      \
        }                                                                                          \
    }

ROTARY(lucid_rotary_uint8, uint8_t)
ROTARY(lucid_rotary_int8, int8_t)
