/* lucid_fx's native int8 GEMM for CPUs without VNNI: uint8 codes times int8 weights of at most 7
 * bits, with the float steps after the int32 sums fused in (compiled with native.c, see there).
 *
 * out = FINISH(((acc + offset[j]) * x_scale) * w_scale[j] + bias[j]), acc = sum_k x[i,k] * w[j,k]:
 * one float32 rounding per step (-ffp-contract=off, and the intrinsics below are separate multiplies
 * and adds). Codes are rint(clamp(y * inv_out + zp, low, high)); a float result is y clamped to
 * [low, high]. The vector steps give the scalar ones' values bit for bit: the same operations in the
 * same order, the clamp as compare-and-select, and vcvtps2dq rounds half to even as rintf does.
 *
 * The weight is packed once (lucid_fx.kernels.linear_native.packed_weight): blocks of 16 outputs by 4
 * inputs, [ceil(N/16)][ceil(K/4)][16][4], zero-padded. With AVX2 a step broadcasts 4 input codes of
 * a row, multiplies them with the block's 64 weights (vpmaddubsw: u8 x s8, adjacent pairs summed in
 * int16) and sums the pairs into 8 int32 lanes per 8 outputs (vpmaddwd by 1), 4 rows at a time. A
 * pair sum is exact while |w| <= 64: 2 * 255 * 64 = 32640 <= 32767 (the weight grid of CPUs without
 * VNNI, lucid_fx.kernels.target.NARROW_GRID; the caller checks). Without AVX2 a plain loop computes
 * the same values. */
#include <stdint.h>
#include <string.h>

#define GEMM_NB 16 /* outputs per packed block */
#define GEMM_KB 4  /* inputs per step */

enum { GEMM_UINT8, GEMM_INT8, GEMM_FLOAT32 };

typedef struct {
    const int32_t *offset;
    const float *w_scale, *bias;
    float x_scale, inv_out, zp, low, high;
    int kind;
} gemm_finish_t;

#define GEMM_CLAMP(v, lo, hi) ((v) >= (lo) ? ((v) <= (hi) ? (v) : (hi)) : (lo))

/* The float steps of one sum for output j, written to out[0] (scalar: tails and builds without AVX2). */
static inline void gemm_finish1(int32_t acc, int64_t j, const gemm_finish_t *f, void *out) {
    float y = (float)(acc + f->offset[j]) * f->x_scale;
    y = y * f->w_scale[j];
    if (f->bias) y = y + f->bias[j];
    if (f->kind == GEMM_FLOAT32) {
        *(float *)out = GEMM_CLAMP(y, f->low, f->high);
        return;
    }
    const float v = y * f->inv_out + f->zp;
    const int32_t code = (int32_t)__builtin_rintf(GEMM_CLAMP(v, f->low, f->high));
    if (f->kind == GEMM_UINT8) *(uint8_t *)out = (uint8_t)code;
    else *(int8_t *)out = (int8_t)code;
}

static inline size_t gemm_size(int kind) { return kind == GEMM_FLOAT32 ? 4 : 1; }

#if defined(__AVX2__)
#include <immintrin.h>
#define GEMM_AVX2 1

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

/* The float steps of 8 sums for outputs j..j+7, written to out (8 codes or floats). */
static inline void gemm_finish8(__m256i acc, int64_t j, const gemm_finish_t *f, void *out) {
    __m256 y = _mm256_cvtepi32_ps(_mm256_add_epi32(acc, _mm256_loadu_si256((const __m256i *)(f->offset + j))));
    y = _mm256_mul_ps(y, _mm256_set1_ps(f->x_scale));
    y = _mm256_mul_ps(y, _mm256_loadu_ps(f->w_scale + j));
    if (f->bias) y = _mm256_add_ps(y, _mm256_loadu_ps(f->bias + j));
    const __m256 lo = _mm256_set1_ps(f->low), hi = _mm256_set1_ps(f->high);
    if (f->kind == GEMM_FLOAT32) {
        _mm256_storeu_ps((float *)out, gemm_clamp8(y, lo, hi));
        return;
    }
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(y, _mm256_set1_ps(f->inv_out)), _mm256_set1_ps(f->zp));
    const __m256i codes = _mm256_cvtps_epi32(gemm_clamp8(v, lo, hi)); /* in [low, high]: no saturation below */
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    const __m128i bytes = f->kind == GEMM_UINT8 ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words);
    _mm_storel_epi64((__m128i *)out, bytes);
}

/* The float steps of row r's 16 sums (two vectors) for outputs j0..j0+15, or the ones below n. */
static inline void gemm_finish16(__m256i lo8, __m256i hi8, int64_t j0, int64_t n, const gemm_finish_t *f, char *row) {
    const size_t size = gemm_size(f->kind);
    if (j0 + GEMM_NB <= n) {
        gemm_finish8(lo8, j0, f, row);
        gemm_finish8(hi8, j0 + 8, f, row + 8 * size);
        return;
    }
    int32_t sums[GEMM_NB];
    _mm256_storeu_si256((__m256i *)sums, lo8);
    _mm256_storeu_si256((__m256i *)(sums + 8), hi8);
    for (int64_t c = 0; j0 + c < n; c++) gemm_finish1(sums[c], j0 + c, f, row + c * size);
}

/* One step of row r: its 4 codes v times the block's weights w0, w1, added to its sums a<r>0, a<r>1. */
#define GEMM_STEP(r, v)                                                                               \
    {                                                                                                 \
        const __m256i xv = _mm256_set1_epi32(v);                                                      \
        a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w0), ones));  \
        a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w1), ones));  \
    }
#define GEMM_LOAD(r) (memcpy(&v, x + (r) * k + g * GEMM_KB, GEMM_KB), v) /* one 4-byte load */
/* The steps of one block: the full ones, then the last, zero-padded, if k % 4. */
#define GEMM_STEPS(STEPS)                                                                             \
    const __m256i ones = _mm256_set1_epi16(1);                                                        \
    const int64_t full = k / GEMM_KB;                                                                 \
    int32_t v;                                                                                        \
    for (int64_t g = 0; g <= full; g++) {                                                             \
        if (g == full && full * GEMM_KB == k) break;                                                  \
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + g * 64));                        \
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + g * 64 + 32));                   \
        if (g < full) { STEPS(GEMM_LOAD) }                                                            \
        else { STEPS(GEMM_TAIL) }                                                                     \
    }
#define GEMM_TAIL(r) gemm_x4(x + (r) * k, g, k)
#define GEMM_STEPS4(LOAD) GEMM_STEP(0, LOAD(0)) GEMM_STEP(1, LOAD(1)) GEMM_STEP(2, LOAD(2)) GEMM_STEP(3, LOAD(3))
#define GEMM_STEPS1(LOAD) GEMM_STEP(0, LOAD(0))

/* Four rows of x (k codes each) with one packed block of 16 outputs, finished into out's rows. */
static void gemm_block4(const uint8_t *x, int64_t k, const int8_t *w, int64_t j0, int64_t n,
                        const gemm_finish_t *f, char *out) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    GEMM_STEPS(GEMM_STEPS4)
    const size_t row = n * gemm_size(f->kind), at = j0 * gemm_size(f->kind);
    gemm_finish16(a00, a01, j0, n, f, out + at);
    gemm_finish16(a10, a11, j0, n, f, out + row + at);
    gemm_finish16(a20, a21, j0, n, f, out + 2 * row + at);
    gemm_finish16(a30, a31, j0, n, f, out + 3 * row + at);
}

static void gemm_block1(const uint8_t *x, int64_t k, const int8_t *w, int64_t j0, int64_t n,
                        const gemm_finish_t *f, char *out) {
    __m256i a00 = _mm256_setzero_si256(), a01 = a00;
    GEMM_STEPS(GEMM_STEPS1)
    gemm_finish16(a00, a01, j0, n, f, out + j0 * gemm_size(f->kind));
}
#else
#define GEMM_AVX2 0
#endif

int32_t lucid_gemm_vectorized(void) { return GEMM_AVX2; }

static void gemm(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                 const gemm_finish_t *f) {
    const int64_t nb = (n + GEMM_NB - 1) / GEMM_NB, kg = (k + GEMM_KB - 1) / GEMM_KB;
    const size_t size = gemm_size(f->kind);
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *w = packed + b * kg * GEMM_NB * GEMM_KB;
#if GEMM_AVX2
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) gemm_block4(x + i * k, k, w, b * GEMM_NB, n, f, (char *)out + i * n * size);
        for (; i < m; i++) gemm_block1(x + i * k, k, w, b * GEMM_NB, n, f, (char *)out + i * n * size);
#else
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = b * GEMM_NB; j < n && j < (b + 1) * GEMM_NB; j++) {
                int32_t s = 0;
                for (int64_t kk = 0; kk < k; kk++)
                    s += (int32_t)x[i * k + kk] * w[(kk / GEMM_KB) * 64 + (j % GEMM_NB) * GEMM_KB + kk % GEMM_KB];
                gemm_finish1(s, j, f, (char *)out + (i * n + j) * size);
            }
#endif
    }
}

#define GEMM_EXPORT(NAME, CODE, KIND)                                                                 \
    void NAME(const uint8_t *x, const int8_t *packed, CODE *out, int64_t m, int64_t n, int64_t k,      \
              const int32_t *offset, const float *w_scale, const float *bias, float x_scale,           \
              float inv_out, int32_t zp, float low, float high) {                                      \
        const gemm_finish_t f = {offset, w_scale, bias, x_scale, inv_out, (float)zp, low, high, KIND}; \
        gemm(x, packed, out, m, n, k, &f);                                                             \
    }
GEMM_EXPORT(lucid_gemm_uint8, uint8_t, GEMM_UINT8)
GEMM_EXPORT(lucid_gemm_int8, int8_t, GEMM_INT8)
GEMM_EXPORT(lucid_gemm_float32, float, GEMM_FLOAT32)
