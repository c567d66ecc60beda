"""insert_qdq: the reference model multiplies by exactly the int8 kernels' weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx.kernels import weight_quant_range


class FunctionalLinear(nn.Module):
    """Weights read as graph constants (``F.linear(x, self.w)``), not through an nn.Linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 5) * torch.tensor([[0.1], [1.0], [4.0]]))
        self.b = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


class _WeightSpy(fx.Interpreter):
    def call_function(self, target, args, kwargs):
        if target is F.linear or getattr(target, "__name__", "") == "linear":
            self.weight = args[1]
        return super().call_function(target, args, kwargs)


def test_functional_weight_is_quantized_per_channel_on_the_kernel_grid():
    # Regression (found by tests/test_fuzz.py): the reference left a per-channel-observed
    # functional weight in float, and quantized a one-row one per tensor on the full int8 grid.
    torch.manual_seed(0)
    model = FunctionalLinear().eval()
    batches = [torch.randn(4, 5) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    reference = lucid_fx.convert(prepared, reference=True)
    targets = [getattr(n.target, "__name__", "") for n in reference.graph.nodes if n.op == "call_function"]
    assert targets.count("quantize_per_channel") == 1 and targets.count("dequantize_per_channel") == 1
    spy = _WeightSpy(reference)
    spy.run(batches[0])
    qmin, qmax = weight_quant_range("cpu")
    w = model.w.detach()
    plain = w.abs().amax(1, keepdim=True) / ((qmax - qmin) / 2)
    scale = next(b for n, b in reference.named_buffers() if n.endswith("_wscale")).reshape(-1, 1)
    # min/max on the full grid; on [-64, 63] the fraction of it in [0.8, 1] with the least rounding error
    low = 1.0 if qmax == 127 else 0.8
    assert ((scale >= low * plain - 1e-9) & (scale <= plain + 1e-9)).all(), (scale / plain).flatten()
    expected = torch.clamp(torch.round(w * (1 / scale)), qmin, qmax) * scale  # the spec's rounding
    torch.testing.assert_close(spy.weight, expected, rtol=0, atol=1e-6)
    plain_error = ((torch.clamp(torch.round(w / plain), qmin, qmax) * plain - w) ** 2).sum(1)
    assert (((expected - w) ** 2).sum(1) <= plain_error + 1e-9).all()
    assert not torch.allclose(spy.weight, model.w, rtol=0, atol=1e-4)  # really quantized
    # The int8 model multiplies by the same codes: they agree to one output step.
    qmodel = lucid_fx.convert(prepared)
    out_scale = prepared.lucid_fx_observers["linear"].calculate_qparams()[0].item()
    assert (qmodel(batches[1]) - reference(batches[1])).abs().max() <= out_scale + 1e-6


def test_a_float_op_reads_the_float_input_as_convert_feeds_it():
    """x feeds an int8 linear (so x is observed) and a Softmin (no int8 kernel: float). convert
    gives the Softmin the float x; the reference must too, not x's quantized image."""

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.soft = nn.Linear(6, 6), nn.Softmin(dim=-1)

        def forward(self, x):
            return self.fc(x) + self.soft(x)

    torch.manual_seed(0)
    model = Branches().eval()
    data = [torch.randn(4, 6) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    ref = lucid_fx.convert(prepared, reference=True)
    soft = next(n for n in ref.graph.nodes if n.op == "call_module" and n.target == "soft")
    fc = next(n for n in ref.graph.nodes if n.op == "call_module" and n.target == "fc")
    assert soft.args[0].op == "placeholder"  # the raw input
    assert "dequantize_per_tensor" in str(fc.args[0].target)  # the int8 kernel's input is quantized
    real = lucid_fx.convert(prepared)
    with torch.no_grad():  # the simulation computes what the kernels compute, up to rounding inside them
        assert (ref(data[0]) - real(data[0])).abs().max() < 0.05


class Residual(nn.Module):
    """x + fc2(relu(fc1(x))), the model's output, or read by a linear ``head``."""

    def __init__(self, head: bool):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 4) if head else None

    def forward(self, x):
        y = x + self.fc2(torch.relu(self.fc1(x)))
        return self.head(y) if self.head is not None else y


def _qdq_sources(gm):
    return sorted(n.meta["lucid_fx.source"] for n in gm.graph.nodes if str(n.target) == "lucid_fx.quantize_per_tensor")


def test_the_reference_rounds_only_what_the_int8_model_rounds():
    torch.manual_seed(0)
    data = [torch.randn(8, 16) for _ in range(4)]
    for head, rounded in ((False, ["relu", "x"]), (True, ["add", "fc2", "relu", "x"])):
        model = Residual(head).eval()
        prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
        lucid_fx.calibrate(prepared, data, progress=False)
        before = {k: v.clone() for k, v in prepared.state_dict().items()}
        reference, int8 = lucid_fx.convert(prepared, reference=True), lucid_fx.convert(prepared)
        # without a head, the add's result is the output, fc2's result only the add's input: the int8 model
        # computes both in float (passes/fold_dequantize.py), and the reference rounds neither (and adds the
        # float x, as the int8 model does); with the head, the add is an int8 kernel reading fc2's codes
        assert _qdq_sources(reference) == rounded
        assert sorted(int8.lucid_fx_convert_report.float_ops) == ([] if head else ["add"])
        x = torch.randn(8, 16)
        with torch.no_grad():
            got, simulated = int8(x), reference(x)
        assert float(10 * torch.log10(simulated.pow(2).mean() / (simulated - got).pow(2).mean())) > 45
        # learning what int8 rounds lowered the graph once: neither the prepared model nor the reference keeps any of it
        assert prepared.state_dict().keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in prepared.state_dict().items())
        assert not [k for k in reference.state_dict() if "qweight" in k or "wscale" in k]


def test_a_reference_still_builds_where_the_int8_lowering_fails(monkeypatch):
    torch.manual_seed(0)
    data, model = [torch.randn(8, 16) for _ in range(4)], Residual(head=False).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)

    def broken(*args, **kwargs):
        raise RuntimeError("a rule that breaks")

    monkeypatch.setattr("lucid_fx.passes.insert_qdq.lower_to_int8", broken)
    with pytest.warns(UserWarning, match=r"lowering the graph to int8 failed \(RuntimeError: a rule that breaks\)"):
        reference = lucid_fx.convert(prepared, reference=True)
    assert _qdq_sources(reference) == ["add", "fc2", "relu", "x"]  # every observed value, as before
    x = torch.randn(8, 16)
    with torch.no_grad():
        want, got = model(x), reference(x)
    assert float(10 * torch.log10(want.pow(2).mean() / (want - got).pow(2).mean())) > 25
