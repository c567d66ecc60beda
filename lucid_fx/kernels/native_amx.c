/* lucid_fx's GEMM on AMX tiles (the entry points of native_gemm_entry.c hand it the products it takes): the same
 * int32 sums as the AVX-512 VNNI kernels, exactly (sums of integers in any order are the same integers), then the
 * same float steps (native_gemm.h's gemm_finish16), so a result never depends on which of the two ran.
 *
 * The packed weight (native_gemm.c: [ceil(N/16)][ceil(K/4)][16][4]) is already AMX's B-tile layout: 16 groups of
 * 4 inputs by 16 outputs, one 64-byte row per group, so a tile of block b at inputs k0..k0+63 is 16 rows of 64
 * bytes at packed + (b * K/4 + k0/4) * 64. A tile of x is 16 rows of 64 codes, the rows k bytes apart. A step
 * multiplies 32 rows by 32 outputs: two x tiles, two weight tiles, four tdpbusd (u8 x s8 -> int32) into four
 * 16 x 16 sums. Products with k a multiple of 64 only; rows past the last multiple of 32 are copied once into
 * zero-padded rows (their sums are computed and not written). Measured (AMX Xeon, 2 threads, 64 x 1024 x 1024,
 * codes out with relu): see lucid_fx/kernels/row_sizes.py. */
#include "native_gemm.h"
#include "native_threads.h"
#include <stdlib.h>

/* Every AMX CPU has AVX-512's VNNI: a build without it (tests/kernels/conftest.py's "no VNNI", an AVX2 CPU's) has none. */
#if GEMM_VNNI && defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BUILT 1
#else
#define AMX_BUILT 0
#endif

/* Fewer rows take the VNNI kernels (faster at 8 rows: 30 against 44 us at 8 x 1024 x 1024, 2 threads; from 12 rows
 * slower: 66 against 48). lucid_fx.kernels.row_sizes.AMX_VNNI_ROWS is this less one. */
#define AMX_MIN_ROWS 9
/* The bytes of weights a thread's tiles of rows meet while they stay in its L2 (half of 2 MiB). */
#define AMX_L2_WEIGHTS (1 << 20)

static int amx_on = 0;
static int64_t amx_calls = 0; /* products run on the tiles (lucid_amx_calls: tests see which kernel ran) */

/* Turn the AMX GEMM on (1: asking Linux for the tile state once per process) or off (0), or leave it (-1);
 * whether it is on. */
int32_t lucid_amx_use(int32_t on) {
#if AMX_BUILT
    static int granted = -1;
    if (on < 0) return amx_on;
    if (on && granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    amx_on = on && granted > 0;
#else
    (void)on;
#endif
    return amx_on;
}

/* How many products ran on AMX tiles in this process. */
int64_t lucid_amx_calls(void) { return amx_calls; }

#if AMX_BUILT
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tiles 0-3: the sums (rows 0-15 and 16-31 by blocks b and b + 1), 4-5 the x tiles, 6-7 the weight tiles: 16 rows of
 * 64 bytes each. A constant in memory: built on the stack, GCC 12 dropped the stores it saw no read of (ldtilecfg's
 * builtin does not say it reads them) and ldtilecfg faulted on the garbage left (in a function of its own). */
static const amx_config_t AMX_CONFIG __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static void amx_configure(void) { _tile_loadconfig(&AMX_CONFIG); }

/* 32 rows of x (k codes each, `stride` apart) by blocks w0 and w1: the 32 x 32 sums into c. `stream`: the weight
 * tiles loaded with the hint that they are not used again soon (tileloaddt1), where they do not stay in cache
 * between steps anyway: the rows' tiles, used by every block, stay instead. */
static void amx_step(const uint8_t *x, int64_t stride, int64_t k, const int8_t *w0, const int8_t *w1, int32_t *c,
                     int stream) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k0 = 0; k0 < k; k0 += AMX_TILE_K) {
        _tile_loadd(4, x + k0, stride);
        _tile_loadd(5, x + 16 * stride + k0, stride);
        if (stream) {
            _tile_stream_loadd(6, w0 + k0 * GEMM_NB, 64);
            _tile_stream_loadd(7, w1 + k0 * GEMM_NB, 64);
        } else {
            _tile_loadd(6, w0 + k0 * GEMM_NB, 64);
            _tile_loadd(7, w1 + k0 * GEMM_NB, 64);
        }
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128); _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* Whether amx_rows finishes a pair: no post-op before the clamp, no residual codes, both blocks whole. */
static int amx_rows_take(const gemm_finish_t *f, int64_t b, int64_t n) {
    return f->post == GEMM_POST_NONE && !f->accum && (b + 2) * GEMM_NB <= n;
}

/* gemm_finish16's steps for `rows` rows of a step's sums c by two whole blocks (outputs j..j+31), into out, rows
 * `row` bytes apart: the outputs' offsets, scales and bias loaded once for all the rows (gemm_finish16 loads them for
 * each row and tests every option each time: at 1024 x 1024 x 256 its float steps took longer than the tiles). The
 * same operations in the same order. Codes: the clamp as max then min, equal to gemm_finish16's compare-and-select
 * for codes (a NaN goes to low either way, and -0 and 0 give the same code); float32: its compare-and-select, then
 * the addend where there is one. Codes without a bias add 0 (-0 and 0 give the same code); float32 adds a bias only. */
static void amx_rows(const int32_t *c, int64_t rows, char *out, int64_t row, int64_t j, const gemm_finish_t *f) {
    const __m512i off0 = _mm512_loadu_si512(f->offset + j), off1 = _mm512_loadu_si512(f->offset + j + 16);
    const __m512 ws0 = _mm512_loadu_ps(f->w_scale + j), ws1 = _mm512_loadu_ps(f->w_scale + j + 16);
    const __m512 b0 = f->bias ? _mm512_loadu_ps(f->bias + j) : _mm512_setzero_ps();
    const __m512 b1 = f->bias ? _mm512_loadu_ps(f->bias + j + 16) : _mm512_setzero_ps();
    const __m512 xs = _mm512_set1_ps(f->x_scale), inv = _mm512_set1_ps(f->inv_out), zp = _mm512_set1_ps(f->zp);
    const __m512 lo = _mm512_set1_ps(f->low), hi = _mm512_set1_ps(f->high);
#define AMX_SCALED(sums, off, ws) _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(sums, off)), xs), ws)
#define AMX_Y(sums, off, ws, b) _mm512_add_ps(AMX_SCALED(sums, off, ws), b)
#define AMX_CODES(y) \
    _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(_mm512_mul_ps(y, inv), zp), lo), hi)))
#define AMX_CLAMP(v) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ), lo, \
                         _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, hi, _CMP_LE_OQ), hi, v))
    if (f->kind == GEMM_FLOAT32) {
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *s = c + r * 32;
            float *o = (float *)(out + r * row) + j;
            __m512 v0 = AMX_SCALED(_mm512_load_si512(s), off0, ws0), v1 = AMX_SCALED(_mm512_load_si512(s + 16), off1, ws1);
            if (f->bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
            v0 = AMX_CLAMP(v0), v1 = AMX_CLAMP(v1);
            if (f->addend) {
                const float *a = GEMM_ADDEND(f, o);
                v0 = _mm512_add_ps(v0, _mm512_loadu_ps(a));
                v1 = _mm512_add_ps(v1, _mm512_loadu_ps(a + 16));
            }
            _mm512_storeu_ps(o, v0);
            _mm512_storeu_ps(o + 16, v1);
        }
    } else {
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *s = c + r * 32;
            const __m128i q0 = AMX_CODES(AMX_Y(_mm512_load_si512(s), off0, ws0, b0));
            const __m128i q1 = AMX_CODES(AMX_Y(_mm512_load_si512(s + 16), off1, ws1, b1));
            _mm256_storeu_si256((__m256i *)(out + r * row + j), _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1));
        }
    }
#undef AMX_SCALED
#undef AMX_Y
#undef AMX_CODES
#undef AMX_CLAMP
}

/* Rows [i0, end) with blocks b and b + 1 (b + 1 < nb, else b alone): steps of 32 rows, finished row by row, by
 * amx_rows where it takes the pair (at 1024 x 1024 x 256, 2 threads: 164-173 us against 224 by gemm_finish16,
 * whose float steps alone took 135 of it), else by gemm_finish16 (flattened: inlined, as native_gemm.c's
 * gemm_pair; 240-287 against 311 us at that size). */
__attribute__((flatten)) static void amx_pair(const uint8_t *x, const uint8_t *padded, int64_t padded_from, const int8_t *packed, char *out,
                     int64_t n, int64_t k, const gemm_finish_t *shared, int64_t i0, int64_t end, int64_t b, int64_t nb,
                     int stream) {
    const gemm_finish_t own_f = *shared, *f = &own_f; /* the writes to out cannot change it: read once */
    const size_t size = gemm_size(f->kind), row = n * size;
    const int64_t block = k / GEMM_KB * GEMM_NB * GEMM_KB;
    const int8_t *w0 = packed + b * block, *w1 = b + 1 < nb ? w0 + block : w0;
    int32_t c[AMX_TILE_ROWS * 32] __attribute__((aligned(64)));
    const int fast = amx_rows_take(f, b, n);
    for (int64_t i = i0; i < end; i += AMX_TILE_ROWS) {
        const int own = i + AMX_TILE_ROWS <= padded_from;
        amx_step(own ? x + i * k : padded + (i - padded_from) * k, k, k, w0, w1, c, stream);
        const int64_t rows = end - i < AMX_TILE_ROWS ? end - i : AMX_TILE_ROWS;
        if (fast) {
            amx_rows(c, rows, out + i * row, row, b * GEMM_NB, f);
            continue;
        }
        for (int64_t r = 0; r < rows; r++) {
            const int32_t *s = c + r * 32;
            char *o = out + (i + r) * row;
            gemm_finish16(_mm256_load_si256((const __m256i *)s), _mm256_load_si256((const __m256i *)(s + 8)),
                          b * GEMM_NB, n, f, o + b * GEMM_NB * size);
            if (b + 1 < nb)
                gemm_finish16(_mm256_load_si256((const __m256i *)(s + 16)), _mm256_load_si256((const __m256i *)(s + 24)),
                              (b + 1) * GEMM_NB, n, f, o + (b + 1) * GEMM_NB * size);
        }
    }
}
#endif

/* The m x n x k product on AMX tiles where this build has them, they are on and k is a multiple of 64: 1 (out
 * written), else 0 (nothing written: the caller's kernels run). */
int lucid_amx_gemm(const uint8_t *x, const int8_t *packed, void *out, int64_t m, int64_t n, int64_t k,
                   const gemm_finish_t *f) {
#if AMX_BUILT
    if (!amx_on || k % AMX_TILE_K || m < AMX_MIN_ROWS) return 0;
    const int64_t nb = (n + GEMM_NB - 1) / GEMM_NB, pairs = (nb + 1) / 2, full = m / AMX_TILE_ROWS * AMX_TILE_ROWS;
    uint8_t *padded = NULL;
    if (full < m) { /* the last rows, zero-padded to a step */
        padded = calloc(AMX_TILE_ROWS, (size_t)k);
        if (!padded) return 0;
        memcpy(padded, x + full * k, (size_t)((m - full) * k));
    }
    /* A tile of rows meets every pair of blocks while it is in cache (native_gemm.h's gemm_tile, in steps of 32
     * rows). Where a pair's weights and a step's rows (32 x k codes each) do not stay in L1 together, but a tile
     * of rows does (k from 512 to 1024), the weights stream past it (amx_step): at 1024^3 418 against 455 us, at
     * 1024 x 1024 x 512 233 against 272 (2 threads, AMX Xeon); at k = 256 it cost (190 against 173). Past 1024 a
     * tile is one step. The pairs go in groups whose weights stay in L2 while every tile meets them: at
     * 1024 x 4096 x 1024 1780 against 2440 us; at 1024 x 1024 x 4096 1800 against 2350. */
    const int stream = k >= 512 && k <= 1024;
    const int64_t fit = ((stream ? 32768 : 65536) / k) / AMX_TILE_ROWS * AMX_TILE_ROWS;
    const int64_t tile = !stream && m * k <= 262144 ? m : fit < AMX_TILE_ROWS ? AMX_TILE_ROWS : fit;
    const int64_t group = AMX_L2_WEIGHTS / (2 * GEMM_NB * k) > 0 ? AMX_L2_WEIGHTS / (2 * GEMM_NB * k) : 1;
    const int threads = lucid_threads(m * n * k, GEMM_PARALLEL_MNK, pairs);
    LUCID_SPLIT(pairs, 1, threads, {
        amx_configure();
        for (int64_t g = from; g < to; g += group) {
            const int64_t last = g + group < to ? g + group : to;
            for (int64_t i0 = 0; i0 < m; i0 += tile) {
                const int64_t end = i0 + tile < m ? i0 + tile : m;
                for (int64_t p = g; p < last; p++)
                    amx_pair(x, padded, full, packed, (char *)out, n, k, f, i0, end, 2 * p, nb, stream);
            }
        }
        _tile_release();
    })
    free(padded);
    __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED); /* the caller's thread, after the split */
    return 1;
#else
    (void)x, (void)packed, (void)out, (void)m, (void)n, (void)k, (void)f;
    return 0;
#endif
}

/* The tiles for another kernel's products (native_matmul.c): whether they are on; a thread's configuration before
 * its steps and its release after; the 32 x 32 int32 sums of 32 rows of x (k codes each, `stride` apart, k a
 * multiple of 64) by two packed blocks of 16 columns (native_gemm.c's layout: [k / 4][16][4] each) into c (rows of
 * 32); a product counted (lucid_amx_calls). Without tiles in this build: 0 and nothing. */
int lucid_amx_ready(void) { return amx_on; }

void lucid_amx_begin(void) {
#if AMX_BUILT
    amx_configure();
#endif
}

void lucid_amx_end(void) {
#if AMX_BUILT
    _tile_release();
#endif
}

void lucid_amx_sums(const uint8_t *x, int64_t stride, int64_t k, const int8_t *w0, const int8_t *w1, int32_t *c) {
#if AMX_BUILT
    amx_step(x, stride, k, w0, w1, c, 0);
#else
    (void)x, (void)stride, (void)k, (void)w0, (void)w1, (void)c;
#endif
}

void lucid_amx_counted(void) { __atomic_fetch_add(&amx_calls, 1, __ATOMIC_RELAXED); }
