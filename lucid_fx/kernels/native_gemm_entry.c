/* The native GEMM's entry points (lucid_fx.kernels.linear_native): a product runs on AMX tiles where they take it
 * (native_amx.c), else on the VNNI / AVX2 kernels (native_gemm.c); the values are the same either way. */
#include "native_gemm.h"

static void gemm(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                 const gemm_finish_t *f) {
    if (!lucid_amx_gemm(x, packed, out, m, n, k, f)) lucid_gemm_kernels(x, packed, out, m, n, k, f);
}

#define GEMM_EXPORT(NAME, CODE, KIND)                                                                 \
    void NAME(const uint8_t *x, const int8_t *packed, CODE *out, int64_t m, int64_t n, int64_t k,      \
              const int32_t *offset, const float *w_scale, const float *bias, float x_scale,           \
              float inv_out, int32_t zp, float low, float high, \
              int32_t post) { \
        const gemm_finish_t f = {offset, w_scale, bias, x_scale, inv_out, (float)zp, low, high, KIND, post}; \
        gemm(x, packed, out, m, n, k, &f);                                                             \
    }
GEMM_EXPORT(lucid_gemm_uint8, uint8_t, GEMM_UINT8)
GEMM_EXPORT(lucid_gemm_int8, int8_t, GEMM_INT8)
GEMM_EXPORT(lucid_gemm_float32, float, GEMM_FLOAT32)

/* The GEMM into uint8 codes with a residual's uint8 codes added before the output's requantization
 * (oneDNN's "sum" post-op, native_gemm.h): accum is read where out is written, element for element. */
void lucid_gemm_sum_uint8(const uint8_t *x, const int8_t *packed, uint8_t *out, int64_t m, int64_t n, int64_t k,
                          const int32_t *offset, const float *w_scale, const float *bias, float x_scale, float inv_out,
                          int32_t zp, float low, float high, const uint8_t *accum, float sum_scale, int32_t sum_zp) {
    const gemm_finish_t f = {offset, w_scale, bias, x_scale, inv_out, (float)zp, low, high, GEMM_UINT8, 0,
                             accum, out, sum_scale, sum_zp};
    gemm(x, packed, out, m, n, k, &f);
}

/* The GEMM into float32 with an addend of the result's layout added after the float steps (a residual connection:
 * oneDNN's binary "add" post-op, the same float32 sum as torch.add of the two): out = y + addend, element for element. */
void lucid_gemm_add_float32(const uint8_t *x, const int8_t *packed, float *out, int64_t m, int64_t n, int64_t k,
                            const int32_t *offset, const float *w_scale, const float *bias, float x_scale, float inv_out,
                            int32_t zp, float low, float high, const float *addend) {
    const gemm_finish_t f = {offset, w_scale, bias, x_scale, inv_out, (float)zp, low, high, GEMM_FLOAT32, 0,
                             NULL, (const uint8_t *)out, 0.0f, 0, addend};
    gemm(x, packed, out, m, n, k, &f);
}
