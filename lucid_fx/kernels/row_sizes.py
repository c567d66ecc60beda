"""How big a linear each row engine takes (:func:`small_gemm`), as measured against oneDNN's call; the engines
themselves are :mod:`lucid_fx.kernels.linear_row` (which re-exports these names) and
:mod:`lucid_fx.kernels.linear_native`. An AMX CPU caps them further (``Target.row_limit``,
``linear_row.takes_row``)."""

from __future__ import annotations

from typing import Optional

import torch

from lucid_fx.kernels import linear_native

__all__ = ["small_gemm", "amx_gemm", "AMX_VNNI_ROWS", "SMALL_GEMM_MNK", "SMALL_GEMM_NK", "VNNI_GEMM_ROWS", "VNNI_FLOAT_TAIL_ROWS", "VNNI_THREADED_ROWS",
           "VNNI_POINTWISE_ROWS", "NATIVE_GEMM_MNK"]

# Linears of several rows up to these sizes run faster here than in oneDNN's (1 thread, AVX512-VNNI EPYC,
# time here / oneDNN's): 0.46-0.69 at 16 x K x N for K, N <= 256, 0.90 at 2 x 512 x 512, 0.82-1.03 at
# M*N*K = 2^22, 0.92-1.35 past it; at 2 x 1024 x 1024 (N*K = 2^20) oneDNN's is 2.4x faster.
SMALL_GEMM_MNK = 1 << 22
SMALL_GEMM_NK = 1 << 18
# Where the build has the native VNNI GEMM (linear_native.full_grid), it computes the same int32 sums as _int_mm, then
# oneDNN's VNNI float steps, in one call. Measured, 1 thread, AVX512-VNNI EPYC, us native / _int_mm / oneDNN: 4.8 /
# 11.7 / 26.7 at 1 x 64 x 64, 12.0 / 23.8 / 42.7 at 16 x 256 x 256, 35.8 / 44.2 / 89.4 at 1 x 1024 x 1024; the 8-row
# AVX-512 kernel's GEMM / oneDNN's call: 45 / 72 at 8 x 1024 x 1024, 171 / 207 at 32 rows, 332 / 367 at 64, 1434 / 1426
# at 64 x 1024 -> 4096, 1376 / 1343 at 256. It takes any linear of up to this many rows at any thread count (2 threads,
# x 1024 x 1024: 34 / 64 at 8 rows, 123 / 169 at 32; models at 64 rows, 2 threads, since the AVX-512 loop lost its copies:
# the batch-64 MLP 545 / 663 us, the gated MLP 583 / 700; one row where the build's GEMM has no threads) and of up to
# SMALL_GEMM_MNK multiply-adds; one whose gelu runs as a float pass after it (float_post_op) up to VNNI_FLOAT_TAIL_ROWS.
VNNI_GEMM_ROWS = 64
VNNI_FLOAT_TAIL_ROWS = 16
VNNI_THREADED_ROWS = 64
# A 1x1 convolution (a GEMM over the pixels) on the native VNNI GEMM against oneDNN's 1x1
# convolution, its route otherwise, us, 1 thread, AVX512-VNNI EPYC, the same codes: 68 / 214 at 49
# pixels x 1152 -> 192 channels, 80 / 287 at 49 x 192 -> 1152, 138 / 231 at 196 x 112 -> 672, 68 / 119
# at 196 x 80 -> 480, 107 / 127 at 784 x 40 -> 240, 79 / 113 at 784 x 240 -> 40; at 3136 pixels
# 187 / 179 and 110 / 143, at 12544 409 / 386. Up to this many pixels at one thread, at any size.
VNNI_POINTWISE_ROWS = 1024
# The native engine against oneDNN's 1x1 convolution on a prepacked weight (its route for a linear
# there), measured on an AVX2 EPYC at one thread: 0.41 of its time at 1 x 1024 x 1024, 0.60-0.76 at
# 2^21-2^23 multiply-adds, 0.82-0.96 at 2^24-2^25, 0.89-1.06 at 2^26 (64 x 1024 x 1024), 1.0-1.4
# past it. It takes linears up to this many multiply-adds at one thread or on the GEMM's threads, a quarter of it
# at more without them (oneDNN's threads; measured 2 threads against 1: 0.2 of the fixed cost or less).
NATIVE_GEMM_MNK = 1 << 26
# On an AMX CPU with lucid_fx's AMX GEMM on (linear_native.amx), linears of up to AMX_VNNI_ROWS rows run on its VNNI
# kernels, those of more whose inputs are a multiple of 64 on its tiles (native_amx.c), at any number of rows.
# Measured, AMX Xeon, 2 threads, time / oneDNN's linear on the same codes: 0.43-0.90 from 16 to 128 rows at (N, K) of
# (1024, 1024), (256, 256), (768, 768), (1024, 256) and (256, 1024); since the tiles' float steps load each output's
# constants once (native_amx.c's amx_rows) and stream the weights past the rows: 0.43 at 64 x 1024 x 1024, 0.74 at 256
# x 1024 x 1024, 0.85 at 1024^3, 0.56 at 1024 x 256 x 256, 0.77 at 1024 x 1024 x 256, 0.84 at 1024 x 256 x 1024, 0.95
# at 1024 x 1024 x 512, 0.93 at 1024 x 1024 x 2048, 0.86 at 1024 x 1024 x 4096, 0.85 at 512 x 768 -> 3072 and 0.80 at
# 3072 -> 768, 0.91 at 4096 x 256 x 256. At one thread 0.51-0.91 on nine shapes of these sizes (1024^3: 817 against
# 901 us).
AMX_VNNI_ROWS = 8


def amx_gemm(m: int, n: int, k: int) -> bool:
    """Whether lucid_fx's GEMM takes an (m, k) by (k, n) linear on an AMX CPU faster than oneDNN's: its VNNI
    kernels up to AMX_VNNI_ROWS rows, its tiles at more where ``k`` is a multiple of 64."""
    return linear_native.amx() and (m <= AMX_VNNI_ROWS or k % 64 == 0)


def small_gemm(m: int, n: int, k: int, engine: Optional[str] = "int_mm", pointwise: bool = False,
               rows: Optional[int] = None) -> bool:
    """Whether an (m, k) by (k, n) linear runs faster on ``engine`` than in oneDNN: on ``_int_mm`` one
    row always, several while the weight and the product are small (SMALL_GEMM_*); on its native
    VNNI GEMM up to VNNI_GEMM_ROWS rows (VNNI_THREADED_ROWS at more threads) or SMALL_GEMM_MNK multiply-adds, and a 1x1
    convolution's (``pointwise``) up to VNNI_POINTWISE_ROWS pixels at one thread (``rows``: another row limit); on the
    native engine up to NATIVE_GEMM_MNK multiply-adds (a quarter at more threads where its GEMM has none)."""
    if engine == "native":
        return m * n * k <= (NATIVE_GEMM_MNK if torch.get_num_threads() == 1 or linear_native.threaded() else NATIVE_GEMM_MNK >> 2)
    if engine == "int_mm" and linear_native.full_grid():
        one_thread, most = torch.get_num_threads() == 1, rows or VNNI_GEMM_ROWS
        most = most if one_thread else min(most, VNNI_THREADED_ROWS) if linear_native.threaded() else 1
        return m <= most or m * n * k <= SMALL_GEMM_MNK or (pointwise and one_thread and m <= VNNI_POINTWISE_ROWS)
    return engine == "int_mm" and (m == 1 or (n * k <= SMALL_GEMM_NK and m * n * k <= SMALL_GEMM_MNK))
