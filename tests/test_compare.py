"""compare: per-node error of a quantized model against its float model."""

import math

import pytest
import torch
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q
from test_graph_model import Gate


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = Gate().eval()
    data = [torch.randn(8, 16) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    return model, prepared, lucid_fx.convert(prepared), data


def _manual_sqnr(ref, test):
    return 10 * math.log10(float((ref * ref).sum()) / float(((ref - test) ** 2).sum()))


def test_rows_are_worst_first_and_cover_every_quantized_value(models):
    model, _, q, data = models
    result = lucid_fx.compare(model, q, data)
    names = [r.node for r in result.rows]
    # -l1(x), its tanh and the + 1 are one table of l1's codes (rules/one_source.py): no values of their own
    assert set(names) == {"x", "l1", "add", "truediv", "ln", "mul", "l2", "softmax"}
    sqnrs = [r.sqnr_db for r in result.rows]
    assert sqnrs == sorted(sqnrs) and result.batches == 4
    rows = result.by_node()
    assert rows["add"].domain == "fixed" and rows["l1"].domain == "int8" and rows["add"].scale == 2 / 256  # [0, 2]
    assert rows["ln"].op == "ln" and rows["l2"].op == "linear"  # no canonical op: named by its module
    # ln runs in float (its output is quantized for the int8 mul): before, compare called it int8.
    assert (rows["ln"].domain, rows["ln"].runs, rows["l1"].runs, rows["add"].runs) == ("float", "float", "int8 kernel", "table lookup")
    # Fixed-grid values are off by at most a few steps; the output within 1 dB of the last node.
    assert all(r.max_steps is not None and r.max_steps < 4 for r in result.rows)
    assert result.output_sqnr_db == pytest.approx(rows["softmax"].sqnr_db, abs=1.0)


def test_input_row_equals_a_hand_computed_quantization_error(models):
    model, prepared, q, data = models
    observer = prepared.lucid_fx_observers[prepared.graph.find_nodes(op="placeholder")[0].meta["lucid_fx.observer"]]
    scale, zp = (float(v) for v in observer.calculate_qparams())
    x = torch.cat(data)
    fq = (torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale
    row = lucid_fx.compare(model, q, data).by_node()["x"]
    assert row.sqnr_db == pytest.approx(_manual_sqnr(x, fq), abs=1e-3)
    assert row.max_abs == pytest.approx(float((x - fq).abs().max()), rel=1e-5)
    assert row.numel == x.numel()


def test_output_sqnr_is_the_model_output_error(models):
    model, _, q, data = models
    result = lucid_fx.compare(model, q, data[:2])
    with torch.no_grad():
        ref = torch.cat([model(d) for d in data[:2]])
        test = torch.cat([q(d) for d in data[:2]])
    assert result.output_sqnr_db == pytest.approx(_manual_sqnr(ref, test), abs=1e-3)
    assert result.batches == 2


def test_reference_model_compares_like_the_int8_one(models):
    model, prepared, q, data = models
    ref = lucid_fx.convert(prepared, reference=True)
    real, simulated = lucid_fx.compare(model, q, data).by_node(), lucid_fx.compare(model, ref, data).by_node()
    assert set(real) == set(simulated)
    # Softmin runs in float on the float x in both: the reference does not fake-quantize its input.
    assert simulated["ln"].sqnr_db == real["ln"].sqnr_db and simulated["ln"].op == real["ln"].op == "ln"
    for name in real:  # the kernels compute what the simulation does, up to rounding
        assert simulated[name].sqnr_db == pytest.approx(real[name].sqnr_db, abs=1.5), name


def test_table_text(models):
    model, _, q, data = models
    text = str(lucid_fx.compare(model, q, data[0]))
    lines = text.splitlines()
    assert lines[0].split() == ["node", "op", "domain", "SQNR", "dB", "max", "|err|", "steps"]
    assert len(lines) == 1 + 8 + 1 and lines[-1].startswith("model output: ") and "over 1 batch(es)" in lines[-1]


def test_a_float_model_compared_with_itself_is_exact():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    traced = torch.fx.symbolic_trace(model)
    result = lucid_fx.compare(model, traced, torch.randn(3, 4))
    # A plain traced graph carries no convert metadata: nothing to match, and an exact output.
    assert result.output_sqnr_db == math.inf and result.batches == 1


def test_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="quantized_model must be an nn.Module, got str"):
        lucid_fx.compare(model, "q.pt", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="holds no torch.fx GraphModule"):
        lucid_fx.compare(model, nn.Linear(2, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="at least one batch"):
        lucid_fx.compare(model, torch.fx.symbolic_trace(model), [])


# -- torchvision-style structures (torchvision itself is not a dependency) -------------------
def _randomize_bn(model):
    # Batch norms that do something: a fold of an identity BN would hide a wrong comparison.
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) * 2 - 1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 2.5 + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) * 1.5 + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) * 2 - 1)
    return model.eval()


class Downsample(nn.Module):
    """ResNet BasicBlock with a downsample branch: conv -> BN with no activation after it."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(nn.Conv2d(4, 8, 1, stride=2, bias=False), nn.BatchNorm2d(8))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.downsample(x)  # in place, as torchvision writes it
        return self.relu(out)


class Depthwise(nn.Module):
    """MobileNet: depthwise conv -> BN with no activation, then pointwise conv -> BN -> ReLU."""

    def __init__(self):
        super().__init__()
        self.dw, self.dw_bn = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pw, self.pw_bn, self.act = nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()

    def forward(self, x):
        return self.act(self.pw_bn(self.pw(self.dw_bn(self.dw(x)))))


class DenseLayer(nn.Module):
    """DenseNet: BN -> ReLU(inplace=True) -> conv; the BN's output is overwritten by the ReLU."""

    def __init__(self):
        super().__init__()
        self.norm, self.relu, self.conv = nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x):
        return torch.cat([x, self.conv(self.relu(self.norm(x)))], 1)


def _sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    return _manual_sqnr(ref, test)


def _float_outputs(model, path, batches):
    """The float model's output of the module at ``path``, copied in a forward hook (before any
    in-place op that follows can change it)."""
    seen = []
    handle = model.get_submodule(path).register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        for b in batches:
            model(b)
    handle.remove()
    return torch.cat(seen)


def _int8_values(qmodel, pick, batches):
    """Dequantized codes of the converted node ``pick(node)`` selects: its codes and its grid read
    from the kernel call's own arguments (no lucid_fx metadata)."""
    (node,) = [n for n in qmodel.graph.nodes if pick(n)]
    scale, zero_point = _grid_of(node)
    seen = []

    class Spy(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n is node:
                seen.append((out.float() - zero_point) * scale)
            return out

    with torch.no_grad():
        for b in batches:
            Spy(qmodel).run(b)
    return torch.cat(seen)


def _grid_of(node):
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in ("conv2d", "linear"):  # (x, x_scale, x_zp, w, w_scale, bias, [geometry,] out_scale, out_zp, post_op, ...)
        return float(node.args[-4]), int(node.args[-3])
    if name == "quantize_per_tensor":  # (x, scale, zero_point, qmin, qmax, dtype)
        return float(node.args[1]), int(node.args[2])
    raise AssertionError(f"no grid for {node.format_node()}")


def _weight_user(weight_attr):
    return lambda n: n.op == "call_function" and any(getattr(a, "target", None) == weight_attr for a in n.args)


@pytest.mark.parametrize(
    "make, shape, bn_path, conv_path, weight",
    [
        (Downsample, (2, 4, 8, 8), "downsample.1", "downsample.0", "_lucid_downsample_0_qweight"),
        (Depthwise, (2, 8, 8, 8), "dw_bn", "dw", "_lucid_dw_qweight"),
    ],
    ids=["resnet_downsample", "mobilenet_depthwise"],
)
def test_a_folded_conv_bn_with_no_activation_is_compared_with_the_bn_value(make, shape, bn_path, conv_path, weight):
    # Before: the folded conv kept the conv's name and was compared with the float value before
    # the BN: the rows read -2.2 dB (downsample_0) and -4.9 dB (dw), though the int8 values are right.
    torch.manual_seed(0)
    model = _randomize_bn(make())
    batches = [torch.randn(*shape) for _ in range(4)]
    q = lucid_fx.quantize(model, (batches[0],), batches)
    result = lucid_fx.compare(model, q, batches)
    rows = result.by_node()
    bn_node, conv_node = bn_path.replace(".", "_"), conv_path.replace(".", "_")
    assert bn_node in rows and conv_node not in rows  # the conv's own (pre-BN) value exists nowhere in int8
    int8 = _int8_values(q, _weight_user(weight), batches)
    truth = _sqnr(_float_outputs(model, bn_path, batches), int8)
    assert truth > 30 and rows[bn_node].sqnr_db == pytest.approx(truth, abs=0.5)
    assert _sqnr(_float_outputs(model, conv_path, batches), int8) < 10  # what the old pairing measured
    assert rows[bn_node].runs == "int8 kernel" and rows[bn_node].domain == "int8"
    assert result.rows[0].sqnr_db > 30 and result.output_sqnr_db > 30  # the worst node is a real one


def test_a_value_that_an_in_place_op_changes_later_is_recorded_as_it_was():
    # Before: compare kept a reference to the BN's float output, which ReLU(inplace=True) then
    # overwrote, so the BN's int8 value (negatives included) read 6.8 dB against relu(bn(x)).
    # The BN is kept float here (a standalone BN runs in int8 by default, as a table per channel):
    # its float output is what ReLU(inplace=True) overwrites.
    torch.manual_seed(0)
    model = _randomize_bn(DenseLayer())
    batches = [torch.randn(2, 4, 8, 8) for _ in range(4)]
    keep_norm_float = Q.QConfigMapping().set_global(Q.default_qconfig).set_module_name("norm", None)
    q = lucid_fx.quantize(model, (batches[0],), batches, keep_norm_float)
    result = lucid_fx.compare(model, q, batches)
    row = result.by_node()["norm"]
    quantizes_norm = lambda n: "quantize_per_tensor" in str(n.target) and getattr(n.args[0], "target", None) == "norm"  # noqa: E731
    int8 = _int8_values(q, quantizes_norm, batches)
    truth = _sqnr(_float_outputs(model, "norm", batches), int8)
    assert truth > 30 and row.sqnr_db == pytest.approx(truth, abs=0.5)
    assert _sqnr(torch.relu(_float_outputs(model, "norm", batches)), int8) < 20  # what the old record held
    # The BN runs in float (kept so); its output is quantized for the conv.
    assert (row.runs, row.domain) == ("float", "float")
    assert min(r.sqnr_db for r in result.rows) == pytest.approx(result.rows[0].sqnr_db) and result.rows[0].sqnr_db > 30


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, gate=True):
        h = self.fc(x)
        if gate:  # control flow on an argument: traceable only with concrete_args
            h = torch.sigmoid(h) * h
        return self.out(h)


def test_the_float_model_is_traced_with_prepares_concrete_args():
    # Before: compare traced the float model without concrete_args and raised
    # "compare: cannot trace the float module at '<root>' the way prepare did".
    torch.manual_seed(0)
    model = Gated().eval()
    batches = [torch.randn(16, 8) for _ in range(4)]
    q = lucid_fx.quantize(model, (batches[0],), batches, concrete_args={"gate": True})
    result = lucid_fx.compare(model, q, batches)
    rows = result.by_node()
    assert set(rows) == {"x", "fc", "mul", "out"}  # sigmoid(h) * h: one table of fc's codes
    truth = _sqnr(_float_outputs(model, "fc", batches), _int8_values(q, _weight_user("_lucid_fc_qweight"), batches))
    assert truth > 30 and rows["fc"].sqnr_db == pytest.approx(truth, abs=0.5)
    assert result.rows[0].sqnr_db > 30 and result.output_sqnr_db > 30


class Squash(nn.Module):
    def forward(self, x):
        return x / (1 + x.abs())


class UsesSquash(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.squash, self.fc2 = nn.Linear(8, 8), Squash(), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.squash(self.fc1(x))) + 1


def _lower_squash(ctx, members, resolve):
    from lucid_fx.kernels import make_lut

    node = members[0]
    x = ctx.quant_of(resolve(node.args[0]))
    scale, zero_point, qdtype = ctx.qparams_of(node)
    table = make_lut(Squash(), x.scale, x.zero_point, (x.qdtype.quant_min, x.qdtype.quant_max), scale, zero_point, (qdtype.quant_min, qdtype.quant_max))
    return ctx.output_qvalue(node, ctx.call(torch.ops.lucid_fx.lut, x.node, ctx.constant(f"{node.name}_table", table)))


def test_the_float_model_keeps_prepares_leaf_modules_after_the_registry_scope_ends():
    # A leaf module that convert lowered leaves no call_module behind. Before: compare, outside
    # the scope, traced through it, so `squash` had no row and its inner `add` took the name of
    # the model's own `+ 1`.
    torch.manual_seed(0)
    model = UsesSquash().eval()
    batches = [torch.randn(16, 8) for _ in range(4)]
    with lucid_fx.registry_scope():
        lucid_fx.register_bounded_op(Squash, (-1.0, 1.0))
        lucid_fx.register_lowering("Squash", _lower_squash)  # a module class's op is named after it
        q = lucid_fx.quantize(model, (batches[0],), batches)
    assert not any(n.op == "call_module" for n in q.graph.nodes)
    rows = lucid_fx.compare(model, q, batches).by_node()
    assert set(rows) == {"x", "fc1", "squash", "fc2", "add"} and rows["squash"].runs == "table lookup"
    with torch.no_grad():  # `+ 1` is the output: its int8 value is the model's output
        ref, test = torch.cat([model(b) for b in batches]), torch.cat([q(b) for b in batches])
    assert rows["add"].sqnr_db == pytest.approx(_sqnr(ref, test), abs=0.5) and rows["add"].sqnr_db > 30


def test_keyword_batches_measure_as_positional_ones():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    data = [torch.randn(16, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data, progress=False)
    by_position = lucid_fx.compare(model, qmodel, data)
    by_keyword = lucid_fx.compare(model, qmodel, [{"input": x} for x in data])
    assert by_keyword.output_sqnr_db == by_position.output_sqnr_db and by_keyword.batches == 4
    assert [(r.node, r.sqnr_db) for r in by_keyword.rows] == [(r.node, r.sqnr_db) for r in by_position.rows]


def test_a_float_model_of_another_structure_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8)
    qmodel = lucid_fx.quantize(model, (x,), [x], progress=False)

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.second(torch.relu(self.first(x)))

    # Nothing matched: compare gave an empty table and the other model's output SQNR.
    with pytest.raises(ValueError, match=r"^compare: float_model is not the model quantized_model was made from: none "
                                         r"of the \d+ values quantized_model computes has a node of its name"):
        lucid_fx.compare(Other().eval(), qmodel, [x])
