/* What lucid_fx's native kernels share about codes (native.c, native_matmul.c). */
#ifndef LUCID_NATIVE_CODES_H
#define LUCID_NATIVE_CODES_H
#include <stdint.h>

/* Requantize v (codes' units, zero point not yet added): clamp to [low - zp, high - zp], round half
 * to even, add zp. program_ops.requantize_codes's arithmetic, one value at a time. */
#define REQUANTIZE(v, lo, hi, zp) ((int32_t)__builtin_rintf((v) >= (lo) ? ((v) <= (hi) ? (v) : (hi)) : (lo)) + (zp))

#endif
