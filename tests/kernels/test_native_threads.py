"""lucid_fx/kernels/native_threads.h: the native passes split among torch's threads give the values they give on one
thread, and the torch kernels' values, bit for bit, on every build (each output is one thread's, computed as alone);
below their thresholds, at one torch thread and without OpenMP they stay on one thread."""

import unittest.mock

import pytest
import torch

from lucid_fx.kernels import conv_native as cn
from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import matmul_native, native, native_elementwise, native_lut, native_squeeze_excite, program_ops, softmax_native
from lucid_fx.kernels import native_pool as npl
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels import softmax_matmul as sm

THREADS = 4  # more than this machine's cores is fine: the split is by count, not by core
ELEMENTS = 65536  # native_threads.h's LUCID_PARALLEL_ELEMENTS
MNK = 1 << 20  # native_gemm.h's GEMM_PARALLEL_MNK, native_matmul.c's MM_PARALLEL_MNK
BUILDS = ["this CPU", "no VNNI", "no AVX-512", "portable", "no OpenMP"]


@pytest.fixture
def at_threads():
    """Run a function at a torch thread count, the count restored afterwards."""
    saved = torch.get_num_threads()

    def run(threads, fn):
        torch.set_num_threads(threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(saved)
    return run


def _codes(shape, dtype=torch.uint8, seed=0):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _floats(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4


def _quantize():
    x = _floats((300_001,))
    return (x.numel(), x.numel(), 0, lambda: native.quantize_codes(x, 8.0, 3, 0, 255, torch.uint8),
            lambda: ref.quantize_per_tensor(x, 0.125, 3, 0, 255, torch.uint8))


def _quantize_channels_last():
    x = _floats((2, 24, 71, 73))
    return (x.numel(), 2 * -(-71 * 73 // 64), 0, lambda: native_elementwise.quantize_channels_last(x, 8.0, 3, 0, 255, torch.uint8),
            lambda: ref.quantize_per_tensor(x, 0.125, 3, 0, 255, torch.uint8))


def _gate(layout):
    qa = _codes((2, 96, 41, 39), seed=1).contiguous(memory_format=layout)
    qg = _codes((2, 96, 1, 1), seed=2)
    args = (qa, 70, qg, 3, 0.0084, 86, 0, 255, torch.uint8)
    parts = 2 * 41 * 39 if layout == torch.channels_last else 2 * 96
    return qa.numel(), parts, 0, lambda: native_squeeze_excite.gate_mul_codes(*args), lambda: program_ops.mul_codes(*args)


def _pool(layout):
    q = _codes((2, 96, 57, 61), seed=3).contiguous(memory_format=layout)
    args = (q, 7, 0.0037, 0.0011, 100)
    parts = 57 * 61 if layout == torch.channels_last else 96
    return 96 * 57 * 61, parts, 0, lambda: native_squeeze_excite.global_avg_pool_codes(*args), lambda: program_ops.global_avg_pool_codes(*args)


def _lookup():
    q, table = _codes((300_001,), seed=4), _codes((256,), seed=5)
    return q.numel(), q.numel(), 0, lambda: native_lut.lut(q, table), lambda: ref.lut(q, table)


def _gated_lookups():
    qa, qb, ta, tb = _codes((300_001,), seed=6), _codes((300_001,), seed=7), _codes((256,), seed=8), _codes((256,), seed=9)
    return (qa.numel(), qa.numel(), 0, lambda: native_lut.lut_mul_codes(qa, ta, 128, qb, tb, 0, 1 / 300, 128, 0, 255, torch.uint8),
            lambda: program_ops.mul_codes(ref.lut(qa, ta), 128, ref.lut(qb, tb), 0, 1 / 300, 128, 0, 255, torch.uint8))


def _requantize():
    y = _floats((300_001,)) * 50
    return (y.numel(), y.numel(), 0, lambda: native.requantize_scaled(y.clone(), 0.37, 3, 0, 255, torch.uint8),
            lambda: program_ops.requantize_codes(y.clone().mul_(0.37), 3, 0, 255, torch.uint8))


def _dequantize():
    q = _codes((300_001,), seed=10)
    return q.numel(), q.numel(), 0, lambda: native_elementwise.dequantize_codes(q, 0.05, 3), lambda: ref.dequantize_per_tensor(q, 0.05, 3)


def _matmul():
    qa, keys = _codes((8, 4, 128, 64), seed=11), _codes((8, 4, 128, 64), seed=12)
    qb = keys.transpose(-2, -1)  # attention's q @ k^T: a transposed view of the keys
    plan = matmul_native.matmul_plan(qa, qb, 128, 120)
    args = (qa, 128, qb, 120, 1 / 2048, 128, 0, 255, torch.uint8)
    return 32 * 128 * 128 * 64, 32, MNK, lambda: matmul_native.matmul_codes(*args, plan), lambda: program_ops.matmul_codes(*args)


def _softmax(dim):
    q, table = _codes((8, 4, 96, 128), seed=13), program_ops.softmax_table(0.05)
    rows = q.numel() // q.shape[dim]
    args = (q, table, dim, 256.0, 0, 0, 255, torch.uint8)
    return q.numel(), rows, 0, lambda: softmax_native.softmax_codes(*args), lambda: program_ops.softmax_codes(*args)


def _exponentials():
    q, table = _codes((8, 4, 96, 128), seed=14), sm.exp_table(0.05)
    args = (q, table, None, 0.37, 0, torch.uint8)
    return q.numel(), q.numel() // 128, 0, lambda: sm.exp_codes(*args), lambda: sm.torch_exp_codes(*args)


def _exponentials_with_a_bias():
    q, bias = _codes((8, 4, 64, 128), seed=15), torch.randn(8, 1, 1, 128, generator=torch.Generator().manual_seed(16))
    y = (q.to(torch.float32) - 9) * 0.05 + bias
    return (q.numel(), q.numel() // 128, 0, lambda: sm.exp_codes_bias(q, 9, 0.05, bias, 0.37, 0, torch.uint8),
            lambda: sm.torch_exp_codes_float(y, 0.37, 0, torch.uint8))


def _convolution(c, cout, k, groups):
    g = torch.Generator().manual_seed(c + k)
    x = torch.randint(0, 256, (1, c, 40, 40), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    low = -128 if groups > 1 or ln.full_grid() else -64  # the dense kernel's grid without VNNI: test_conv_native
    qw = torch.randint(low, -low, (cout, c // groups, k, k), dtype=torch.int8, generator=g)
    conv = cn.native_conv(qw, torch.rand(cout, generator=g) * 0.01 + 0.001, torch.randn(cout, generator=g), 0.0213, 5,
                          [k // 2] * 2, groups, 0.37, "none")
    args = (x, conv, [1, 1], [k // 2] * 2, [1, 1], 5, 7, 0, 255, torch.uint8)

    def torch_path():
        with unittest.mock.patch.object(cn, "bind", lambda *a: None):
            return cn.conv_codes(*args)
    depthwise = groups > 1
    work = 1600 * cout * k * k * (1 if depthwise else -(-c // 4) * 4)
    return work, 1600 if depthwise else -(-cout // 16), MNK, lambda: cn.conv_codes(*args), torch_path


def _gemm():
    qw, x = _codes((300, 512), torch.int8, 17), _codes((256, 512), seed=18)
    if not ln.full_grid():
        qw = qw.clamp(-64, 63)  # the grid of the GEMM's steps without VNNI (linear_native.PAIR_SAFE)
    weight, offset = ln.packed_weight(qw), torch.zeros(300, dtype=torch.int32)
    scale, bias = torch.rand(300) * 0.01, torch.randn(300)
    args = (x, weight, offset, 0.1, scale, bias, 10.0, 3, 0, 255, torch.uint8)

    def torch_path():
        with unittest.mock.patch.object(ln, "_function", lambda *a: None):
            return ln.gemm_rows(*args)
    return 256 * 300 * 512, -(-300 // 32), MNK, lambda: ln.gemm_rows(*args), torch_path


def _pool_plan(kind, zp=0):
    q = _codes((2, 64, 56, 57), seed=19).contiguous(memory_format=torch.channels_last)
    if kind == "max":
        expected = ref.max_pool2d(q, [3, 3], [2, 2], [1, 1], [1, 1], False)
        return q, expected, npl.pool_plan(q, expected, "max", [3, 3], [2, 2], [1, 1])
    expected = ref.avg_pool2d(q, 0.05, zp, [3, 3], [2, 2], [1, 1], False, True, 0.04, 7)
    return q, expected, npl.pool_plan(q, expected, "avg_with_pad", [3, 3], [2, 2], [1, 1], (0.05, zp, 0.04, 7))


def _max_pool():
    q, expected, plan = _pool_plan("max")
    return 2 * 28 * 29 * 64 * 9, 2 * 28, 0, lambda: npl.pool_codes(q, plan), lambda: expected


CASES = {"quantize": _quantize, "max pool": _max_pool, "quantize to channels-last": _quantize_channels_last,
         "gate multiply, channels-last": lambda: _gate(torch.channels_last),
         "gate multiply, planes": lambda: _gate(torch.contiguous_format),
         "global average pool, channels-last": lambda: _pool(torch.channels_last),
         "global average pool, planes": lambda: _pool(torch.contiguous_format),
         "lookup": _lookup, "gated lookups": _gated_lookups, "requantize": _requantize, "dequantize": _dequantize,
         "batched matmul": _matmul, "softmax along the last dim": lambda: _softmax(-1),
         "softmax along another dim": lambda: _softmax(1), "exponentials": _exponentials,
         "exponentials of codes and a bias": _exponentials_with_a_bias,
         "dense convolution": lambda: _convolution(32, 64, 3, 1), "depthwise convolution": lambda: _convolution(96, 96, 5, 96),
         "gemm": _gemm}


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case", CASES)
def test_a_pass_split_among_threads_gives_one_thread_s_values_and_the_torch_kernels(native_build, at_threads, build, case):
    native_build(build)
    work, parts, least, run, torch_kernels = CASES[case]()
    # the split happens at these sizes (the case's work over its pass's threshold), except without OpenMP
    assert at_threads(THREADS, lambda: native.split_threads(work, parts, least)) == (1 if build == "no OpenMP" else THREADS)
    assert at_threads(1, lambda: native.split_threads(work, parts, least)) == 1
    expected = torch_kernels()
    one, split = at_threads(1, run), at_threads(THREADS, run)
    for got in (one, split):
        for got_part, want in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
            assert got_part.dtype == want.dtype and torch.equal(got_part, want), f"{int((got_part != want).sum())} values differ"


def test_small_passes_stay_on_one_thread(native_on, at_threads):
    assert at_threads(THREADS, lambda: native.split_threads(ELEMENTS - 1, ELEMENTS)) == 1  # waking the pool costs more
    assert at_threads(THREADS, lambda: native.split_threads(ELEMENTS, ELEMENTS)) == 2  # then one thread per half threshold
    assert at_threads(THREADS, lambda: native.split_threads(10 * ELEMENTS, 3)) == 3  # at most one thread a piece
    assert at_threads(THREADS, lambda: native.split_threads(MNK - 1, 32, MNK)) == 1  # a product's threshold
    assert at_threads(2, lambda: native.split_threads(10 * MNK, 32, MNK)) == 2  # at most torch's threads


@pytest.mark.parametrize("build", ["this CPU", "portable"])
def test_an_average_pool_split_among_threads_gives_one_thread_s_codes(native_build, at_threads, build):
    # the reference's float average differs from the exact integer sums' only at ties (test_native_pool): here the
    # split against one thread, bit for bit, and both within a code of the reference
    native_build(build)
    q, expected, plan = _pool_plan("avg", zp=3)
    assert at_threads(THREADS, lambda: native.split_threads(2 * 28 * 29 * 64 * 9, 2 * 28)) == THREADS
    one, split = at_threads(1, lambda: npl.pool_codes(q, plan)), at_threads(THREADS, lambda: npl.pool_codes(q, plan))
    assert torch.equal(one, split) and int((one.int() - expected.int()).abs().max()) <= 1
