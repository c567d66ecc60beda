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

#define AMX_ROWS 32 /* rows a step takes: two x tiles */
#define AMX_K 64    /* inputs a tile takes */
/* Fewer rows take the VNNI kernels (faster at 8 rows: 30 against 44 us at 8 x 1024 x 1024, 2 threads; from 12 rows
 * slower: 66 against 48). lucid_fx.kernels.row_sizes.AMX_VNNI_ROWS is this less one. */
#define AMX_MIN_ROWS 9

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

/* Tiles 0-3: the sums (rows 0-15 and 16-31 by blocks b and b + 1), 4-5 the x tiles, 6-7 the weight tiles. */
static void amx_configure(void) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}

/* 32 rows of x (k codes each, `stride` apart) by blocks w0 and w1: the 32 x 32 sums into c. */
static void amx_step(const uint8_t *x, int64_t stride, int64_t k, const int8_t *w0, const int8_t *w1, int32_t *c) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k0 = 0; k0 < k; k0 += AMX_K) {
        _tile_loadd(4, x + k0, stride);
        _tile_loadd(5, x + 16 * stride + k0, stride);
        _tile_loadd(6, w0 + k0 * GEMM_NB, 64);
        _tile_loadd(7, w1 + k0 * GEMM_NB, 64);
        _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128);
    _tile_stored(2, c + 16 * 32, 128); _tile_stored(3, c + 16 * 32 + 16, 128);
}

/* Rows [i0, end) with blocks b and b + 1 (b + 1 < nb, else b alone): steps of 32 rows, finished row by row. The
 * float steps cost as much as the tiles at many rows (1024 x 1024 x 256, 2 threads: 311 us, 106 without them);
 * flattened (gemm_finish16 inlined, as native_gemm.c's gemm_pair) 240-287. */
__attribute__((flatten)) static void amx_pair(const uint8_t *x, const uint8_t *padded, int64_t padded_from, const int8_t *packed, char *out,
                     int64_t n, int64_t k, const gemm_finish_t *shared, int64_t i0, int64_t end, int64_t b, int64_t nb) {
    const gemm_finish_t own_f = *shared, *f = &own_f; /* the writes to out cannot change it: read once */
    const size_t size = gemm_size(f->kind), row = n * size;
    const int64_t block = k / GEMM_KB * GEMM_NB * GEMM_KB;
    const int8_t *w0 = packed + b * block, *w1 = b + 1 < nb ? w0 + block : w0;
    int32_t c[AMX_ROWS * 32] __attribute__((aligned(64)));
    for (int64_t i = i0; i < end; i += AMX_ROWS) {
        const int own = i + AMX_ROWS <= padded_from;
        amx_step(own ? x + i * k : padded + (i - padded_from) * k, k, k, w0, w1, c);
        for (int64_t r = 0; r < AMX_ROWS && i + r < end; r++) {
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
    if (!amx_on || k % AMX_K || m < AMX_MIN_ROWS) return 0;
    const int64_t nb = (n + GEMM_NB - 1) / GEMM_NB, pairs = (nb + 1) / 2, full = m / AMX_ROWS * AMX_ROWS;
    uint8_t *padded = NULL;
    if (full < m) { /* the last rows, zero-padded to a step */
        padded = calloc(AMX_ROWS, (size_t)k);
        if (!padded) return 0;
        memcpy(padded, x + full * k, (size_t)((m - full) * k));
    }
    /* a tile of rows meets every block while it is in cache (native_gemm.h's gemm_tile, in steps of 32 rows) */
    const int64_t fit = (65536 / k) / AMX_ROWS * AMX_ROWS, tile = m * k <= 262144 || fit < AMX_ROWS ? m : fit;
    const int threads = lucid_threads(m * n * k, GEMM_PARALLEL_MNK, pairs);
    LUCID_SPLIT(pairs, 1, threads, {
        amx_configure();
        for (int64_t i0 = 0; i0 < m; i0 += tile) {
            const int64_t end = i0 + tile < m ? i0 + tile : m;
            for (int64_t p = from; p < to; p++)
                amx_pair(x, padded, full, packed, (char *)out, n, k, f, i0, end, 2 * p, nb);
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
