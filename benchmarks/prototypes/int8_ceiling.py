"""How close the int8 kernels run to this CPU's ceiling for their instruction mix (issue 13).

    python benchmarks/prototypes/int8_ceiling.py [--rounds 15]

Without VNNI an exact int8 product step is ``vpmaddubsw`` (uint8 x int8, pairs summed in int16),
``vpmaddwd`` by 1 (to int32) and ``vpaddd``: the native GEMM's and oneDNN's AVX2 loop. The attention
matmul multiplies centred int16 operands with ``vpmaddwd`` alone (two 8-bit codes less their zero
points need 9 bits). A C loop of each, 8 independent accumulators, nothing but those instructions,
gives the most multiply-adds a second this core does that way; each kernel at the benchmark models'
shapes is then a share of its ceiling. A kernel near 100% can only gain by doing less work (fewer
calls, fewer passes), not by faster arithmetic. Needs a C compiler and AVX2 (it says so otherwise).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved  # noqa: E402

from lucid_fx.kernels import linear_native, matmul_native  # noqa: E402
from lucid_fx.kernels.cpu_features import cpu_features  # noqa: E402

LOOP = r"""
#include <immintrin.h>
#include <stdint.h>
#define STEP(A, X, W) A = _mm256_add_epi32(A, PRODUCT(X, W));
#define PRODUCT_U8S8(X, W) _mm256_madd_epi16(_mm256_maddubs_epi16(X, W), ones)
#define PRODUCT_S16(X, W) _mm256_madd_epi16(X, W)
volatile int32_t sink; /* the sums are stored: nothing of the loop is dead code */
#define LOOP(NAME, MACS)                                                                      \
    int64_t NAME(int64_t iters) { /* returns the multiply-adds done */                        \
        const __m256i ones = _mm256_set1_epi16(1), w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5); \
        __m256i x0 = _mm256_set1_epi32(1), x1 = _mm256_set1_epi32(2), x2 = _mm256_set1_epi32(3), x3 = _mm256_set1_epi32(4); \
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
        (void)ones;                                                                           \
        for (int64_t i = 0; i < iters; i++) {                                                 \
            __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3));                    \
            STEP(a0, x0, w0) STEP(a1, x0, w1) STEP(a2, x1, w0) STEP(a3, x1, w1)               \
            STEP(a4, x2, w0) STEP(a5, x2, w1) STEP(a6, x3, w0) STEP(a7, x3, w1)               \
        }                                                                                     \
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)), \
                                     _mm256_add_epi32(_mm256_add_epi32(a4, a5), _mm256_add_epi32(a6, a7))); \
        sink = _mm256_extract_epi32(s, 0);                                                    \
        return iters * 8 * (MACS);                                                            \
    }
#define PRODUCT PRODUCT_U8S8
LOOP(ceiling_u8s8, 32)
#undef PRODUCT
#define PRODUCT PRODUCT_S16
LOOP(ceiling_s16, 16)
"""


def _loops():
    cc = os.environ.get("LUCID_FX_CC") or os.environ.get("CC") or "cc"
    folder = tempfile.mkdtemp(prefix="int8_ceiling_")
    source, library = Path(folder, "loop.c"), Path(folder, "loop.so")
    source.write_text(LOOP)
    done = subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", str(library), str(source)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"int8_ceiling: {cc} could not build the loops (AVX2 needed): {done.stderr.strip()[-300:]}")
    lib = ctypes.CDLL(str(library))
    for name in ("ceiling_u8s8", "ceiling_s16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = (ctypes.c_int64,), ctypes.c_int64
    return lib


def _gemm(m: int, n: int, k: int):
    qw = torch.randint(-linear_native.PAIR_SAFE, linear_native.PAIR_SAFE, (n, k), dtype=torch.int8)
    weight, x = linear_native.packed_weight(qw), torch.randint(0, 256, (m, k), dtype=torch.uint8)
    offset, scales, bias = -128 * weight.row_sums, torch.rand(n) * 0.01, torch.rand(n)
    packed, zeros = torch.ops.onednn.qlinear_prepack(qw, None), torch.zeros(n, dtype=torch.int64)
    native = lambda: linear_native.gemm_rows(x, weight, offset, 0.1, scales, bias, 10.0, 3, 0, 255, torch.uint8)  # noqa: E731
    onednn = lambda: torch.ops.onednn.qlinear_pointwise.default(x, 0.1, 128, packed, scales, zeros, bias, 0.1, 3, None,  # noqa: E731
                                                                "none", [], "")
    return {f"native GEMM {m}x{n}x{k}": (native, m * n * k, "u8s8"), f"oneDNN linear {m}x{n}x{k}": (onednn, m * n * k, "u8s8")}


def _attention(batch: int, heads: int, tokens: int, dim: int):
    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8)
    q, k = codes(batch, tokens, heads, dim).transpose(1, 2), codes(batch, tokens, heads, dim).permute(0, 2, 3, 1)
    p, v = codes(batch, heads, tokens, tokens), codes(batch, tokens, heads, dim).transpose(1, 2)
    found = {}
    for name, a, b in (("q @ k^T", q, k), ("p @ v", p, v)):
        plan = matmul_native.matmul_plan(a, b, 120, 128)
        fn = (lambda a=a, b=b, plan=plan: matmul_native.matmul_codes(a, 120, b, 128, 1e-4, 3, 0, 255, torch.uint8, plan))
        found[f"attention {name} {tuple(a.shape)}"] = (fn, a.shape[0] * a.shape[1] * a.shape[2] * a.shape[3] * b.shape[3], "s16")
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lib, iters = _loops(), 2_000_000
    timed = interleaved({"u8s8": lambda: lib.ceiling_u8s8(iters), "s16": lambda: lib.ceiling_s16(iters)}, args.rounds)
    ceiling = {"u8s8": iters * 8 * 32 / timed["u8s8"] / 1e3, "s16": iters * 8 * 16 / timed["s16"] / 1e3}  # GMAC/s
    print(f"CPU int8 kind: {cpu_features().name}; 1 thread, median of {args.rounds} interleaved rounds")
    print(f"ceiling: vpmaddubsw+vpmaddwd+vpaddd {ceiling['u8s8']:.1f} GMAC/s, vpmaddwd+vpaddd (int16) {ceiling['s16']:.1f} GMAC/s")
    kernels = {**_gemm(64, 1024, 1024), **_gemm(1024, 768, 256), **_gemm(1024, 1024, 256), **_gemm(1024, 256, 1024),
               **_attention(8, 4, 128, 64)}
    times = interleaved({name: fn for name, (fn, _, _) in kernels.items()}, args.rounds)
    print("| kernel | us | GMAC/s | share of its ceiling |\n|---|---|---|---|")
    for name, (_, macs, mix) in kernels.items():
        rate = macs / times[name] / 1e3
        print(f"| {name} | {times[name]:.0f} | {rate:.1f} | {100 * rate / ceiling[mix]:.0f}% |")


if __name__ == "__main__":
    main()
