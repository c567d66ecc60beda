"""lucid_fx/kernels/native.py: the C quantize pass equals the reference bit for bit, refuses NaN and
±inf in the same pass, and every caller keeps the torch kernels where no compiler is."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lucid_fx
from lucid_fx.kernels import cpu_float, matmul_native, native, native_elementwise, native_lut, native_squeeze_excite, program_ops
from lucid_fx.kernels import softmax_matmul as attention_rows
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.checks import KernelInputError
from lucid_fx.program import programs_of
from _program import called


def _values(scale: float, n: int = 200_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ties = (torch.randint(-400, 400, (n // 2,), generator=g) + 0.5) * scale  # x * inv near k + 0.5
    wide = torch.randn(n // 2, generator=g) * 300 * scale  # most of them off the grid
    return torch.cat([ties, wide, torch.tensor([3e38, -3e38, 1e-45, -0.0, 0.0])])


@pytest.mark.parametrize("dtype,qmin,qmax,zp", [(torch.uint8, 0, 255, 128), (torch.uint8, 0, 255, 3),
                                                (torch.uint8, 0, 127, 64), (torch.int8, -128, 127, 0),
                                                (torch.int8, -128, 127, -5), (torch.int8, -127, 127, 0)])
@pytest.mark.parametrize("scale", [0.037, 1.0, 0.0078125])
def test_codes_equal_the_reference_bit_for_bit(native_on, dtype, qmin, qmax, zp, scale):
    x = _values(scale)
    out = native.quantize_codes(x, ref.f32_reciprocal(scale), zp, qmin, qmax, dtype)
    expected = ref.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, expected), f"{int((out != expected).sum())} codes differ"
    # 3e38 * inv overflows float32 to inf for the small scales: a finite input, clamped, not refused
    assert out[-5].item() == qmax and out[-4].item() == qmin


def test_the_unchecked_pass_gives_the_same_codes(native_on, monkeypatch):
    x = _values(0.05)
    checked = native.quantize_codes(x, 20.0, 7, 0, 255, torch.uint8)
    monkeypatch.setattr(native, "check_finite", False)  # what benchmarks/nonfinite_check.py times
    assert torch.equal(native.quantize_codes(x, 20.0, 7, 0, 255, torch.uint8), checked)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_is_refused_with_its_count(native_on, bad):
    x = torch.randn(3, 1000)
    x[1, 17] = x[2, 999] = bad
    with pytest.raises(KernelInputError, match=r"NaN or ±inf in 2 of its 3000 elements.*torch.nan_to_num"):
        native.quantize_codes(x, 10.0, 128, 0, 255, torch.uint8)


@pytest.mark.parametrize("make", [lambda x: x.t(), lambda x: x.double(), lambda x: x.half(), lambda x: x[:, ::2],
                                  lambda x: x.double() * 1e39, lambda x: x.t()[::2]],
                         ids=["transposed", "float64", "float16", "strided", "float64-beyond-float32", "transposed-strided"])
def test_other_layouts_and_float_dtypes_give_the_reference_codes(native_on, make):
    x = make(torch.randn(64, 48) * 4)
    kept = x.clone()
    out = native.quantize_codes(x, 12.5, 100, 0, 255, torch.uint8)
    expected = ref.quantize_per_tensor(x, 0.08, 100, 0, 255, torch.uint8)
    assert torch.equal(out, expected) and out.stride() == torch.empty_like(x).stride() and torch.equal(x, kept)


def test_codes_keep_a_channels_last_layout(native_on):
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    out = native.quantize_codes(x, 10.0, 128, 0, 255, torch.uint8)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, ref.quantize_per_tensor(x, 0.1, 128, 0, 255, torch.uint8))


def test_it_takes_float_on_the_cpu_into_8_bit_codes_only():
    x = torch.randn(4)
    assert native.takes(x, torch.uint8) and native.takes(x.double(), torch.int8)
    assert not native.takes(x, torch.int32) and not native.takes(x.to(torch.int64), torch.uint8)
    assert not native.takes(torch.randn(4, device="meta"), torch.uint8)


def test_empty_and_scalar_inputs(native_on):
    assert native.quantize_codes(torch.empty(0, 5), 2.0, 0, -128, 127, torch.int8).shape == (0, 5)
    assert native.quantize_codes(torch.tensor(2.6), 2.0, 0, -128, 127, torch.int8).item() == 5


@pytest.mark.parametrize("env,why", [({"LUCID_FX_NATIVE": "0"}, "off \\(LUCID_FX_NATIVE=0\\)"),
                                     ({"LUCID_FX_CC": "/nonexistent/cc"}, "no C compiler found"),
                                     ({"LUCID_FX_CC": "false"}, "false failed")])
def test_without_a_compiler_the_torch_kernels_run(native_env, env, why):
    native_env(**env)
    assert not native.available()
    assert why.replace("\\", "") in native.status() or pytest.fail(native.status())
    x = _values(0.1, 2000)
    assert torch.equal(native.quantize_codes(x, 10.0, 128, 0, 255, torch.uint8),
                       ref.quantize_per_tensor(x, 0.1, 128, 0, 255, torch.uint8))


def test_the_status_names_the_compiler_and_flags(native_on):
    assert native.status().startswith("compiled with ") and "-O3" in native.status()


def _mlp_quantize_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    data = [torch.randn(16, 32) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data)
    out = qmodel(data[1])  # builds the program for this input
    (program,) = programs_of(qmodel).values()
    steps = [n.target for n in program.graph.nodes if n.target in (native.quantize_codes, program_ops.quantize_codes)]
    return steps, out


def test_a_converted_model_quantizes_natively_and_the_same_without(native_on, native_env):
    on_steps, on_out = _mlp_quantize_steps()
    native_env(LUCID_FX_NATIVE="0")
    off_steps, off_out = _mlp_quantize_steps()
    assert on_steps == [native.quantize_codes] and off_steps == [program_ops.quantize_codes]
    assert torch.equal(on_out, off_out)


def _codes(shape, dtype, seed):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


LAYOUTS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,a_zp,g_zp,zp,bounds", [(torch.uint8, 70, 3, 86, (0, 255)), (torch.uint8, 128, 0, 85, (85, 255)),
                                                       (torch.int8, 0, -3, 1, (-128, 127)), (torch.int8, -5, 0, 0, (0, 127))])
@pytest.mark.parametrize("shape", [(1, 96, 28, 28), (2, 19, 7, 5), (3, 1152, 1, 1)])
def test_the_gate_multiply_equals_the_torch_kernels(native_on, layout, dtype, a_zp, g_zp, zp, bounds, shape):
    qa = _codes(shape, dtype, 1).contiguous(memory_format=LAYOUTS[layout])
    qg = _codes((shape[0], shape[1], 1, 1), dtype, 2)
    for mult in (0.0084, 0.5, 1 / 3):  # 0.5: many products land on ties
        args = (qa, a_zp, qg, g_zp, mult, zp, *bounds, dtype)
        out, expected = native_squeeze_excite.gate_mul_codes(*args), program_ops.mul_codes(*args)
        assert torch.equal(out, expected), f"{int((out != expected).sum())} codes differ"
        assert out.stride() == qa.stride()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,zp,out_zp", [(torch.uint8, 70, 100), (torch.uint8, 0, 3), (torch.int8, -7, 0), (torch.int8, 0, 5)])
@pytest.mark.parametrize("shape", [(1, 96, 112, 112), (2, 19, 7, 5), (4, 1280, 1, 1)])
def test_the_global_average_pool_equals_the_torch_kernels(native_on, layout, dtype, zp, out_zp, shape):
    q = _codes(shape, dtype, 3).contiguous(memory_format=LAYOUTS[layout])
    for scale, out_scale in ((0.0037, 0.0011), (0.02, 0.02), (0.1, 0.003)):  # equal scales: the mean's ties
        out = native_squeeze_excite.global_avg_pool_codes(q, scale, zp, out_scale, out_zp)
        expected = program_ops.global_avg_pool_codes(q, scale, zp, out_scale, out_zp)
        assert out.shape == (shape[0], shape[1], 1, 1) and torch.equal(out, expected)


@pytest.mark.parametrize("case", ["strided", "not-a-gate", "gate-dtype", "no-native"])
def test_the_gate_multiply_leaves_what_it_does_not_take_to_the_torch_kernels(native_env, case):
    native_env(**({"LUCID_FX_NATIVE": "0"} if case == "no-native" else {}))
    qa, qg = _codes((2, 8, 6, 6), torch.uint8, 4), _codes((2, 8, 1, 1), torch.uint8, 5)
    if case == "strided":
        qa = _codes((2, 8, 6, 12), torch.uint8, 4)[..., ::2]
    elif case == "not-a-gate":
        qg = _codes((2, 8, 6, 6), torch.uint8, 5)
    elif case == "gate-dtype":
        qg = qg.to(torch.int8)
    args = (qa, 70, qg, 3, 0.01, 86, 0, 255, torch.uint8)
    assert torch.equal(native_squeeze_excite.gate_mul_codes(*args), program_ops.mul_codes(*args))


def test_a_pool_too_large_for_exact_float32_sums_goes_to_the_torch_kernels(native_on):
    q = torch.full((1, 2, 260, 260), 255, dtype=torch.uint8)  # 67600 * 255 >= 2**24
    assert torch.equal(native_squeeze_excite.global_avg_pool_codes(q, 0.01, 0, 0.01, 0), program_ops.global_avg_pool_codes(q, 0.01, 0, 0.01, 0))
    assert native_squeeze_excite.global_avg_pool_codes(q, 0.01, 0, 0.01, 0).flatten().tolist() == [255, 255]


class _SqueezeExcite(nn.Module):
    """A squeeze-excite block as torchvision (adaptive_avg_pool2d) or timm (mean) writes it."""

    def __init__(self, gate_first: bool, pool_by_mean: bool):
        super().__init__()
        self.gate_first, self.pool_by_mean = gate_first, pool_by_mean
        self.conv, self.out = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 8, 1)
        self.reduce, self.expand = nn.Conv2d(16, 4, 1), nn.Conv2d(4, 16, 1)

    def forward(self, x):
        x = torch.relu(self.conv(x))
        squeezed = x.mean((2, 3), keepdim=True) if self.pool_by_mean else F.adaptive_avg_pool2d(x, 1)
        gate = torch.sigmoid(self.expand(torch.relu(self.reduce(squeezed))))
        return self.out(gate * x if self.gate_first else x * gate)


@pytest.mark.parametrize("pool_by_mean", [False, True], ids=["adaptive_avg_pool2d", "mean"])
@pytest.mark.parametrize("gate_first", [False, True], ids=["x*gate", "gate*x"])
def test_a_squeeze_excite_block_runs_natively_with_the_same_output(native_on, monkeypatch, gate_first, pool_by_mean):
    torch.manual_seed(0)
    model, data = _SqueezeExcite(gate_first, pool_by_mean).eval().requires_grad_(False), [torch.randn(2, 3, 12, 12) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data)
    out = qmodel(data[1])
    (program,) = programs_of(qmodel).values()
    targets = {n.target for n in program.graph.nodes}
    assert {native_elementwise.quantize_channels_last, native_squeeze_excite.gate_mul_codes, native_squeeze_excite.global_avg_pool_codes} <= targets
    monkeypatch.setattr(native, "available", lambda: False)  # the same model, programs of torch kernels
    torch_model = lucid_fx.quantize(model, (data[0],), data)
    assert torch.equal(torch_model(data[1]), out)
    (torch_program,) = programs_of(torch_model).values()
    assert {program_ops.mul_codes, program_ops.global_avg_pool_codes} <= {n.target for n in torch_program.graph.nodes}
    reference = lucid_fx.quantize(model, (data[0],), data, reference=True)(data[1])
    assert _sqnr(out, model(data[1])) >= 30 and _sqnr(out, reference) >= 35


def _sqnr(x: torch.Tensor, ref_: torch.Tensor) -> float:
    return float(10 * torch.log10(ref_.pow(2).mean() / (x - ref_).pow(2).mean()))


@pytest.mark.parametrize("table_dtype", [torch.uint8, torch.int8, torch.float32])
@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("shape,layout", [((1, 96, 1, 1), "contiguous"), ((2, 16, 9, 7), "channels_last"),
                                          ((3, 5000), "contiguous")])
def test_a_table_lookup_equals_the_reference(native_or_torch, table_dtype, code_dtype, shape, layout):
    q = _codes(shape, code_dtype, 6)
    q = q.contiguous(memory_format=LAYOUTS[layout]) if q.dim() == 4 else q
    table = torch.randn(256) if table_dtype == torch.float32 else _codes((256,), table_dtype, 7)
    out = cpu_float.lut(q, table)
    assert out.dtype == table_dtype and out.stride() == q.stride()
    assert torch.equal(out, ref.lut(q, table))
    if native_or_torch == "native" and (table_dtype == torch.float32 or q.numel() < cpu_float.PAIR_LOOKUP_MIN):
        assert torch.equal(native_lut.lut(q, table), out)  # the path cpu_float.lut took


@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
def test_the_native_lookup_of_a_slice_copies_it_first_with_the_references_values(native_on, code_dtype):
    q, table = _codes((2, 16, 4, 16), code_dtype, 8).transpose(1, 2), _codes((256,), torch.uint8, 9)
    half = q[..., 8:]  # rotate_half's second half of a transposed projection: not dense
    out, expected = native_lut.lut(half, table), ref.lut(half, table)
    assert torch.equal(out, expected) and out.is_contiguous()


def test_the_native_lookup_declines_what_it_does_not_take(native_on):
    q, table = _codes((4, 6), torch.uint8, 8), _codes((256,), torch.uint8, 9)
    assert native_lut.lut(q.to(torch.int32), table) is None  # not 8-bit codes
    assert native_lut.lut(q, table[:128]) is None  # not 256 entries
    assert native_lut.lut(q, table.to(torch.int64)) is None  # no C function for this table dtype


@pytest.mark.parametrize("code_dtypes", [(torch.uint8, torch.uint8), (torch.int8, torch.uint8), (torch.int8, torch.int8)])
@pytest.mark.parametrize("dtype,a_zp,b_zp,zp,bounds", [(torch.uint8, 128, 0, 128, (0, 255)), (torch.uint8, 3, 7, 0, (0, 255)),
                                                       (torch.int8, 0, -128, 1, (-128, 127)), (torch.int8, 5, 0, 0, (0, 127))])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gated_product_of_two_lookups_equals_the_torch_kernels(native_on, code_dtypes, dtype, a_zp, b_zp, zp, bounds,
                                                                  layout):
    qa = _codes((2, 16, 9, 7), code_dtypes[0], 10).contiguous(memory_format=LAYOUTS[layout])
    qb = _codes((2, 16, 9, 7), code_dtypes[1], 11).contiguous(memory_format=LAYOUTS[layout])
    ta, tb = _codes((256,), dtype, 12), _codes((256,), dtype, 13)
    for mult in (0.00390625, 0.5, 1 / 3):
        out = native_lut.lut_mul_codes(qa, ta, a_zp, qb, tb, b_zp, mult, zp, *bounds, dtype)
        expected = program_ops.mul_codes(ref.lut(qa, ta), a_zp, ref.lut(qb, tb), b_zp, mult, zp, *bounds, dtype)
        assert torch.equal(out, expected) and out.stride() == qa.stride()


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("code_dtype", [torch.uint8, torch.int8])
def test_the_gated_product_of_every_pair_of_codes_on_each_build(native_build, build, code_dtype):
    # All 65536 pairs (blocks of 256 codes: the byte lookups, VBMI or AVX2, then vector products)
    # and a tail of 37 (one at a time through int32 tables).
    native_build(build)
    info = torch.iinfo(code_dtype)
    codes = torch.arange(info.min, info.max + 1).to(code_dtype)
    qa, qb = codes.repeat_interleave(256), codes.repeat(256)
    qa, qb = torch.cat([qa, qa[:37]]), torch.cat([qb, qb[1000:1037]])
    for dtype, a_zp, b_zp, zp, bounds in ((torch.uint8, 128, 0, 128, (0, 255)), (torch.int8, 5, -128, 1, (-128, 127))):
        ta, tb = _codes((256,), dtype, 18), _codes((256,), dtype, 19)
        out = native_lut.lut_mul_codes(qa, ta, a_zp, qb, tb, b_zp, 1 / 300, zp, *bounds, dtype)
        expected = program_ops.mul_codes(ref.lut(qa, ta), a_zp, ref.lut(qb, tb), b_zp, 1 / 300, zp, *bounds, dtype)
        assert torch.equal(out, expected), (build, dtype)
        assert expected.unique().numel() > 100  # the products span the grid, not a corner of it


@pytest.mark.parametrize("case", ["layouts-differ", "strided", "table-dtype", "no-native"])
def test_the_gated_product_leaves_what_it_does_not_take_to_the_torch_kernels(native_env, case):
    native_env(**({"LUCID_FX_NATIVE": "0"} if case == "no-native" else {}))
    qa, qb = _codes((2, 8, 6, 6), torch.uint8, 14), _codes((2, 8, 6, 6), torch.uint8, 15)
    ta, tb = _codes((256,), torch.uint8, 16), _codes((256,), torch.uint8, 17)
    if case == "layouts-differ":
        qb = qb.contiguous(memory_format=torch.channels_last)
    elif case == "strided":
        qa, qb = qa[..., ::2], qb[..., ::2]
    elif case == "table-dtype":
        tb = tb.to(torch.int8)
    out = native_lut.lut_mul_codes(qa, ta, 128, qb, tb, 0, 0.004, 128, 0, 255, torch.uint8)
    assert torch.equal(out, program_ops.mul_codes(ref.lut(qa, ta), 128, ref.lut(qb, tb), 0, 0.004, 128, 0, 255, torch.uint8))


class _GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        # gates after a rescale, so tables (a tanh or sigmoid straight after a linear is its post-op)
        return self.down(torch.tanh(self.up(x) / 2) * torch.sigmoid(self.gate(x) / 2))


def test_a_gated_mlp_multiplies_its_two_lookups_in_one_native_pass(native_on, monkeypatch):
    torch.manual_seed(0)
    model, data = _GatedMLP().eval().requires_grad_(False), [torch.randn(16, 32) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data)
    out = qmodel(data[1])
    (program,) = programs_of(qmodel).values()
    targets = [called(n) for n in program.graph.nodes if n.op == "call_function"]
    assert native_lut.lut_mul_codes in targets and program_ops.mul_codes not in targets
    monkeypatch.setattr(native, "available", lambda: False)
    torch_model = lucid_fx.quantize(model, (data[0],), data)
    assert torch.equal(torch_model(data[1]), out)
    (torch_program,) = programs_of(torch_model).values()
    assert program_ops.mul_codes in {n.target for n in torch_program.graph.nodes}
    assert _sqnr(out, model(data[1])) >= 30


@pytest.mark.parametrize("build", ["this CPU", "portable"])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 1000, 4099])
def test_8_bit_lookups_are_exact_with_and_without_the_vector_path(native_build, build, n):
    # "this CPU": -march=native (AVX512-VBMI where the CPU has it: 64 codes per step; else AVX2: 32
    # codes through 16 vpshufb; then a scalar tail); "portable": the scalar loop alone.
    native_build(build)
    if build == "portable":
        assert not native_lut.lut_vectorized()
    elif Path("/proc/cpuinfo").exists() and "-march=native" in native.status():
        flags = set(Path("/proc/cpuinfo").read_text().split())  # Linux spells VBMI "avx512vbmi"
        assert native_lut.lut_vectorized() == ({"avx512vbmi", "avx512bw"} <= flags or "avx2" in flags)
    for code_dtype in (torch.uint8, torch.int8):
        for table_dtype in (torch.uint8, torch.int8):
            q, table = _codes((n,), code_dtype, n), _codes((256,), table_dtype, n + 1)
            assert torch.equal(native_lut.lut(q, table), ref.lut(q, table))


@pytest.mark.parametrize("dtype,zp,bounds", [(torch.uint8, 128, (0, 255)), (torch.uint8, 3, (0, 255)),
                                             (torch.int8, -1, (-128, 127)), (torch.int8, 0, (0, 127))])
@pytest.mark.parametrize("dense", [True, False])
def test_requantizing_a_float_result_in_one_pass_equals_the_torch_kernels(native_on, dtype, zp, bounds, dense):
    y = torch.randn(4, 4, 33, 40, generator=torch.Generator().manual_seed(21)) * 300
    y[0, 0, 0, :8] = torch.arange(8) + 0.5  # ties, with mult 1
    y = y if dense else y[..., ::2]
    for mult in (1.0, 0.37, 1 / 3):
        out = native.requantize_scaled(y.clone(), mult, zp, *bounds, dtype)
        expected = program_ops.requantize_codes(y.clone().mul_(mult), zp, *bounds, dtype)
        assert torch.equal(out, expected)


class _Attention(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        scores = torch.matmul(self.q(x), self.k(x).transpose(-2, -1)) / 8
        return torch.matmul(torch.softmax(scores, -1), self.v(x))


def _plans(program, target):
    """The plan constants (or None) the calls of ``target`` in ``program`` pass."""
    node_plans = [n.args[-1] for n in program.graph.nodes if n.target is target]
    return [None if p is None else getattr(program, p.target) for p in node_plans]


def test_attention_s_matmuls_and_softmax_requantize_natively(native_on, monkeypatch):
    # q @ k^T on native_matmul.c, softmax(s) @ v as one call: softmax_exp and the product a multiplier a row
    torch.manual_seed(0)
    model, data = _Attention().eval().requires_grad_(False), [torch.randn(2, 16, 32) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data)
    out = qmodel(data[1])
    (program,) = programs_of(qmodel).values()
    assert {matmul_native.matmul_codes, attention_rows.cpu_softmax_matmul} <= {n.target for n in program.graph.nodes}
    assert [type(p).__name__ for p in _plans(program, attention_rows.cpu_softmax_matmul)] == ["MatmulPlan"]
    monkeypatch.setattr(native, "available", lambda: False)
    torch_model = lucid_fx.quantize(model, (data[0],), data)
    assert torch.equal(torch_model(data[1]), out)
    (torch_program,) = programs_of(torch_model).values()
    assert {program_ops.matmul_codes, attention_rows.cpu_softmax_matmul} <= {n.target for n in torch_program.graph.nodes}
    assert _plans(torch_program, attention_rows.cpu_softmax_matmul) == [None]
    assert _sqnr(out, model(data[1])) >= 25


def test_native_calls_are_profiler_events_only_while_recording_is_on(native_on):
    x = torch.randn(4, 64)

    def events():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            codes = native.quantize_codes(x, 10.0, 3, 0, 255, torch.uint8)
        return codes, [e.name for e in prof.events()]

    plain, names = events()
    assert "native::quantize" not in names
    native.record_in_profiler(True)
    try:
        recorded, names = events()
    finally:
        native.record_in_profiler(False)
    assert names.count("native::quantize") == 1 and torch.equal(recorded, plain)
    assert native._function("quantize", torch.uint8) is native._library()[0]["quantize", torch.uint8]  # off again


def test_a_recorded_native_call_adds_under_a_microsecond_inside_its_event():
    # torch's C++ fast record, not record_function (3.5 us of Python inside each event: benchmarks/overhead.py counted
    # it as kernel time, and its outside figures for native calls read 3.5 us an op too low)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            with native._event("native::nothing"):
                pass
    inside = sorted(e.self_cpu_time_total for e in prof.events() if e.name == "native::nothing")
    assert len(inside) == 200 and inside[100] < 1.0, inside[100]
