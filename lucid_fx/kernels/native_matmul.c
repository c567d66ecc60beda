/* The batched product of two 8-bit code tensors (attention's q @ k^T and p @ v), compiled with
 * native.c (see there):
 *
 *   out[b, i, j] = requantize(sum_k (a[b, i, k] - a_zp) * (b[b, k, j] - b_zp) * mult)
 *
 * with the sums exact in int32, mult one multiplier, or one a row where rmult is given (softmax_matmul's
 * rows, each divided by its exponentials' sum: rmult[b * m + i], a's batches not broadcast). program_ops.matmul_codes sums the same products in float32, which is
 * exact too while every partial sum stays within 2^24 (the caller checks k * max|a - a_zp| *
 * max|b - b_zp| <= 2^24), then makes the same float32 multiply: the codes are equal bit for bit.
 *
 * g: the 4 batch sizes (outermost first), m, n, k; then a's strides (4 batch, row, column) and b's,
 * in elements (0 along a broadcast batch dim). out is contiguous (batch..., m, n).
 *
 * With VNNI, the operands are packed as bytes and multiplied by vpdpbusd (below, MATMUL_VNNI). Without
 * it, each batch's operands are centred into int16 first, zero-padded: a as rows of kp values (m rounded
 * up to 4 rows, kp = k rounded up to 2), b as pairs of rows interleaved, [kp / 2][np][2] (np = n
 * rounded up to 16). The packing loops write along the packed rows and read along a contiguous
 * dimension where there is one (keys transposed: each pair of a key's values together, the key
 * block staying in L1), so the compiler vectorizes them; written the other way round, with a store
 * every 512 bytes, packing a transposed key took a third of q @ k^T's time. With AVX2 a step
 * broadcasts two values of each of 4 rows of a and multiplies them with 16 columns' pairs
 * (vpmaddwd: two products summed into each int32 lane), 4 rows x 16 outputs at a time, no
 * horizontal sums; the 16 sums of a row are requantized, packed to codes and stored together.
 * Without AVX2 a plain loop computes the same sums. Returns 0, or -1 when a thread's buffers cannot be
 * allocated (its batches unwritten then). */
#include <stdlib.h>
#include <string.h>

#include "native_codes.h" /* REQUANTIZE */
#include "native_threads.h" /* LUCID_SPLIT */

#define MM_ROWS 4
#define MM_COLS 16
/* From this many multiply-adds a product's batches are split among the threads (native_threads.h), whole batches
 * each: attention's 8 x 4 heads of 128 x 64 codes (AVX512-VNNI EPYC), q @ k^T 398 -> 202 us, p @ v 388 -> 197 at 2
 * threads; the encoder block of benchmarks/models.py, its softmax's rows split too, 0.82 of its time before. */
#define MM_PARALLEL_MNK 1048576

#if defined(__AVX2__)
#include <immintrin.h>
#define MATMUL_AVX2 1

/* rint(clamp(sum * mult)) + zp of 8 sums: the scalar REQUANTIZE's steps (one float32 multiply, the
 * clamp, round half to even as vcvtps2dq does), bit for bit; sums are finite, so min/max clamp as
 * the scalar compare does. */
static inline __m256i requantize8(__m256i sums, __m256 mult, __m256 lo, __m256 hi, __m256i zp) {
    const __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums), mult), hi), lo);
    return _mm256_add_epi32(_mm256_cvtps_epi32(v), zp);
}

/* 16 codes from two vectors of 8 (already within the code range, so the saturating packs are exact). */
static inline __m128i pack16_uint8_t(__m256i lo8, __m256i hi8) {
    const __m128i a = _mm_packs_epi32(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1));
    const __m128i b = _mm_packs_epi32(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1));
    return _mm_packus_epi16(a, b);
}
static inline __m128i pack16_int8_t(__m256i lo8, __m256i hi8) {
    const __m128i a = _mm_packs_epi32(_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1));
    const __m128i b = _mm_packs_epi32(_mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1));
    return _mm_packs_epi16(a, b);
}

/* The codes of rows i..i+3, columns j..j+15 (those below m and n written). */
#define MATMUL_BLOCK(CODE)                                                                         \
    {                                                                                              \
        __m256i acc[MM_ROWS][2];                                                                   \
        for (int r = 0; r < MM_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();         \
        for (int64_t p = 0; p < kp / 2; p++) {                                                     \
            const int16_t *w = pb + (p * np + j) * 2;                                              \
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);                            \
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 16));                     \
            for (int r = 0; r < MM_ROWS; r++) {                                                    \
                int32_t pair;                                                                      \
                memcpy(&pair, pa + (i + r) * kp + 2 * p, sizeof pair);                             \
                const __m256i x = _mm256_set1_epi32(pair);                                         \
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(x, w0));                 \
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(x, w1));                 \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MM_ROWS && i + r < m; r++)                                             \
            MATMUL_STORE(CODE, o + (i + r) * n + j, acc[r][0], acc[r][1], MM_VMULT(rm, i + r))   \
    }

/* The row's multiplier: its own where rm (the batch's rows' multipliers) is given, else vmult's. */
#define MM_VMULT(rm, r) ((rm) ? _mm256_set1_ps((rm)[r]) : vmult)
/* The codes of 16 sums s0, s1 at `at`, columns j..j+15 of a row (those below n written), times vm. */
#define MATMUL_STORE(CODE, at, s0, s1, vm)                                                         \
    {                                                                                              \
        const __m256 rowmult = (vm);                                                               \
        const __m128i codes = pack16_##CODE(requantize8(s0, rowmult, vlo, vhi, vzp),               \
                                            requantize8(s1, rowmult, vlo, vhi, vzp));              \
        CODE *row = (at);                                                                          \
        if (j + MM_COLS <= n) _mm_storeu_si128((__m128i *)row, codes);                             \
        else {                                                                                     \
            CODE tail[MM_COLS];                                                                    \
            _mm_storeu_si128((__m128i *)tail, codes);                                              \
            memcpy(row, tail, (size_t)(n - j) * sizeof *row);                                      \
        }                                                                                          \
    }
#else
#define MATMUL_AVX2 0
#define MATMUL_BLOCK(CODE)                                                                         \
    for (int64_t r = i; r < i + MM_ROWS && r < m; r++)                                             \
        for (int64_t c = j; c < j + MM_COLS && c < n; c++) {                                       \
            int32_t s = 0;                                                                         \
            for (int64_t t = 0; t < kp; t++) s += (int32_t)pa[r * kp + t] * (int32_t)pb[((t / 2) * np + c) * 2 + t % 2]; \
            o[r * n + c] = (CODE)REQUANTIZE((float)s * (rm ? rm[r] : mult), lo, hi, zp);         \
        }
#endif

int32_t lucid_matmul_vectorized(void) { return MATMUL_AVX2; }

/* The offset of batch number `batch` (of g[0] * g[1] * g[2] * g[3], the last dim fastest) along strides s. */
static inline int64_t mm_batch_offset(const int64_t *g, const int64_t *s, int64_t batch) {
    int64_t offset = 0;
    for (int d = 3; d >= 0; d--) {
        offset += (batch % g[d]) * s[d];
        batch /= g[d];
    }
    return offset;
}

/* STORE for every i < rows and t < cols, the loop along the smaller of the strides innermost. */
#define PACK(rows, cols, row_stride, col_stride, STORE)                                            \
    if ((col_stride) <= (row_stride)) {                                                            \
        for (int64_t i = 0; i < (rows); i++)                                                       \
            for (int64_t t = 0; t < (cols); t++) STORE;                                            \
    } else {                                                                                       \
        for (int64_t t = 0; t < (cols); t++)                                                       \
            for (int64_t i = 0; i < (rows); i++) STORE;                                            \
    }

/* With VNNI (vpdpbusd: the four u8 x s8 products of each int32 lane summed at once, exact), the
 * operands are packed as bytes, not centred int16: a as u8 rows of kp values (int8 codes flipped by
 * 128), b as s8 in groups of 4 values (uint8 codes flipped by 128), MM_AT's layout. The centred
 * sum is then the same exact int32 as above:
 *   sum_t (a_u - A0)(b_s - B0) = S - A0 * colsum(b_s)[j] - B0 * rowsum(a_u)[i] + k * A0 * B0,
 * A0 = a_zp (+ 128 for int8 codes), B0 = b_zp (- 128 for uint8 codes), |each term| < 2^31 for the
 * k the plan takes. A step multiplies 4 values of each of 4 rows with 16 columns: twice vpmaddwd's
 * products per instruction, half its packed bytes. Measured on an AVX512-VNNI EPYC, 8x4 heads of
 * 128 x 64 codes, runs differ: q @ k^T 660-870 -> 360-470 us, p @ v 660-760 -> 340-430 us. */
#include "native_gemm.h" /* GEMM_VNNI, GEMM_STEP */
#define MATMUL_VNNI GEMM_VNNI

#if MATMUL_VNNI
#define MM_QUAD(r) (memcpy(&quad, x + (r) * kp + 4 * p, sizeof quad), quad)
#define MM_ROW(CODE, r, acc0, acc1)                                                                \
    if ((r) < rows) {                                                                              \
        const __m256i rcv = _mm256_set1_epi32(rc[r]);                                              \
        MATMUL_STORE(CODE, out + (r) * n + j, _mm256_add_epi32(_mm256_add_epi32(acc0, c0), rcv),    \
                     _mm256_add_epi32(_mm256_add_epi32(acc1, c1), rcv), MM_VMULT(rm, r))           \
    }
/* The codes of 4 packed rows x (kp values each, the rows below `rows` written to out) with every
 * packed block of b: per block, native_gemm.h's steps (GEMM_STEP), then the row and column terms
 * and the requantization. A function of its own: inside the product's loops the compiler kept the
 * accumulators on the stack, at a third of the speed. */
#define MM_ROWS_VNNI(CODE)                                                                         \
    static __attribute__((noinline)) void mm_rows_vnni_##CODE(                                     \
        const uint8_t *restrict x, int64_t kp, const uint8_t *restrict pb, int64_t n, const int32_t *restrict cc, \
        const int32_t *restrict rc, int64_t rows, CODE *restrict out, float mult, const float *restrict rm, \
        float lo, float hi, int32_t zp) {                                                          \
        const __m256 vmult = _mm256_set1_ps(mult), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi); \
        const __m256i vzp = _mm256_set1_epi32(zp);                                                 \
        for (int64_t j = 0; j < n; j += MM_COLS) {                                                 \
            const uint8_t *w = pb + j * kp;                                                        \
            __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, \
                    a30 = a00, a31 = a00;                                                          \
            const __m256i ones = a00;                                                              \
            for (int64_t p = 0; p < kp / 4; p++, w += MM_COLS * 4) {                               \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)w);                        \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32));                 \
                int32_t quad;                                                                      \
                GEMM_STEP(0, MM_QUAD(0)) GEMM_STEP(1, MM_QUAD(1)) GEMM_STEP(2, MM_QUAD(2)) GEMM_STEP(3, MM_QUAD(3)) \
            }                                                                                      \
            const __m256i c0 = _mm256_loadu_si256((const __m256i *)(cc + j));                     \
            const __m256i c1 = _mm256_loadu_si256((const __m256i *)(cc + j + 8));                 \
            MM_ROW(CODE, 0, a00, a01) MM_ROW(CODE, 1, a10, a11) MM_ROW(CODE, 2, a20, a21) MM_ROW(CODE, 3, a30, a31) \
        }                                                                                          \
    }
MM_ROWS_VNNI(uint8_t)
MM_ROWS_VNNI(int8_t)

/* The row's multiplier as a number (MM_VMULT's). */
#define MM_MULT1(rm, r) ((rm) ? (rm)[r] : mult)
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* A row of a tile step's 32 sums (blocks b and b + 1, both whole: 1, else 0 and nothing written) in 16 lanes at a time:
 * requantize8's steps (one multiply, min then max, round half to even, the zero point added), the codes' low bytes
 * (within the code range). q @ k^T of 8 x 4 heads of 128 x 64 codes (AMX Xeon, 2 threads): 102 against 114 us a call. */
static inline int mm_amx_row16(const int32_t *sums, const int32_t *cc, int32_t rc, float mult, int64_t b, int64_t nb,
                               int64_t n, float lo, float hi, int32_t zp, void *out) {
    if (b + 1 >= nb || (b + 2) * MM_COLS > n) return 0;
    const __m512i r = _mm512_set1_epi32(rc), z = _mm512_set1_epi32(zp);
    const __m512 vm = _mm512_set1_ps(mult), vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (int h = 0; h < 2; h++) {
        const int64_t j = (b + h) * MM_COLS;
        const __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_load_si512(sums + h * MM_COLS), _mm512_loadu_si512(cc + j)), r);
        const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), vm), vhi), vlo);
        _mm_storeu_si128((__m128i *)((uint8_t *)out + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), z)));
    }
    return 1;
}
#define MM_AMX_ROW16(CODE, sums, cc, rc, mult1, b, nb, n, o) mm_amx_row16(sums, cc, rc, mult1, b, nb, n, lo, hi, zp, o)
#else
#define MM_AMX_ROW16(CODE, sums, cc, rc, mult1, b, nb, n, o) 0
#endif

/* mm_rows_vnni's codes for all m rows (padded to 32, kp a multiple of 64) on AMX tiles (native_amx.c), 32 rows by
 * two blocks a step: the same exact sums, so the same codes. Attention's 8 x 4 heads of 128 x 64 codes (AMX Xeon, 2
 * threads): the encoder block's two products as profiled in the model 192 -> 160 us each, requantized 8 lanes at a
 * time (most of what is left is packing and requantizing: perf put the tiles' sums at a fifth of it). */
#define MM_ROWS_AMX(CODE)                                                                          \
    static void mm_rows_amx_##CODE(const uint8_t *pa, int64_t kp, const uint8_t *pb, int64_t m, int64_t n,       \
                                   const int32_t *cc, const int32_t *rc, CODE *out, float mult, const float *rm, \
                                   float lo, float hi, int32_t zp) {                                \
        const __m256 vmult = _mm256_set1_ps(mult), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi); \
        const __m256i vzp = _mm256_set1_epi32(zp);                                                 \
        const int64_t nb = (n + MM_COLS - 1) / MM_COLS;                                            \
        int32_t c[AMX_TILE_ROWS * 2 * MM_COLS] __attribute__((aligned(64)));                       \
        for (int64_t i = 0; i < m; i += AMX_TILE_ROWS)                                             \
            for (int64_t b = 0; b < nb; b += 2) {                                                  \
                const int8_t *w0 = (const int8_t *)pb + b * MM_COLS * kp, *w1 = b + 1 < nb ? w0 + MM_COLS * kp : w0; \
                lucid_amx_sums(pa + i * kp, kp, kp, w0, w1, c);                                    \
                for (int64_t r = 0; r < AMX_TILE_ROWS && i + r < m; r++) {                         \
                    const int32_t *sums = c + r * 2 * MM_COLS;                                     \
                    CODE *o = out + (i + r) * n;                                                   \
                    if (MM_AMX_ROW16(CODE, sums, cc, rc[i + r], MM_MULT1(rm, i + r), b, nb, n, o)) continue; \
                    const __m256i rcv = _mm256_set1_epi32(rc[i + r]);                              \
                    for (int64_t h = 0; h < 2 && b + h < nb; h++) {                                \
                        const int64_t j = (b + h) * MM_COLS;                                       \
                        const __m256i s0 = _mm256_add_epi32(_mm256_add_epi32(_mm256_load_si256((const __m256i *)(sums + h * MM_COLS)), \
                            _mm256_loadu_si256((const __m256i *)(cc + j))), rcv);                  \
                        const __m256i s1 = _mm256_add_epi32(_mm256_add_epi32(_mm256_load_si256((const __m256i *)(sums + h * MM_COLS + 8)), \
                            _mm256_loadu_si256((const __m256i *)(cc + j + 8))), rcv);              \
                        MATMUL_STORE(CODE, o + j, s0, s1, MM_VMULT(rm, i + r))                     \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
    }
MM_ROWS_AMX(uint8_t)
MM_ROWS_AMX(int8_t)

/* 16 columns of 4 rows as 16 groups of 4 bytes (a block's step), each flipped by f: a 4 x 16
 * byte transpose in unpacks (one byte at a time, it took a third of p @ v's time). */
static inline void mm_interleave4(const uint8_t *y0, const uint8_t *y1, const uint8_t *y2, const uint8_t *y3,
                                  uint8_t f, uint8_t *out) {
    const __m128i flip = _mm_set1_epi8((char)f);
    const __m128i r0 = _mm_loadu_si128((const __m128i *)y0), r1 = _mm_loadu_si128((const __m128i *)y1);
    const __m128i r2 = _mm_loadu_si128((const __m128i *)y2), r3 = _mm_loadu_si128((const __m128i *)y3);
    const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
    const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
    _mm_storeu_si128((__m128i *)out, _mm_xor_si128(_mm_unpacklo_epi16(lo01, lo23), flip));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_xor_si128(_mm_unpackhi_epi16(lo01, lo23), flip));
    _mm_storeu_si128((__m128i *)(out + 32), _mm_xor_si128(_mm_unpacklo_epi16(hi01, hi23), flip));
    _mm_storeu_si128((__m128i *)(out + 48), _mm_xor_si128(_mm_unpackhi_epi16(hi01, hi23), flip));
}

/* The 16 column sums of a packed block w (kq steps): each step's 4 s8 values of a column times 1. */
static void mm_colsums_vnni(const uint8_t *restrict w, int64_t kq, int32_t *restrict sums) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i s0 = _mm256_setzero_si256(), s1 = s0;
    for (int64_t p = 0; p < kq; p++, w += MM_COLS * 4) {
        s0 = GEMM_DOT(s0, ones, _mm256_loadu_si256((const __m256i *)w));
        s1 = GEMM_DOT(s1, ones, _mm256_loadu_si256((const __m256i *)(w + 32)));
    }
    _mm256_storeu_si256((__m256i *)sums, s0);
    _mm256_storeu_si256((__m256i *)(sums + 8), s1);
}

/* Where b's value t of column i is packed: blocks of 16 columns, each [kp / 4][16][4], so a block's
 * steps read its bytes in order (native_gemm.c's weight layout). */
#define MM_AT(t, i) ((((i) / MM_COLS * kq + (t) / 4) * MM_COLS + (i) % MM_COLS) * 4 + (t) % 4)

#define MATMUL_VNNI_FN(NAME, CODE)                                                                 \
    static int32_t NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out, const int64_t *restrict g, \
                        int32_t a_zp, int32_t b_zp, float mult, const float *restrict rmult, int32_t zp,    \
                        int32_t low, int32_t high) {                                               \
        const int64_t m = g[4], n = g[5], k = g[6], *sa = g + 7, *sb = g + 13;                     \
        /* on AMX tiles (more than 8 rows): the inputs zero-padded to a multiple of 64, the rows to 32 */ \
        const int tiles = lucid_amx_ready() && m > 8, rows = tiles ? AMX_TILE_ROWS : MM_ROWS;       \
        const int64_t kq = tiles ? (k + AMX_TILE_K - 1) / AMX_TILE_K * (AMX_TILE_K / 4) : (k + 3) / 4; \
        const int64_t kp = 4 * kq, mp = (m + rows - 1) / rows * rows;                              \
        const int64_t np = (n + MM_COLS - 1) / MM_COLS * MM_COLS;                                  \
        const int is_signed = (CODE)-1 < 0;                                                        \
        const uint8_t fa = is_signed ? 0x80 : 0, fb = is_signed ? 0 : 0x80;                        \
        const int32_t a0 = a_zp + (is_signed ? 128 : 0), b0 = b_zp - (is_signed ? 0 : 128);        \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        const int64_t batches = g[0] * g[1] * g[2] * g[3];                                         \
        int32_t failed = 0;                                                                        \
        LUCID_SPLIT(batches, 1, lucid_threads(batches * m * n * k, MM_PARALLEL_MNK, batches), {    \
        int32_t *rc = calloc((size_t)(mp + np) * sizeof *rc + (size_t)(mp * kp + kp * np), 1);     \
        LUCID_CHUNK_NEEDS(rc, failed)                                                              \
        int32_t *cc = rc + mp; /* the row terms -B0 * rowsum, the column terms k*A0*B0 - A0 * colsum */ \
        uint8_t *pa = (uint8_t *)(cc + np), *pb = pa + mp * kp;                                    \
        if (tiles) lucid_amx_begin();                                                              \
        for (int64_t batch = from; batch < to; batch++) {                                          \
            const CODE *x = a + mm_batch_offset(g, sa, batch), *y = b + mm_batch_offset(g, sb, batch); \
            CODE *o = out + batch * m * n;                                                         \
            const float *rows_mult = rmult ? rmult + batch * m : NULL;                             \
            if (sa[5] == 1) /* rows of a contiguous: a loop the compiler vectorizes */               \
                for (int64_t i = 0; i < m; i++)                                                    \
                    for (int64_t t = 0; t < k; t++) pa[i * kp + t] = (uint8_t)x[i * sa[4] + t] ^ fa; \
            else PACK(m, k, sa[4], sa[5], pa[i * kp + t] = (uint8_t)x[i * sa[4] + t * sa[5]] ^ fa)  \
            if (sb[4] == 1) /* columns of b contiguous (keys transposed): 4 values a copy */        \
                for (int64_t i = 0; i < n; i++) {                                                  \
                    const uint8_t *col = (const uint8_t *)(y + i * sb[5]);                         \
                    for (int64_t p = 0; p < k / 4; p++) {                                          \
                        uint32_t quad;                                                             \
                        memcpy(&quad, col + 4 * p, sizeof quad);                                   \
                        quad ^= fb * 0x01010101u;                                                  \
                        memcpy(pb + MM_AT(4 * p, i), &quad, sizeof quad);                          \
                    }                                                                              \
                    for (int64_t t = k / 4 * 4; t < k; t++) pb[MM_AT(t, i)] = col[t] ^ fb;         \
                }                                                                                  \
            else if (sb[5] == 1) /* rows of b contiguous (values): four rows interleaved */        \
                for (int64_t p = 0; p < kq; p++) {                                                 \
                    if (4 * p + 4 <= k) {                                                          \
                        const uint8_t *y0 = (const uint8_t *)(y + 4 * p * sb[4]);                  \
                        const uint8_t *y1 = y0 + sb[4], *y2 = y1 + sb[4], *y3 = y2 + sb[4];        \
                        for (int64_t j0 = 0; j0 < n; j0 += MM_COLS) {                              \
                            uint8_t *pr = pb + MM_AT(4 * p, j0);                                   \
                            if (j0 + MM_COLS <= n) {                                               \
                                mm_interleave4(y0 + j0, y1 + j0, y2 + j0, y3 + j0, fb, pr);        \
                                continue;                                                          \
                            }                                                                      \
                            for (int64_t i = j0; i < n; i++, pr += 4) {                            \
                                pr[0] = y0[i] ^ fb;                                                \
                                pr[1] = y1[i] ^ fb;                                                \
                                pr[2] = y2[i] ^ fb;                                                \
                                pr[3] = y3[i] ^ fb;                                                \
                            }                                                                      \
                        }                                                                          \
                    } else                                                                         \
                        for (int64_t t = 4 * p; t < k; t++)                                        \
                            for (int64_t i = 0; i < n; i++) pb[MM_AT(t, i)] = (uint8_t)y[t * sb[4] + i] ^ fb; \
                }                                                                                  \
            else PACK(n, k, sb[5], sb[4], pb[MM_AT(t, i)] = (uint8_t)y[t * sb[4] + i * sb[5]] ^ fb) \
            for (int64_t i = 0; i < m; i++) {                                                      \
                int32_t s = 0;                                                                     \
                for (int64_t t = 0; t < kp; t++) s += pa[i * kp + t];                              \
                rc[i] = -b0 * s;                                                                   \
            }                                                                                      \
            for (int64_t c = 0; c < np; c += MM_COLS) mm_colsums_vnni(pb + c * kp, kq, cc + c);     \
            for (int64_t c = 0; c < np; c++) cc[c] = (int32_t)k * a0 * b0 - a0 * cc[c];            \
            if (tiles) {                                                                           \
                mm_rows_amx_##CODE(pa, kp, pb, m, n, cc, rc, o, mult, rows_mult, lo, hi, zp);      \
                continue;                                                                          \
            }                                                                                      \
            for (int64_t i = 0; i < m; i += MM_ROWS)                                               \
                mm_rows_vnni_##CODE(pa + i * kp, kp, pb, n, cc, rc + i, m - i, o + i * n, mult,         \
                                    rows_mult ? rows_mult + i : NULL, lo, hi, zp);                 \
        }                                                                                          \
        if (tiles) lucid_amx_end();                                                                \
        free(rc);                                                                                  \
        })                                                                                         \
        if (tiles) lucid_amx_counted();                                                            \
        return failed ? -1 : 0; /* every batch written where each thread had its buffers */       \
    }
#endif

#define MATMUL(NAME, CODE)                                                                         \
    int32_t NAME(const CODE *restrict a, const CODE *restrict b, CODE *restrict out, const int64_t *restrict g, \
                 int32_t a_zp, int32_t b_zp, float mult, const float *restrict rmult, int32_t zp,     \
                 int32_t low, int32_t high) {                                                      \
        MATMUL_VNNI_CALL(NAME, a, b, out, g, a_zp, b_zp, mult, rmult, zp, low, high)              \
        const int64_t m = g[4], n = g[5], k = g[6], *sa = g + 7, *sb = g + 13;                     \
        const int64_t kp = k + k % 2, mp = (m + MM_ROWS - 1) / MM_ROWS * MM_ROWS;                  \
        const int64_t np = (n + MM_COLS - 1) / MM_COLS * MM_COLS;                                  \
        const float lo = (float)(low - zp), hi = (float)(high - zp);                               \
        (void)lo; (void)hi;                                                                        \
        MATMUL_CONSTANTS                                                                           \
        const int64_t batches = g[0] * g[1] * g[2] * g[3];                                         \
        int32_t failed = 0;                                                                        \
        LUCID_SPLIT(batches, 1, lucid_threads(batches * m * n * k, MM_PARALLEL_MNK, batches), {    \
        int16_t *pa = calloc((size_t)(mp * kp + kp * np), sizeof *pa);                             \
        LUCID_CHUNK_NEEDS(pa, failed)                                                              \
        int16_t *pb = pa + mp * kp;                                                                \
        for (int64_t batch = from; batch < to; batch++) {                                          \
            const CODE *x = a + mm_batch_offset(g, sa, batch), *y = b + mm_batch_offset(g, sb, batch); \
            CODE *o = out + batch * m * n;                                                         \
            const float *rm = rmult ? rmult + batch * m : NULL; /* the batch's rows' multipliers */ \
            /* each operand read along its smaller stride (a transposed view of keys: down its columns) */ \
            if (sa[5] == 1) /* rows of a contiguous: a loop the compiler vectorizes */               \
                for (int64_t i = 0; i < m; i++) {                                                  \
                    const CODE *xr = x + i * sa[4];                                                \
                    int16_t *pr = pa + i * kp;                                                     \
                    for (int64_t t = 0; t < k; t++) pr[t] = (int16_t)((int32_t)xr[t] - a_zp);      \
                }                                                                                  \
            else PACK(m, k, sa[4], sa[5], pa[i * kp + t] = (int16_t)((int32_t)x[i * sa[4] + t * sa[5]] - a_zp)) \
            if (sb[5] == 1) /* rows of b contiguous (values): two rows interleaved into pairs */   \
                for (int64_t t = 0; t < k; t += 2) {                                               \
                    const CODE *y0 = y + t * sb[4], *y1 = t + 1 < k ? y0 + sb[4] : NULL;           \
                    int16_t *pr = pb + (t / 2) * np * 2;                                           \
                    if (y1) for (int64_t i = 0; i < n; i++) {                                      \
                        pr[2 * i] = (int16_t)((int32_t)y0[i] - b_zp);                              \
                        pr[2 * i + 1] = (int16_t)((int32_t)y1[i] - b_zp);                          \
                    }                                                                              \
                    else for (int64_t i = 0; i < n; i++) pr[2 * i] = (int16_t)((int32_t)y0[i] - b_zp); \
                }                                                                                  \
            else if (sb[4] == 1) /* columns of b contiguous (keys transposed): each pair read together, */ \
                for (int64_t t = 0; t < k; t += 2) { /* written along the packed row (b stays in L1) */   \
                    int16_t *pr = pb + (t / 2) * np * 2;                                           \
                    if (t + 1 < k) for (int64_t i = 0; i < n; i++) {                               \
                        pr[2 * i] = (int16_t)((int32_t)y[i * sb[5] + t] - b_zp);                   \
                        pr[2 * i + 1] = (int16_t)((int32_t)y[i * sb[5] + t + 1] - b_zp);           \
                    }                                                                              \
                    else for (int64_t i = 0; i < n; i++) pr[2 * i] = (int16_t)((int32_t)y[i * sb[5] + t] - b_zp); \
                }                                                                                  \
            else PACK(n, k, sb[5], sb[4], pb[((t / 2) * np + i) * 2 + t % 2] = (int16_t)((int32_t)y[t * sb[4] + i * sb[5]] - b_zp)) \
            for (int64_t i = 0; i < m; i += MM_ROWS)                                               \
                for (int64_t j = 0; j < n; j += MM_COLS) MATMUL_BLOCK(CODE)                        \
        }                                                                                          \
        free(pa);                                                                                  \
        })                                                                                         \
        return failed ? -1 : 0;                                                                    \
    }

#if MATMUL_AVX2
#define MATMUL_CONSTANTS                                                                           \
    const __m256 vmult = _mm256_set1_ps(mult), vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi); \
    const __m256i vzp = _mm256_set1_epi32(zp);
#else
#define MATMUL_CONSTANTS
#endif

#if MATMUL_VNNI
#define MATMUL_VNNI_CALL(NAME, ...) return NAME##_vnni(__VA_ARGS__);
MATMUL_VNNI_FN(lucid_matmul_uint8_vnni, uint8_t)
MATMUL_VNNI_FN(lucid_matmul_int8_vnni, int8_t)
#else
#define MATMUL_VNNI_CALL(NAME, ...)
#endif

MATMUL(lucid_matmul_uint8, uint8_t)
MATMUL(lucid_matmul_int8, int8_t)
