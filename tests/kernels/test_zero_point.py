"""lucid_fx/kernels/zero_point.py: where a uint8 zero point neither folds into the bias exactly nor is left to
oneDNN exactly (AMX), a linear's codes go in as int8, whose zero point folds exactly for twice as wide a weight."""

import pytest
import torch

import lucid_fx
from lucid_fx.kernels import cpu, force_cpu_features, linear_native, zero_point
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.cpu_features import detected_cpu_features
from _program import lowered

ops = torch.ops.lucid_fx

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


@pytest.fixture(autouse=True)
def _onednn_takes_the_rows():
    """These tests are about oneDNN's call: lucid_fx's AMX GEMM, which takes such linears where it runs (its exact
    int32 sums need no int8 codes), is off for them (tests/kernels/test_native_amx.py is its)."""
    was = linear_native.amx()
    linear_native.use_amx(False)
    yield
    linear_native.use_amx(was)


def _wide_weight(n=8, k=1024, magnitude=100):
    """A weight whose sum of magnitudes s has 255 s >= 2^24 > 128 s: no uint8 fold, an int8 one."""
    signs = torch.randint(0, 2, (n, k), generator=torch.Generator().manual_seed(3)) * 2 - 1
    return (signs * magnitude).to(torch.int8)


def test_int8_codes_are_uint8_codes_128_lower():
    codes = torch.tensor([0, 1, 127, 128, 129, 255], dtype=torch.uint8)
    assert zero_point.to_signed(codes).tolist() == [-128, -127, -1, 0, 1, 127]


def test_the_int8_fold_takes_twice_as_wide_a_weight():
    qw, ws = _wide_weight(), torch.full((8,), 0.01)
    bias = torch.linspace(-1, 1, 8)
    assert 255 * 100 * 1024 >= 2 ** 24 > 128 * 100 * 1024
    assert zero_point._zero_point_in_bias(qw, ws, bias, 0.02, 117) is None  # uint8 codes: the sums could round
    folded = zero_point.signed_zero_point_bias(qw, ws, bias, 0.02, 117)
    want = bias.double() - 0.02 * (117 - 128) * ws.double() * qw.double().sum(1)
    torch.testing.assert_close(folded, want.float())
    assert zero_point.signed_zero_point_bias(_wide_weight(magnitude=127) * 0 + 127, ws, bias, 0.02, 117) is not None
    too_wide = torch.full((8, 1100), 127, dtype=torch.int8)  # 128 * 127 * 1100 >= 2^24
    assert zero_point.signed_zero_point_bias(too_wide, ws, bias, 0.02, 117) is None


def test_a_weight_of_minus_128_codes_counts_its_magnitude():
    qw = torch.full((2, 600), -128, dtype=torch.int8)  # 255 * 128 * 600 >= 2^24 > 128 * 128 * 600
    assert zero_point._weight_sums(qw) is None  # -128 .abs() is -128 in int8: summed so, it looked exact
    assert torch.equal(zero_point._weight_sums(qw, code_max=128), torch.full((2,), -76800.0, dtype=torch.float64))
    assert zero_point._weight_sums(torch.full((2, 1100), -128, dtype=torch.int8), code_max=128) is None


@pytest.mark.parametrize("out", [("uint8", 131), ("float32", 0)])
def test_a_wide_linear_with_a_zero_point_runs_on_onednn_as_int8_codes_where_amx_runs(out, monkeypatch):
    dtype, out_zp = getattr(torch, out[0]), out[1]
    qw, ws = _wide_weight(), torch.rand(8, generator=torch.Generator().manual_seed(4)) * 0.01 + 0.001
    bias = torch.randn(8, generator=torch.Generator().manual_seed(5))
    qx = torch.randint(0, 256, (64, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    args = (qx, 0.02, 117, qw, ws, bias, 0.5, out_zp, "none", dtype)
    routes = []
    fallback, signed = cpu.int8_linear, cpu.to_signed
    monkeypatch.setattr(cpu, "int8_linear", lambda *a, **k: routes.append("_int_mm") or fallback(*a, **k))
    monkeypatch.setattr(cpu, "to_signed", lambda q: routes.append("int8 codes") or signed(q))
    with cpu.use_onednn(True), force_cpu_features("amx"):
        got = ops.linear(*args)
    want = ref.linear(*args)
    # oneDNN takes the full grid where the CPU has VNNI; an AVX2 CPU forced to AMX keeps the exact fallback
    assert routes == (["int8 codes"] if detected_cpu_features().vnni else ["_int_mm"])
    if dtype == torch.uint8:
        assert int((got.int() - want.int()).abs().max()) <= 1
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_program_gives_onednn_int8_codes_where_amx_would_round_the_zero_point():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 8), torch.nn.ReLU()).eval()
    x = torch.rand(8, 1024) * 4 - 1  # 8 rows: oneDNN's call, past an AMX CPU's row engine  # a zero point of 64
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x])
    qmodel = lucid_fx.convert(prepared)
    qweight = next(b for name, b in qmodel.named_buffers() if name.endswith("qweight"))
    qweight.copy_(_wide_weight())  # before its first call, which packs it
    with force_cpu_features("amx"):
        portable, program, targets = lowered(qmodel, x)
    assert (torch.ops.onednn.qlinear_pointwise.default in targets) == detected_cpu_features().vnni
    assert torch.equal(program(x), portable)


def test_a_quantize_read_only_by_such_a_linear_writes_int8_codes_itself():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 8), torch.nn.ReLU()).eval()
    x = torch.rand(8, 1024) * 4 - 1  # 8 rows: oneDNN's call, past an AMX CPU's row engine
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x])
    qmodel = lucid_fx.convert(prepared)
    next(b for name, b in qmodel.named_buffers() if name.endswith("qweight")).copy_(_wide_weight())
    with force_cpu_features("amx"):
        portable, program, targets = lowered(qmodel, x)
    if not detected_cpu_features().vnni:
        pytest.skip("an AVX2 CPU keeps such a weight off oneDNN (the exact fallback): no int8 codes to write")
    zp = next(n.args[2] for n in qmodel.graph.nodes if n.target == torch.ops.lucid_fx.quantize_per_tensor)
    quantizes = [n for n in program.graph.nodes if n.op == "call_function" and "quantize" in n.target.__name__]
    assert [n.args[2:6] for n in quantizes] == [(zp - 128, -128, 127, torch.int8)]  # one pass, no uint8 codes
    assert zero_point.to_signed not in targets
    assert torch.equal(program(x), portable)
