/* What lucid_fx's native kernels share about codes (native.c, native_matmul.c). */
#ifndef LUCID_NATIVE_CODES_H
#define LUCID_NATIVE_CODES_H
#include <stdint.h>

/* Requantize v (codes' units, zero point not yet added): clamp to [low - zp, high - zp], round half
 * to even, add zp. program_ops.requantize_codes's arithmetic, one value at a time. The clamp is written
 * as x86's max then min (``a > b ? a : b`` is maxps(a, b), NaN -> b): NaN -> lo as before, and the
 * compiler keeps it two instructions a vector, where a ``>=`` test compiled to compares and blends and
 * the quantize pass ran at half torch's speed (64 x 1024 floats: 11.8 against 7.1 us, same codes). */
#define CLAMP_LO(v, lo) ((v) > (lo) ? (v) : (lo))
#define CLAMP_HI(v, hi) ((v) < (hi) ? (v) : (hi))
#define REQUANTIZE(v, lo, hi, zp) ((int32_t)__builtin_rintf(CLAMP_HI(CLAMP_LO((v), (lo)), (hi))) + (zp))

#endif
