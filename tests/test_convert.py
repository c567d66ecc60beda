"""convert end to end: int8 kernels in the graph, numbers close to the reference and to fp32."""

import pytest
import torch
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx.placement import Runs, placements
from models import encoder_block, gated_mlp, mlp, resnet_like
from test_registry import my_gate  # a user function (module-level, as users write them)


def _calibrated(model, example, make_batch, batches=4, mapping=None):
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(example,))
    lucid_fx.calibrate(prepared, [make_batch(s) for s in range(batches)], progress=False)
    return prepared


def _kernels(qmodel):
    return sorted({n.target.__name__.split(".")[0] for n in qmodel.graph.nodes if n.op == "call_function" and "lucid_fx" in str(n.target)})


_ENCODER = lambda: encoder_block(2, 16, 64)  # noqa: E731


@pytest.mark.parametrize(
    "factory, floor_db, expected, ref_floor_db",
    [
        # the last linear gives its float result (no dequantize: passes/fold_dequantize.py)
        (lambda: mlp(8, 256), 30, ["linear", "quantize_per_tensor"], 40),
        # tanh and sigmoid are their linears' post-ops, their product taken in float and rounded once
        # (rules/lowering_gate.py): no lucid_fx.mul
        (lambda: gated_mlp(8, 256), 28, ["linear", "quantize_per_tensor"], 40),
        (lambda: resnet_like(1, 64, width=16), 20, ["adaptive_avg_pool2d", "conv2d", "conv2d_add", "linear", "max_pool2d", "quantize_per_tensor"], 40),
        # the layer norms run in float where it pays (rules/observers.py), and so do the residual
        # adds: their results feed only float ops, and the simulation keeps them float too
        # (insert_qdq.values_with_codes). gelu is its linear's post-op; softmax(s) @ v one kernel
        # (kernels/softmax_matmul.py)
        (_ENCODER, 40, ["linear", "matmul", "quantize_per_tensor", "softmax_matmul"], 40),
    ],
    ids=["mlp", "gated_mlp", "resnet_like", "encoder"],
)
def test_models_lower_to_int8_and_stay_accurate(factory, floor_db, expected, ref_floor_db, sqnr_db):
    model, example, make_batch = factory()
    prepared = _calibrated(model, example, make_batch)
    qmodel = lucid_fx.convert(prepared)
    reference = lucid_fx.convert(prepared, reference=True)
    assert _kernels(qmodel) == expected
    x = make_batch(100)
    with torch.no_grad():
        fp32, int8, ref = model(x), qmodel(x), reference(x)
    # the model's result is the last kernel's float result: the simulation does not round it either
    db_fp32, db_ref = sqnr_db(fp32, int8), sqnr_db(ref, int8)
    print(f"SQNR vs fp32 {db_fp32:.1f} dB, vs reference {db_ref:.1f} dB")
    assert db_fp32 > floor_db
    assert db_ref > ref_floor_db  # the kernels compute what the simulation says (rounding inside kernels aside)
    assert abs(db_fp32 - sqnr_db(fp32, ref)) < 0.5  # they round the same values
    assert "torch.ops.lucid_fx" in qmodel.code


def test_convert_copies_and_reports_float_ops():
    model, example, make_batch = encoder_block(2, 16, 64)
    prepared = _calibrated(model, example, make_batch)
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    qmodel = lucid_fx.convert(prepared)
    assert all(torch.equal(v, before[k]) for k, v in prepared.state_dict().items())
    report = qmodel.lucid_fx_convert_report
    folded = "add runs in float: nothing reads its codes, so int8 would only add a rounding"
    pays = "layer_norm runs in float where it pays: normalising int8 input magnifies the input's rounding"
    assert set(report.float_ops) == {"norm1", "norm2", "add", "add_1"} and report.float_ops["add_1"] == folded
    assert report.float_ops["norm1"].startswith(f"input of quantized qkv ({pays}")
    assert report.lowered["softmax"].startswith("fused into matmul_1's softmax_matmul: the probabilities on each row's own grid")
    assert report.lowered["matmul_1"] == "matmul"
    with lucid_fx.registry_scope():  # a layer norm registered float is reported with why
        lucid_fx.register_float_op("layer_norm")
        report = lucid_fx.convert(_calibrated(model, example, make_batch)).lucid_fx_convert_report
    assert report.float_ops == {"norm1": "input of quantized qkv (registered to stay float)", "norm2": "input of quantized fc1 (registered to stay float)",
                                "add": folded, "add_1": folded}  # the residual adds feed only float ops
    # a QConfig that names layer_norm forces its int8 kernel; the last residual add feeds only the output
    forced = Q.get_default_qconfig_mapping().set_object_type("layer_norm", Q.default_qconfig)
    report = lucid_fx.convert(_calibrated(model, example, make_batch, mapping=forced)).lucid_fx_convert_report
    assert set(report.float_ops) == {"add_1"} and report.lowered["norm1"] == report.lowered["norm2"] == "layer_norm"


def test_fixed_qparams_ops_run_as_tables_with_exact_grid():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return (torch.tanh(-self.fc(x)) + 1) / 2  # a tanh straight after fc would be fc's post-op

    model = Head().eval()
    prepared = _calibrated(model, torch.randn(3, 4), lambda s: torch.randn(3, 4, generator=torch.Generator().manual_seed(s)), 20)
    qmodel = lucid_fx.convert(prepared)
    reference = lucid_fx.convert(prepared, reference=True)
    assert _kernels(qmodel).count("lut") == 1
    # -x, tanh and "+ 1" are one table of fc's codes (rules/one_source.py); "/ 2" keeps the codes and halves
    # the scale, which lands exactly on the fixed [0, 1] grid its FixedQParamsObserver promises.
    assert [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"].count("lut") == 1
    (halved,) = [n for n in qmodel.graph.nodes if n.target == "view_as"]
    assert halved.meta["lucid_fx.source"] == "truediv" and halved.meta["lucid_fx.qparams"][:2] == (1 / 256, 0)
    x = torch.randn(50, 4)
    out = qmodel(x)
    # outputs live on the [0, 1] grid with scale 1/256, code for code what the simulation gives
    assert torch.equal(out * 256, torch.round(out * 256)) and out.min() >= 0 and out.max() <= 1
    assert (out - reference(x)).abs().max() <= 1 / 256 + 1e-6
    assert (out - model(x)).abs().mean() < 0.01


def test_convert_before_calibration_names_the_nodes():
    model, example, _ = mlp(2, 16)
    prepared = lucid_fx.prepare(model, example_inputs=(example,))
    with pytest.raises(ValueError, match=r"observers of node\(s\) x, layers_1, layers_3, layers_5 saw no data; run lucid_fx.calibrate"):
        lucid_fx.convert(prepared)
    with pytest.raises(ValueError, match="expects a model returned by lucid_fx.prepare"):
        lucid_fx.convert(model)


def test_quantize_one_call_and_convert_fx_name(sqnr_db):
    model, example, make_batch = mlp(4, 64)
    qmodel = lucid_fx.quantize(model, (example,), [make_batch(s) for s in range(3)])
    assert "linear" in _kernels(qmodel)
    assert sqnr_db(model(example), qmodel(example)) > 30
    prepared = _calibrated(model, example, make_batch)
    assert "linear" in _kernels(Q.convert_fx(prepared))


def test_custom_lowering_overrides_builtin_per_backend():
    model, example, make_batch = mlp(2, 16)
    prepared = _calibrated(model, example, make_batch)
    reg = lucid_fx.current_registry().copy()
    seen = []

    def keep_linear_float(ctx, members, resolve):
        seen.append(members[0].name)
        return None  # decline: the group runs in float

    lucid_fx.register_lowering(("linear", "relu"), keep_linear_float, backend="cpu", registry=reg)
    qmodel = lucid_fx.convert(prepared, registry=reg)
    assert seen == ["layers_0", "layers_2", "layers_4"]
    assert set(qmodel.lucid_fx_convert_report.float_ops) == {"layers_1", "layers_3", "layers_5"}
    cuda_only = lucid_fx.current_registry().copy()
    lucid_fx.register_lowering(("linear", "relu"), keep_linear_float, backend="cuda", registry=cuda_only)
    assert "linear" in _kernels(lucid_fx.convert(prepared, registry=cuda_only))  # cpu ignores the cuda rule
    with pytest.raises(ValueError, match="backend must be one of 'generic', 'cpu', 'cuda', got 'tpu'"):
        lucid_fx.register_lowering("linear", keep_linear_float, backend="tpu", registry=reg)


class _GateAfterLinear(nn.Module):
    """A user's bounded function (test_registry.my_gate) after a linear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return my_gate(self.fc(x))


def test_custom_bounded_op_with_custom_lowering():
    with lucid_fx.registry_scope() as reg:
        lucid_fx.register_bounded_op(my_gate, (0.0, 1.0))
        from lucid_fx.rules.lowering import lower_elementwise

        lucid_fx.register_lowering("my_gate", lower_elementwise)  # a unary op: a 256-entry table
        model = _GateAfterLinear().eval()
        prepared = _calibrated(model, torch.randn(2, 4), lambda s: torch.randn(2, 4, generator=torch.Generator().manual_seed(s)), 20)
        qmodel = lucid_fx.convert(prepared)
        reference = lucid_fx.convert(prepared, reference=True)
    assert qmodel.lucid_fx_convert_report.lowered["my_gate"] == "my_gate"
    assert "lut" in _kernels(qmodel) and "_lucid_my_gate_lut" in dict(qmodel.named_buffers())
    x = torch.randn(20, 4)
    assert (qmodel(x) - reference(x)).abs().max() <= 1 / 256 + 1e-6  # [0, 1] grid, scale 1/256
    assert (qmodel(x) - model(x)).abs().mean() < 0.01
    assert ("my_gate",) in reg.lowerings["generic"] and ("my_gate",) not in lucid_fx.current_registry().lowerings["generic"]


class _Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc1(x) if x.sum() > 0 else self.fc2(x)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = nn.Linear(8, 8), _Branchy(), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_untraceable_parts_convert_recursively():
    model = _Outer().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(3, 8),))
    # both branches of the data-dependent block must see data, or convert refuses
    batches = [torch.randn(3, 8) + shift for shift in (2.0, -2.0, 0.0)]
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    assert "linear" in _kernels(qmodel.block.fc1) and "linear" in _kernels(qmodel)
    report = qmodel.lucid_fx_convert_report  # one report, the nested graphs' nodes qualified by their path
    assert report.lowered == {"stem": "linear", "head": "linear", "block.fc1.linear": "linear", "block.fc2.linear": "linear"}
    assert list(report.float_modules) == ["block"] and report.float_modules["block"].startswith("_Branchy at ")
    # the example input took one branch: stem and fc1 or fc2 ran, 2 * (3 * 8) * 8 FLOPs each, and head 2 * (3 * 4) * 8
    assert (report.total_flops, report.int8_flops, report.module_flops) == (2 * 384 + 192, 2 * 384 + 192, {"block": 0})
    x = torch.randn(3, 8)
    assert (qmodel(x) - model(x)).abs().max() < 0.05


def test_shape_reads_use_the_codes_without_dequantizing(sqnr_db):
    class Reshaper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            b, t, d = h.shape
            return self.b(h.reshape(b * t, d)).reshape(b, t, h.size(-1))

    torch.manual_seed(0)
    model = Reshaper().eval()
    data = [torch.randn(2, 3, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data, progress=False)
    targets = [str(n.target) for n in qmodel.graph.nodes if n.op == "call_function"]
    assert targets.count("lucid_fx.dequantize_per_tensor") == 1  # only the output's
    assert "size" in [n.target for n in qmodel.graph.nodes if n.op == "call_method"]
    with torch.no_grad():
        assert sqnr_db(model(data[1]), qmodel(data[1])) > 30


def test_convert_of_a_model_prepare_could_not_trace_says_why():
    # Found by tests/test_fuzz.py: a model whose forward cannot be traced and that has no
    # traceable children was told to "call prepare first" although it had been prepared.
    class Untraceable(nn.Module):
        def forward(self, x):
            return torch.Tensor.softmax(x, 1)  # a method descriptor called on a Proxy

    # capture="fx": torch.export would capture it (capture="auto")
    prepared = lucid_fx.prepare(Untraceable().eval(), example_inputs=(torch.randn(2, 3),), capture="fx")
    with pytest.raises(ValueError, match=r"(?s)nothing was quantized: prepare could not trace any part of the model\n.*<root> \(Untraceable\)"):
        lucid_fx.convert(prepared)
    # calibrate and the one-call quantize say the same, not "call prepare first"
    with pytest.raises(ValueError, match=r"calibrate: nothing was quantized: prepare could not trace"):
        lucid_fx.calibrate(prepared, [torch.randn(2, 3)], progress=False)
    with pytest.raises(ValueError, match=r"nothing was quantized: prepare could not trace"):
        lucid_fx.quantize(Untraceable().eval(), (torch.randn(2, 3),), [torch.randn(2, 3)], progress=False, capture="fx")


class _ThreeLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.sigmoid(self.b(self.a(x))))


@pytest.mark.parametrize("keep", ["module b", "torch.sigmoid", "registered sigmoid"])
def test_an_op_the_user_keeps_float_runs_float_even_when_an_int8_op_reads_it(keep):
    # Its output is observed (the next op is int8 and needs codes), but the op itself must not be lowered.
    torch.manual_seed(0)
    model, x = _ThreeLinears().eval(), torch.randn(4, 8)
    mapping, registry = Q.get_default_qconfig_mapping(), None
    if keep == "module b":
        mapping.set_module_name("b", None)
    elif keep == "torch.sigmoid":
        mapping.set_object_type(torch.sigmoid, None)
    else:
        registry = lucid_fx.current_registry().copy()
        lucid_fx.register_float_op(torch.sigmoid, registry=registry)
    prepared = lucid_fx.prepare(model, mapping, (x,), registry=registry) if registry else lucid_fx.prepare(model, mapping, (x,))
    prepared(x)
    converted = lucid_fx.convert(prepared, registry=registry) if registry else lucid_fx.convert(prepared)
    calls = [str(n.target) for n in converted.graph.nodes if n.op in ("call_function", "call_module")]
    if keep == "module b":
        assert "b" in calls and calls.count("lucid_fx.linear") == 2
    else:
        assert "lucid_fx.lut" not in calls and any("sigmoid" in c for c in calls) and calls.count("lucid_fx.linear") == 3
    kept = "b" if keep == "module b" else "sigmoid"
    placement = placements(converted)[kept]
    assert placement.runs is Runs.FLOAT, placement
    assert "QConfig is None" in placement.why or "registered to stay float" in placement.why
    assert placements(prepared, registry=registry)[kept].runs is Runs.FLOAT  # explain predicts it before convert


def test_quantize_takes_prepare_order_with_a_warning_that_names_its_own():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x, mapping = torch.randn(2, 4), Q.get_default_qconfig_mapping()
    mapping.set_object_type(nn.Linear, None)  # a visible choice: the linear stays float
    expected = str(lucid_fx.quantize(model, (x,), [x], mapping, progress=False).lucid_fx_convert_report)
    assert expected.startswith("backend cpu: 0 int8 kernels, 1 op in float")
    with pytest.warns(UserWarning, match=r"quantize: took the arguments as prepare's torch.ao order, \(model, qconfig_mapping, example_inputs, calibration_data\); quantize's order is \(model, example_inputs, calibration_data, qconfig_mapping=None\)"):
        qmodel = lucid_fx.quantize(model, mapping, (x,), [x], progress=False)
    assert str(qmodel.lucid_fx_convert_report) == expected


class AudioBlock(nn.Module):
    """A conformer-style conv module: depthwise Conv1d -> BN -> SiLU, pointwise Conv1d -> Hardswish."""

    def __init__(self):
        super().__init__()
        self.dw, self.bn = nn.Conv1d(16, 16, 7, padding=3, groups=16), nn.BatchNorm1d(16)
        self.pw, self.act = nn.Conv1d(16, 16, 1), nn.Hardswish()

    def forward(self, x):
        return self.act(self.pw(torch.nn.functional.silu(self.bn(self.dw(x)))))


def test_conv1d_with_an_activation_onednn_does_not_fuse_converts_and_runs(sqnr_db):
    # Before: convert raised "Unsupported post op swish for quantized pointwise conv1d" (oneDNN's conv1d fuses
    # only relu); the activation now follows the convolution's float result, as the reference computes it.
    torch.manual_seed(0)
    model = AudioBlock().eval()
    prepared = _calibrated(model, torch.randn(2, 16, 40), lambda s: torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(s)))
    qmodel, reference = lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)
    assert qmodel.lucid_fx_convert_report.lowered == {"silu": "conv1d+silu", "act": "conv1d+hardswish"}  # by group end
    x = torch.randn(4, 16, 40, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out, ref = qmodel(x), reference(x)
        scale = prepared.lucid_fx_observers["act"].calculate_qparams()[0].item()
        assert (out - ref).abs().max().item() <= 2 * scale and sqnr_db(model(x), out) > 30


def test_convert_and_explain_use_the_registry_the_model_was_prepared_with():
    from lucid_fx.rules.lowering import lower_elementwise

    reg = lucid_fx.Registry()
    lucid_fx.register_bounded_op(my_gate, (0.0, 1.0), registry=reg)
    lucid_fx.register_lowering("my_gate", lower_elementwise, registry=reg)
    model = _GateAfterLinear().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),), registry=reg)
    lucid_fx.calibrate(prepared, [torch.randn(2, 4) for _ in range(8)], progress=False)
    # Neither is given reg: both used the current registry's rules, and my_gate ran float without a word.
    assert lucid_fx.explain(prepared).by_node()["my_gate"]["runs"] == "table lookup"
    qmodel = lucid_fx.convert(prepared)
    assert qmodel.lucid_fx_convert_report.lowered["my_gate"] == "my_gate" and "lut" in _kernels(qmodel)
    assert ("my_gate",) not in lucid_fx.current_registry().lowerings["generic"]
    other = lucid_fx.Registry()  # a registry given wins
    assert "lut" not in _kernels(lucid_fx.convert(prepared, registry=other))
