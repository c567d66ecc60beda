/* lucid_fx's native CPU kernels: compiled by lucid_fx/kernels/native.py with the machine's C
 * compiler on first use, loaded with ctypes. Plain C99 on flat float32 / 8-bit buffers; the codes
 * must equal lucid_fx.kernels.reference's bit for bit (tests/kernels/test_native.py checks them).
 *
 * Quantize: codes = clamp(round_half_even(x * inv) + zp, qmin, qmax), one pass. The same pass counts
 * the NaN and +-inf of x (an exponent of all ones), so the finite check costs no second read; the
 * caller raises when the count is not 0 and never uses the codes then. A finite x whose product
 * overflows to +-inf is clamped like any other value. Clamping before rounding gives the same codes
 * for integer bounds, and keeps the float -> int32 conversion in range (NaN clamps to qmin). */
#include <stdint.h>
#include <string.h>

#define QUANTIZE(NAME, CODE)                                                                       \
    int64_t NAME(const float *restrict x, CODE *restrict out, int64_t n, float inv, int32_t zp,   \
                 int32_t qmin, int32_t qmax, int32_t check) {                                     \
        const float lo = (float)(qmin - zp), hi = (float)(qmax - zp);                             \
        int64_t nonfinite = 0;                                                                     \
        if (check) {                                                                               \
            for (int64_t i = 0; i < n; i++) {                                                      \
                uint32_t bits;                                                                     \
                memcpy(&bits, &x[i], sizeof bits);                                                 \
                nonfinite += (bits & 0x7f800000u) == 0x7f800000u;                                  \
                float v = x[i] * inv;                                                              \
                v = v >= lo ? v : lo; /* NaN -> lo: the conversion below stays defined */       \
                v = v <= hi ? v : hi;                                                              \
                out[i] = (CODE)((int32_t)__builtin_rintf(v) + zp);                                 \
            }                                                                                      \
        } else {                                                                                   \
            for (int64_t i = 0; i < n; i++) {                                                      \
                float v = x[i] * inv;                                                              \
                v = v >= lo ? v : lo; /* NaN -> lo: the conversion below stays defined */       \
                v = v <= hi ? v : hi;                                                              \
                out[i] = (CODE)((int32_t)__builtin_rintf(v) + zp);                                 \
            }                                                                                      \
        }                                                                                          \
        return nonfinite;                                                                          \
    }

QUANTIZE(lucid_quantize_uint8, uint8_t)
QUANTIZE(lucid_quantize_int8, int8_t)
