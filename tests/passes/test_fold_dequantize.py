"""fold_dequantize: int8 results that only get dequantized are computed in float instead."""

import torch
from torch import fx, nn

import lucid_fx
import importlib
from lucid_fx import _meta
from lucid_fx.kernels import use_onednn
from lucid_fx.kernels.library import op_name
from lucid_fx.passes.fold_dequantize import fold_dequantize
from lucid_fx.pipeline import CONVERT_PASSES
from lucid_fx.placement import Runs, placements

_ops = torch.ops.lucid_fx


def _sqnr(ref, out):
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())).item()


def _targets(model):
    return [n.target for n in model.graph.nodes if n.op == "call_function"]


def _quantize(model, x, data, unfolded=False, monkeypatch=None):
    if unfolded:
        monkeypatch.setattr(importlib.import_module("lucid_fx.convert"), "CONVERT_PASSES", [p for p in CONVERT_PASSES if p.__name__ != "_fold_dequantize"])
    return lucid_fx.quantize(model, (x,), data)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Residual(nn.Module):
    """A residual stream that ends the model: its last add and the linear feeding it need no codes."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        h = self.fc1(x).relu()
        return x + self.fc2(h)


def _data(*shape):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) for _ in range(4)]


def test_the_last_linear_gives_its_float_result_and_no_dequantize_is_left():
    torch.manual_seed(0)
    model, data = Mlp().eval(), _data(8, 64)
    q = _quantize(model, data[0], data)
    targets = _targets(q)
    assert _ops.dequantize_per_tensor not in targets
    last = [n for n in q.graph.nodes if n.target is _ops.linear][-1]
    assert last.args[-1] is torch.float32  # out_dtype: the kernel writes float32
    assert _meta.QPARAMS not in last.meta
    assert last.meta[_meta.VALUE_TYPE] == ((8, 32), torch.float32)
    assert q.lucid_fx_convert_report.placements["fc2"].runs is Runs.KERNEL


def test_the_float_result_rounds_to_the_unfolded_codes(monkeypatch):
    torch.manual_seed(0)
    model, data = Mlp().eval(), _data(8, 64)
    folded = _quantize(model, data[0], data)
    unfolded = _quantize(model, data[0], data, unfolded=True, monkeypatch=monkeypatch)
    x = torch.randn(16, 64)
    last = [n for n in unfolded.graph.nodes if n.target is _ops.dequantize_per_tensor][-1]
    scale, zp = last.args[1:]
    with torch.no_grad():
        y, y_unfolded = folded(x), unfolded(x)
    codes = _ops.quantize_per_tensor(y, scale, zp, 0, 255, torch.uint8)
    # the same int8 computation, one rounding fewer: rounding the float result gives the old output
    assert torch.equal(_ops.dequantize_per_tensor(codes, scale, zp), y_unfolded)
    assert (y - y_unfolded).abs().max().item() <= scale / 2 + 1e-6
    assert not torch.equal(y, y_unfolded)


def test_a_residual_add_that_ends_the_model_runs_in_float_and_gains_accuracy(monkeypatch):
    torch.manual_seed(0)
    model, data = Residual().eval(), _data(8, 64)
    folded = _quantize(model, data[0], data)
    targets = _targets(folded)
    assert _ops.add not in targets and torch.add in targets
    fc2 = [n for n in folded.graph.nodes if n.target is _ops.linear][-1]
    assert fc2.args[-1] is torch.float32  # the add's float version frees fc2 to give float too
    report = folded.lucid_fx_convert_report
    add = next(name for name, p in report.placements.items() if p.runs is Runs.FLOAT)
    assert "nothing reads its codes" in report.float_ops[add]
    add_node = next(n for n in folded.graph.nodes if n.target is torch.add)
    assert add_node.args[0].op == "placeholder"  # the residual reads x itself, not its codes
    unfolded = _quantize(model, data[0], data, unfolded=True, monkeypatch=monkeypatch)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref, a, b = model(x), folded(x), unfolded(x)
    assert _sqnr(ref, a) >= _sqnr(ref, b) + 2.0, (_sqnr(ref, a), _sqnr(ref, b))


def test_codes_read_by_an_int8_op_stay_codes():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 8)

        def forward(self, x):
            h = self.fc1(x)
            return h, self.fc2(h)

    torch.manual_seed(0)
    model, data = TwoHeads().eval(), _data(8, 64)
    q = _quantize(model, data[0], data)
    fc1, fc2 = [n for n in q.graph.nodes if n.target is _ops.linear]
    assert fc1.args[-1] is None and fc2.args[-1] is torch.float32  # fc2 reads fc1's codes
    assert [n.args[0] for n in q.graph.nodes if n.target is _ops.dequantize_per_tensor] == [fc1]


def test_quantize_then_dequantize_is_the_float_value():
    graph = fx.Graph()
    x = graph.placeholder("x")
    q = graph.call_function(_ops.quantize_per_tensor, (x, 0.1, 3, 0, 255, torch.uint8))
    graph.output(graph.call_function(_ops.dequantize_per_tensor, (q, 0.1, 3)))
    gm = fold_dequantize(fx.GraphModule(nn.Module(), graph))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "output"]
    x = torch.tensor([0.123, -0.3])
    assert torch.equal(gm(x), x)


def test_a_folded_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model, data = Residual().eval(), _data(8, 64)
    q = _quantize(model, data[0], data)
    lucid_fx.save(q, tmp_path / "m.pt")
    loaded = lucid_fx.load(tmp_path / "m.pt")
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), q(x))


def test_reference_mode_rounds_what_the_int8_model_rounds():
    torch.manual_seed(0)
    model, data = Mlp().eval(), _data(8, 64)
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    for d in data:
        prepared(d)
    reference = lucid_fx.convert(prepared, reference=True)
    int8 = lucid_fx.convert(prepared)
    x = torch.randn(64, 64)
    with torch.no_grad():
        simulated, got = reference(x), int8(x)
    # the int8 model gives fc2's float result, and the simulation does not round it either
    assert 256 < simulated.unique().numel() and 256 < got.unique().numel()
    assert _sqnr(simulated, got) > 50


def test_a_conv_read_only_in_float_gives_float_in_the_float_models_layout():
    conv_out = 8
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, conv_out, 3, padding=1), nn.ReLU(), nn.Conv2d(conv_out, 4, 3)).eval()
    data = _data(2, 3, 10, 10)
    q = _quantize(model, data[0], data)
    conv = [n for n in q.graph.nodes if n.target is _ops.conv2d][-1]
    assert conv.args[-1] is torch.float32
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        y, ref = q(x), model(x)
    assert y.is_contiguous() and y.stride() == ref.stride()
    assert _sqnr(ref, y) >= 30


def test_an_add_with_its_relu_runs_in_float_with_the_relu():
    class AddRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return torch.relu(self.fc1(x) + self.fc2(x))

    torch.manual_seed(0)
    model, data = AddRelu().eval(), _data(8, 64)
    q = _quantize(model, data[0], data)
    targets = _targets(q)
    assert _ops.add not in targets and targets[-2:] == [torch.add, torch.relu]
    assert all(n.args[-1] is torch.float32 for n in q.graph.nodes if n.target is _ops.linear)
    placed = {n.target: n.meta[_meta.PLACEMENT].runs for n in q.graph.nodes if n.target in (torch.add, torch.relu)}
    assert placed == {torch.add: Runs.FLOAT, torch.relu: Runs.FLOAT}
    x = torch.randn(32, 64)
    with torch.no_grad():
        assert _sqnr(model(x), q(x)) >= 28  # 30.8 dB: the input's 8-bit codes bound it


def test_float_results_are_the_same_on_the_int_mm_path():
    # CPUs without oneDNN's int8 ops run linear/conv through torch._int_mm: the float result there is
    # the same arithmetic (the first call of a converted model runs the portable graph's kernels)
    torch.manual_seed(0)
    model, data = Residual().eval(), _data(8, 64)
    x = torch.randn(16, 64)
    with torch.no_grad():
        onednn = _quantize(model, data[0], data)(x)
        with use_onednn(False):
            int_mm = _quantize(model, data[0], data)(x)
    torch.testing.assert_close(int_mm, onednn, rtol=1e-5, atol=1e-5)
    assert _sqnr(model(x), int_mm) >= 35


class ClassToken(nn.Module):
    """A ViT's embedding: a class token near zero concatenated with the patch tokens, a position
    embedding added, then a layer norm (float where it pays) and a classifier on the class token."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
        self.token = nn.Parameter(torch.randn(1, 1, 16) * 0.01)
        self.position = nn.Parameter(torch.randn(1, 11, 16) * 0.01)

    def forward(self, x):
        x = torch.cat([self.token.expand(x.shape[0], -1, -1), self.proj(x)], 1) + self.position
        return self.head(self.norm(x)[:, 0])


def test_a_cat_only_dequantized_runs_in_float_on_each_inputs_grid(monkeypatch):
    torch.manual_seed(0)
    model, data = ClassToken().eval(), [x * 3 for x in _data(8, 10, 16)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    predicted = placements(prepared)
    q = lucid_fx.convert(prepared)
    assert torch.cat in _targets(q) and _ops.cat not in _targets(q)
    # the add reads the position embedding itself: no quantize of it is left behind, read by nothing
    assert _targets(q).count(_ops.quantize_per_tensor) == 3  # the token, x, the norm's output
    assert placements(q) == predicted  # placements() on the prepared model foresaw the fold
    assert str(predicted["cat"]) == "float (cat runs in float: nothing reads its codes, so int8 would only add a rounding)"
    unfolded = _quantize(model, data[0], data, unfolded=True, monkeypatch=monkeypatch)
    assert _ops.cat in _targets(unfolded)
    x = torch.randn(8, 10, 16) * 3
    # the token keeps its own fine grid: measured 36.4 against -0.9 dB (on the tokens' shared grid)
    assert _sqnr(model(x), q(x)) > 30 > 10 > _sqnr(model(x), unfolded(x))


class Stacked(nn.Module):
    """Two int8 outputs stacked at the model's end: the stack's cat runs in float on views of codes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return torch.stack([torch.tanh(y), torch.sigmoid(y)], 1)


def test_a_float_cat_of_views_of_codes_saves_and_loads(tmp_path):
    # the dequantize of a view (codes.unsqueeze(1)) got a VALUE_TYPE of None, which save wrote and
    # load refused: "meta 'lucid_fx.value_type' ...: NoneType where a tuple belongs"
    torch.manual_seed(0)
    model, data = Stacked().eval(), _data(8, 16)
    q = _quantize(model, data[0], data)
    assert torch.cat in _targets(q) and _ops.cat not in _targets(q)
    views = [n for n in q.graph.nodes if op_name(n) == "dequantize_per_tensor" and n.args[0].target == "unsqueeze"]
    assert len(views) == 2 and all(_meta.VALUE_TYPE not in n.meta for n in views)
    lucid_fx.save(q, tmp_path / "m.pt")
    loaded, x = lucid_fx.load(tmp_path / "m.pt"), torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), q(x)) and _sqnr(model(x), q(x)) > 30
