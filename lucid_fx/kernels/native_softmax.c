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
#include <stdint.h>
#include <stdlib.h>

#include "native_codes.h" /* REQUANTIZE */

/* One row of n codes a step apart (step 1: loops the compiler vectorizes, the lookups as gathers).
 * Sums of fewer than 256 values stay below 2^31: int32 there, int64 beyond. */
#define SOFTMAX_ROW(CODE, STEP)                                                                    \
    {                                                                                              \
        int32_t top = x[0];                                                                        \
        for (int64_t j = 1; j < n; j++) top = x[j * (STEP)] > top ? x[j * (STEP)] : top;           \
        const int32_t *t = table + top; /* t[-code] = table[top - code] */                       \
        for (int64_t j = 0; j < n; j++) e[j] = t[-(int32_t)x[j * (STEP)]];                         \
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
        int32_t *restrict e = malloc((size_t)n * sizeof *e);                                        \
        if (!e) return -1;                                                                         \
        for (int64_t o = 0; o < outer; o++)                                                        \
            for (int64_t i = 0; i < inner; i++) {                                                  \
                const CODE *restrict x = q + o * n * inner + i;                                    \
                CODE *restrict y = out + o * n * inner + i;                                        \
                if (keep && inner == 1) SOFTMAX_KEPT_ROW(CODE, 1)                                  \
                else if (keep) SOFTMAX_KEPT_ROW(CODE, inner)                                       \
                else if (inner == 1) SOFTMAX_ROW(CODE, 1)                                          \
                else SOFTMAX_ROW(CODE, inner)                                                      \
            }                                                                                      \
        free(e);                                                                                   \
        return 0;                                                                                  \
    }

SOFTMAX(lucid_softmax_uint8, uint8_t)
SOFTMAX(lucid_softmax_int8, int8_t)
