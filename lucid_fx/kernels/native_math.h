/* Float functions the native kernels share (native_softmax.c, native_rnn.c), written in float32 steps
 * the compiler vectorizes where glibc's are a call a value. */
#ifndef LUCID_NATIVE_MATH_H
#define LUCID_NATIVE_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (-inf included: 0 after rounding), Cephes's expf in float32 steps, which the compiler
 * vectorizes where glibc's expf is a call a value (8x4x128x128 scores 2.5 -> 0.43 ms, 2x4x16x16 22 -> 12
 * us with native_softmax.c's chunks, AVX512-VNNI EPYC). Within 2 ulp of exp; below -87.3 it gives exp(-87.3),
 * 1e-38, whose code (times 255, rounded) is 0 as exp's. */
static inline float exp_below_zero(float x) {
    x = x > -87.33654f ? x : -87.33654f;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* x - n * ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n: n >= -126 here */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* The logistic sigmoid from one exponential of -|x| (never an overflow): 1 / (1 + e) for x >= 0, e / (1 + e)
 * below. Within 2e-7 of torch.sigmoid over [-20, 20] (tests/kernels/test_recurrent.py measures it). */
static inline float sigmoid_exp(float x) {
    const float e = exp_below_zero(x >= 0.0f ? -x : x);
    const float s = 1.0f / (1.0f + e);
    return x >= 0.0f ? s : e * s;
}

/* tanh from one exponential of -2|x|: (1 - e) / (1 + e) with x's sign. Near 0 its relative error grows (the
 * difference cancels) but its absolute error stays below 1e-7, which is what the recurrences need. */
static inline float tanh_exp(float x) {
    const float e = exp_below_zero(x >= 0.0f ? -2.0f * x : 2.0f * x);
    const float t = (1.0f - e) / (1.0f + e);
    return x >= 0.0f ? t : -t;
}

#endif
