"""lucid_fx/rules/lowering_grouped.py: a mixture of experts' grouped products (Mixtral's, as
transformers writes them) become lucid_fx::grouped_linear on int8 expert weights, observed by the
QConfig's weight observer as a linear's weight is."""

import io

import pytest
import torch
import torch.nn as nn

import lucid_fx
from lucid_fx.kernels import resolve_target
from lucid_fx.kernels.library import op_name

OFFSETS = torch.tensor([5, 9, 9, 16], dtype=torch.int32)  # four experts, the third with no rows


class Experts(nn.Module):
    """Mixtral's experts: weights stored (E, N, K), the product reads their transpose (E, K, N)."""

    def __init__(self, transposed=True):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.transposed = transposed
        self.router = nn.Linear(32, 32)
        with torch.no_grad():  # the same weights whatever ran before
            self.router.weight.copy_(torch.randn(32, 32, generator=g) * 0.2)
            self.router.bias.copy_(torch.randn(32, generator=g) * 0.1)
        up, down = torch.randn(4, 64, 32, generator=g) * 0.1, torch.randn(4, 32, 64, generator=g) * 0.1
        # transposed=False: stored as the product reads them, (E, K, N)
        self.up = nn.Parameter(up if transposed else up.transpose(-2, -1).contiguous())
        self.down = nn.Parameter(down if transposed else down.transpose(-2, -1).contiguous())

    def _weight(self, w):
        return w.transpose(-2, -1) if self.transposed else w

    def forward(self, x, offs):
        h = torch._grouped_mm(self.router(x), self._weight(self.up), offs=offs)
        return torch._grouped_mm(torch.relu(h), self._weight(self.down), offs=offs)


def _converted(model, **convert_kwargs):
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(16, 32), OFFSETS))
    g = torch.Generator().manual_seed(1)
    lucid_fx.calibrate(prepared, [(torch.randn(16, 32, generator=g), OFFSETS) for _ in range(4)], progress=False)
    return prepared, lucid_fx.convert(prepared, **convert_kwargs)


def _kernels(model):
    return [op_name(n) for n in model.graph.nodes if op_name(n) not in (None, "quantize_per_tensor", "dequantize_per_tensor")]


@pytest.mark.parametrize("transposed", [True, False], ids=["stored_n_by_k", "stored_k_by_n"])
def test_experts_run_as_int8_grouped_products(transposed, sqnr_db):
    model = Experts(transposed).eval()
    prepared, qmodel = _converted(model)
    assert _kernels(qmodel) == ["linear", "grouped_linear", "lut", "grouped_linear"]
    report = qmodel.lucid_fx_convert_report
    assert str(report).splitlines()[1] == "int8 FLOPs: 100.0% of 164 kFLOP"
    reference = lucid_fx.convert(prepared, reference=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32, int8, ref = model(x, OFFSETS), qmodel(x, OFFSETS), reference(x, OFFSETS)
    assert sqnr_db(fp32, int8) > 29  # 30.3 dB measured
    assert sqnr_db(ref, int8) > 30  # the same values here; at most a code or two apart where kernels round inside
    codes = qmodel.get_buffer("_lucid__grouped_mm_qweight")
    assert codes.shape == (4, 64, 32) and codes.dtype == torch.int8  # (E, N, K), as a linear's weight
    assert codes.min() >= resolve_target("cpu").weight_range[0]
    # the reference multiplies by the weights the kernel reads, per (expert, output channel)
    scales = qmodel.get_buffer("_lucid__grouped_mm_wscale")
    assert scales.shape == (4, 64)
    up = reference.up.transpose(-2, -1) if not transposed else reference.up
    assert torch.allclose(up, codes * scales[..., None], rtol=0, atol=1e-7)
    assert torch.equal(model.up, Experts(transposed).up)  # convert and the reference left the model as it was
    assert torch.equal(prepared.up, model.up) and not torch.equal(reference.up, model.up)  # the reference changed its copy


@pytest.mark.parametrize("transposed", [True, False], ids=["stored_n_by_k", "stored_k_by_n"])
def test_experts_take_the_qconfigs_weight_observer_as_a_linear_does(transposed, sqnr_db):
    # A per-tensor weight observer: one scale for every row of every expert, as for the router linear,
    # where the default gives one per (expert, output channel); the reference multiplies by the same.
    from lucid_fx.quantization import QConfig, QConfigMapping, per_tensor_symmetric, qint8
    from lucid_fx.quantization.observers import MinMaxObserver

    model = Experts(transposed).eval()
    qconfig = QConfig(activation=lucid_fx.quantization.default_qconfig.activation,
                      weight=MinMaxObserver.with_args(qscheme=per_tensor_symmetric, qdtype=qint8))
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(16, 32), OFFSETS),
                                qconfig_mapping=QConfigMapping().set_global(qconfig))
    assert sorted(prepared.lucid_fx_weight_observers.keys()) == ["_grouped_mm_1_experts", "_grouped_mm_experts", "router"]
    g = torch.Generator().manual_seed(1)
    lucid_fx.calibrate(prepared, [(torch.randn(16, 32, generator=g), OFFSETS) for _ in range(4)], progress=False)
    qmodel, reference = lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)
    low, high = resolve_target("cpu").weight_range
    for name, weight in (("_lucid__grouped_mm_wscale", model.up), ("_lucid__grouped_mm_1_wscale", model.down)):
        scales = qmodel.get_buffer(name)
        assert scales.unique().numel() == 1, name
        assert abs(float(scales[0, 0]) - float(weight.detach().abs().max()) / ((high - low) / 2)) < 1e-9
    default = _converted(Experts(transposed).eval())[1].get_buffer("_lucid__grouped_mm_wscale")
    assert default.unique().numel() == default.numel()  # per (expert, output channel) by default
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the same weights (a code apart at most where a kernel rounds inside)
        assert sqnr_db(reference(x, OFFSETS), qmodel(x, OFFSETS)) > 30


def test_experts_save_and_load_as_int8(tmp_path):
    _, qmodel = _converted(Experts().eval())
    lucid_fx.save(qmodel, tmp_path / "experts.pt")
    loaded = lucid_fx.load(tmp_path / "experts.pt")
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    assert _kernels(loaded) == _kernels(qmodel)
    assert torch.equal(loaded(x, OFFSETS), qmodel(x, OFFSETS))


class FallbackExperts(Experts):
    """As transformers' grouped_mm experts forward under torch.export: its own op, grouped_mm_fallback."""

    def forward(self, x, offs):
        fallback = torch.ops.transformers.grouped_mm_fallback
        h = fallback(self.router(x), self.up.transpose(-2, -1), offs)
        return fallback(torch.relu(h), self.down.transpose(-2, -1), offs)


def test_transformers_fallback_under_export_becomes_the_same_int8_product(sqnr_db):
    """transformers (integrations/moe.py) calls its grouped_mm_fallback op where torch._grouped_mm
    may not run (under torch.export, for float32 weights): the same grouped product, read from the export."""
    pytest.importorskip("transformers.integrations.moe", reason="the test extra installs transformers")
    model = FallbackExperts().eval()
    exported = torch.export.export(model, (torch.randn(16, 32), OFFSETS), strict=False)
    assert "transformers.grouped_mm_fallback" in str(exported.graph)
    _, qmodel = _converted(exported)
    assert _kernels(qmodel) == ["linear", "grouped_linear", "lut", "grouped_linear"]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert sqnr_db(model(x, OFFSETS), qmodel(x, OFFSETS)) > 29
