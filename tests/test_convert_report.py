"""The convert report (lucid_fx/_convert_report.py, ConvertReport in lucid_fx/_placement.py): every
float region with its reason, and the share of matrix FLOPs in int8, checked against a hand count
and against torch's own FLOP counter."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import lucid_fx
from lucid_fx._flops import counting_module_flops, graph_flops
from lucid_fx.quantization.qconfig import get_default_qconfig_mapping


def opaque_scale(x):
    return x * 2


torch.fx.wrap("opaque_scale")


class Branchy(nn.Module):
    """fx cannot trace it (a Proxy in a condition): the fallback keeps it float, quantizes ``fc``."""

    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        y = self.fc(x)
        if y.dim() == 2:
            y = y @ self.w  # float, inside the float module: 2 * (2 * 8) * 8 FLOPs
        return y


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        return x @ self.w


class EveryKind(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.leaf, self.head = nn.Linear(8, 8), Branchy(), Leaf(), nn.Linear(8, 4)

    def forward(self, x):
        h = self.leaf(self.block(self.stem(x)))
        return self.head(opaque_scale(torch.cumsum(h, dim=-1)))


def _calibrated():
    torch.manual_seed(0)
    model = EveryKind().eval()
    data = [torch.randn(2, 8) for _ in range(3)]
    mapping = get_default_qconfig_mapping().set_module_name("head", None)
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(data[0],), leaf_modules=[Leaf], capture="fx")
    lucid_fx.calibrate(prepared, data, progress=False)
    return model, data, prepared


def _converted():
    model, data, prepared = _calibrated()
    return model, data, lucid_fx.convert(prepared)


def test_the_report_lists_every_kind_of_float_region_with_its_reason_and_flops():
    model, data, qmodel = _converted()
    report = qmodel.lucid_fx_convert_report
    regions = {r.name: (r.kind, r.flops) for r in report.float_regions}
    # by hand, batch 2: stem, block.fc and the block's own matmul 2*(2*8)*8, the leaf's matmul the
    # same, head 2*(2*4)*8; cumsum and the opaque function have no matrix FLOPs.
    assert regions == {
        "block": ("module", 256), "leaf": ("leaf module", 256), "cumsum": ("op", 0), "opaque_scale": ("function", 0),
        "head": ("kept", 128),
    }
    why = {r.name: r.why for r in report.float_regions}
    assert why["block"].startswith("Branchy at ") and "`if y.dim() == 2:`" in why["block"] and "TraceError" in why["block"]
    assert why["head"] == "QConfig is None for this module/op"
    assert why["opaque_scale"] == "no observer rule quantizes this op" and why["leaf"] == "no observer rule quantizes this op"
    assert report.lowered == {"stem": "linear", "block.fc.linear": "linear"}
    assert (report.total_flops, report.int8_flops) == (5 * 256 - 128, 2 * 256)
    assert abs(report.int8_flop_share - 512 / 1152) < 1e-12
    lines = str(report).splitlines()
    assert lines[1] == "int8 FLOPs: 44.4% of 1.15 kFLOP (float: block 22.2%, leaf 22.2%, head 11.1%)"
    assert lines[2].startswith("  float module: block (Branchy) at ")
    assert lines[2].endswith(" [22.2% of FLOPs]") and "`if y.dim() == 2:`: TraceError: " in lines[2]
    assert lines[3:] == [
        "  float leaf module: leaf (no observer rule quantizes this op, 22.2% of FLOPs)",
        "  float op: cumsum (no observer rule quantizes this op)",
        "  float function: opaque_scale (no observer rule quantizes this op)",
        "  kept float: head (QConfig is None for this module/op, 11.1% of FLOPs)",
    ]
    # the total is what torch's own counter sees in one float run
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(data[0])
    assert counter.get_total_flops() == report.total_flops


def test_explain_predicts_the_same_share_and_regions_before_convert():
    _, _, prepared = _calibrated()
    text = str(lucid_fx.explain(prepared)).splitlines()
    at = text.index("convert will run (predicted):")
    assert text[at + 1] == "int8 FLOPs: 44.4% of 1.15 kFLOP (float: block 22.2%, leaf 22.2%, head 11.1%)"
    assert str(lucid_fx.convert(prepared).lucid_fx_convert_report).splitlines()[1:] == text[at + 1 :]


def test_a_model_without_example_inputs_counts_nothing_and_says_so():
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    prepared = lucid_fx.prepare(model)
    lucid_fx.calibrate(prepared, [torch.randn(2, 8)], progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    assert report.int8_flop_share is None and report.total_flops == 0
    assert str(report).splitlines()[1].startswith("int8 FLOPs: none counted")


def test_graph_flops_count_linear_conv_matmul_addmm_and_attention_from_prepare_shapes():
    class Ops(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3, groups=1), nn.Linear(16, 8)
            self.bias, self.w = nn.Parameter(torch.zeros(8)), nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = self.fc(self.conv(x).flatten(2))  # (2, 4, 16) -> (2, 4, 8)
            h = torch.addmm(self.bias, h.reshape(8, 8), self.w).reshape(2, 1, 4, 8)
            return torch.nn.functional.scaled_dot_product_attention(h, h, h) @ h.transpose(-1, -2)

    model = Ops().eval()
    x = torch.randn(2, 3, 6, 6)
    flops = graph_flops(lucid_fx.prepare(model, example_inputs=(x,)))
    conv, fc, addmm = 2 * (2 * 4 * 4 * 4) * 27, 2 * (2 * 4 * 8) * 16, 2 * (8 * 8) * 8
    sdpa, matmul = 2 * (2 * 4) * 4 * (8 + 8), 2 * (2 * 4 * 4) * 8
    # prepare writes the attention out as its two matmuls (passes/decompose_attention.py): q k^T, p v
    assert sorted(flops.values()) == sorted([conv, fc, addmm, sdpa // 2, sdpa // 2, matmul])
    with counting_module_flops(model) as measured, torch.no_grad():
        model(x)
    assert measured[""] == measured["conv"] + measured["fc"] + addmm + sdpa + matmul == sum(flops.values())


class Experts(nn.Module):
    """A mixture-of-experts layer: rows grouped by expert, one grouped product, on weights computed
    in the graph (``w * gain``), which int8 cannot take (Mixtral's own: tests/rules/test_lowering_grouped.py)."""

    def __init__(self):
        super().__init__()
        self.router, self.w, self.out = nn.Linear(8, 8), nn.Parameter(torch.randn(2, 8, 16) * 0.1), nn.Linear(16, 4)
        self.gain = nn.Parameter(torch.ones(2, 1, 16))

    def forward(self, x, offsets):
        return self.out(torch._grouped_mm(self.router(x), self.w * self.gain, offs=offsets))


def test_grouped_products_that_stay_float_count_and_show():
    """A grouped product kept in float is counted and named: the report had counted Mixtral's
    experts as 0 FLOPs and said 100% in int8 while they ran in float (48.7% on the real class)."""
    x, offsets = torch.randn(8, 8), torch.tensor([3, 8], dtype=torch.int32)
    model = Experts().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(x, offsets))
    lucid_fx.calibrate(prepared, [(torch.randn(8, 8), offsets) for _ in range(2)], progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    router, grouped, out = 2 * 8 * 8 * 8, 2 * 8 * 16 * 8, 2 * 8 * 4 * 16  # each row times its expert's (8, 16)
    assert report.total_flops == router + grouped + out
    assert str(report).splitlines()[1] == "int8 FLOPs: 50.0% of 4.1 kFLOP (float: _grouped_mm 50.0%)"
    # torch's own counter has no formula for aten._grouped_mm (it counted Mixtral's experts as 0): ours
    with counting_module_flops(model) as measured, torch.no_grad():
        model(x, offsets)
    assert measured[""] == router + grouped + out


class Recurrent(nn.Module):
    def __init__(self, cell: type):
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(50, 16), cell(16, 32, batch_first=True), nn.Linear(32, 4)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out[:, -1])


@pytest.mark.parametrize("cell,gates", [(nn.LSTM, 4), (nn.GRU, 3), (nn.RNN, 1)])
def test_a_recurrent_layer_left_float_is_counted_and_named(cell, gates):
    """nn.LSTM returns a tuple, so its node gets no decision: the report listed no float region and, with
    oneDNN's LSTM layer uncounted by torch's FLOP counter, said 100% in int8 while it ran in float. (Convert
    runs nn.LSTM, nn.GRU and nn.RNN in int8 unless their QConfig is None: passes/lower_recurrent.py.)"""
    torch.manual_seed(0)
    model, ids = Recurrent(cell).eval(), torch.randint(0, 50, (2, 10))
    prepared = lucid_fx.prepare(model, example_inputs=(ids,), qconfig_mapping=get_default_qconfig_mapping().set_module_name("rnn", None))
    lucid_fx.calibrate(prepared, [torch.randint(0, 50, (2, 10)) for _ in range(2)], progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    rnn, head = 2 * 2 * 10 * gates * 32 * (16 + 32), 2 * 2 * 4 * 32  # every step's input and state times the gates
    assert report.total_flops == rnn + head
    assert f"float leaf module: rnn (no lowering rule for rnn, {100 * rnn / (rnn + head):.1f}% of FLOPs)" in str(report)


class Decoder(nn.Module):
    """A cell a step, its state made with torch.zeros(x.shape[1], ...), which torch.fx cannot trace: captured
    by torch.export, whose graph calls torch.gru_cell (torch.lstm_cell) with the cell's weights."""

    def __init__(self, cell: type):
        super().__init__()
        self.cell, self.out = cell(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = torch.zeros(x.shape[1], 32)
        state = h if isinstance(self.cell, nn.GRUCell) else (h, torch.zeros(x.shape[1], 32))
        steps = []
        for t in range(3):
            state = self.cell(x[t], state)
            steps.append(self.out(state if isinstance(self.cell, nn.GRUCell) else state[0]))
        return torch.stack(steps)


@pytest.mark.parametrize("cell,gates", [(nn.GRUCell, 3), (nn.LSTMCell, 4)])
def test_recurrent_functions_are_counted_and_named(cell, gates):
    # torch.export records nn.GRUCell as torch.gru_cell (a traced nn.LSTM subclass as torch.lstm): their
    # products were no matrix op the report counted, so it said 100% int8 while the cells ran in float.
    torch.manual_seed(1)
    model, x = Decoder(cell).eval(), torch.randn(3, 2, 16)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    assert "export" in str(prepared.lucid_fx_report)
    lucid_fx.calibrate(prepared, [torch.randn(3, 2, 16) for _ in range(2)], progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    step, out = 2 * 2 * gates * 32 * (16 + 32), 2 * 2 * 16 * 32  # the input and the state times the gates; the head
    assert report.total_flops == 3 * (step + out) and report.int8_flops == 3 * out
    floats = {r.name: r.flops for r in report.float_regions if r.flops}
    assert sorted(floats.values()) == [step] * 3 and all(cell.__name__.replace("Cell", "").lower() in name for name in floats), floats
