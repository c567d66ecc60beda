"""save / load: round trips to identical outputs, mid-calibration resumes (crafted files: test_load_checks.py)."""

import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx import _meta
from lucid_fx._codec import NotSerializable
from lucid_fx.save_load import FORMAT_VERSION


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 6)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


class _Bounded(nn.Module):  # fixed-qparams ops: sigmoid, softmax, tanh
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.sigmoid(self.fc1(x)) * torch.tanh(x)
        return F.softmax(self.fc2(h), dim=-1)


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


MODELS = {"mlp": (_mlp, (8,)), "cnn": (_CNN, (3, 8, 8)), "bounded": (_Bounded, (8,))}
# Small histograms: the 2048-bin clipping search costs seconds per observer on a busy machine.
_HISTOGRAM = Q.QConfig(Q.HistogramObserver.with_args(bins=128), Q.default_qconfig.weight)
QCONFIGS = {
    "histogram": _HISTOGRAM,
    "minmax": Q.minmax_qconfig,
    "moving_average": Q.QConfig(Q.MovingAverageMinMaxObserver.with_args(averaging_constant=0.3), Q.default_qconfig.weight),
}


def _batches(shape, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(4, *shape, generator=gen) * (1 + i % 3) for i in range(n)]


def _prepared(kind, qconfig="histogram"):
    factory, shape = MODELS[kind]
    torch.manual_seed(0)
    model = factory().eval()
    mapping = Q.QConfigMapping().set_global(QCONFIGS[qconfig])
    return lucid_fx.prepare(model, mapping, example_inputs=tuple(_batches(shape, 1, seed=9))), shape


def _round_trip(model, **kwargs):
    buffer = io.BytesIO()
    lucid_fx.save(model, buffer, **{k: v for k, v in kwargs.items() if k == "allow"})
    buffer.seek(0)
    return lucid_fx.load(buffer, **kwargs)


def _graph_of(gm):
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("kind", MODELS)
def test_prepared_and_converted_round_trip_to_identical_outputs(kind):
    prepared, shape = _prepared(kind)
    lucid_fx.calibrate(prepared, _batches(shape, 4), progress=False)
    loaded = _round_trip(prepared)
    assert _graph_of(loaded) == _graph_of(prepared)
    _assert_same_state(loaded, prepared)
    x = _batches(shape, 1, seed=5)[0]
    assert torch.equal(loaded(x), prepared(x))
    assert lucid_fx.explain(loaded).rows == lucid_fx.explain(prepared).rows

    converted = lucid_fx.convert(prepared)
    assert torch.equal(lucid_fx.convert(loaded)(x), converted(x))  # convert reads the saved node.meta
    loaded_q = _round_trip(converted)
    assert _graph_of(loaded_q) == _graph_of(converted)
    assert any(isinstance(n.target, torch._ops.OpOverloadPacket) and n.target._qualified_op_name.startswith("lucid_fx::")
               for n in loaded_q.graph.nodes)
    assert torch.equal(loaded_q(x), converted(x))
    assert str(loaded_q.lucid_fx_convert_report) == str(converted.lucid_fx_convert_report)


@pytest.mark.parametrize("qconfig", QCONFIGS)
@pytest.mark.parametrize("kind", ["cnn", "bounded"])
def test_save_mid_calibration_then_continue_equals_uninterrupted(kind, qconfig, tmp_path):
    prepared, shape = _prepared(kind, qconfig)
    batches = _batches(shape, 6)
    uninterrupted, _ = _prepared(kind, qconfig)
    lucid_fx.calibrate(uninterrupted, batches, progress=False)

    lucid_fx.calibrate(prepared, batches[:3], progress=False)
    lucid_fx.save(prepared, tmp_path / "half.pt")
    resumed = lucid_fx.load(tmp_path / "half.pt")
    lucid_fx.calibrate(resumed, batches[3:], progress=False)

    _assert_same_state(resumed, uninterrupted)
    x = batches[0]
    assert torch.equal(lucid_fx.convert(resumed)(x), lucid_fx.convert(uninterrupted)(x))


def test_a_model_prepared_from_a_torch_export_saves_mid_calibration(tmp_path):
    """ep.module() carries export's hooks and input-check attributes; prepare drops them with the
    checks they serve (it checks inputs itself), so the prepared model saves: before, save refused it
    ("hooks are code"), every transformers model among them, while the converted one saved."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(2, 8, generator=g) for _ in range(4)]
    exported = torch.export.export(model, (batches[0],), strict=False)
    prepared, uninterrupted = (lucid_fx.prepare(exported, example_inputs=(batches[0],)) for _ in range(2))
    lucid_fx.calibrate(uninterrupted, batches, progress=False)
    lucid_fx.calibrate(prepared, batches[:2], progress=False)
    lucid_fx.save(prepared, tmp_path / "half.pt")
    resumed = lucid_fx.load(tmp_path / "half.pt")
    lucid_fx.calibrate(resumed, batches[2:], progress=False)
    assert torch.equal(lucid_fx.convert(resumed)(batches[1]), lucid_fx.convert(uninterrupted)(batches[1]))


def test_nested_prepared_model_round_trips_with_its_class_allowed():
    class Gate(nn.Module):  # untraceable (data-dependent branch): prepare quantizes its children
        def __init__(self):
            super().__init__()
            self.body = _mlp()

        def forward(self, x):
            return self.body(x) if x.sum() > 0 else -self.body(x)

    torch.manual_seed(0)
    prepared = lucid_fx.prepare(Gate().eval(), example_inputs=(torch.randn(2, 8),))
    assert isinstance(prepared.body, fx.GraphModule)
    lucid_fx.calibrate(prepared, _batches((8,), 3), progress=False)
    with pytest.raises(NotSerializable, match=r"the root module \(Gate\): class .*Gate is not on the allowlist.*allow=\[cls\]"):
        _round_trip(prepared)
    loaded = _round_trip(prepared, allow=[Gate])
    x = torch.ones(2, 8)
    assert type(loaded) is Gate and torch.equal(loaded(x), prepared(x)) and torch.equal(loaded(-x), prepared(-x))
    converted = lucid_fx.convert(prepared)
    assert torch.equal(_round_trip(converted, allow=[Gate])(x), converted(x))


def test_map_location_cpu(tmp_path):
    prepared, shape = _prepared("mlp")
    lucid_fx.calibrate(prepared, _batches(shape, 2), progress=False)
    lucid_fx.save(lucid_fx.convert(prepared), tmp_path / "q.pt")
    for where in ("cpu", torch.device("cpu"), {"cpu": "cpu"}):
        loaded = lucid_fx.load(tmp_path / "q.pt", map_location=where)
        assert {t.device.type for t in loaded.state_dict().values()} == {"cpu"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_map_location_cuda_resumes_calibration_on_the_gpu(tmp_path):
    prepared, shape = _prepared("cnn", "minmax")
    batches = _batches(shape, 4)
    lucid_fx.calibrate(prepared, batches[:2], progress=False)
    lucid_fx.save(prepared, tmp_path / "p.pt")
    on_gpu = lucid_fx.load(tmp_path / "p.pt", map_location="cuda")
    assert {t.device.type for t in on_gpu.state_dict().values()} == {"cuda"}
    lucid_fx.calibrate(on_gpu, [b.cuda() for b in batches[2:]], progress=False)
    lucid_fx.calibrate(prepared, batches[2:], progress=False)
    for (key, a), b in zip(prepared.state_dict().items(), on_gpu.state_dict().values()):
        if key.endswith(("min_val", "max_val")):
            assert torch.equal(a, b.cpu()), key
    qmodel = lucid_fx.convert(on_gpu, backend="cuda")
    x = batches[0].cuda()
    scale = prepared.lucid_fx_observers.fc.calculate_qparams()[0]
    assert (qmodel(x).cpu() - lucid_fx.convert(prepared)(batches[0])).abs().max() <= 2 * scale


def test_file_is_plain_data_for_weights_only_loading(tmp_path):
    prepared, shape = _prepared("cnn")
    lucid_fx.calibrate(prepared, _batches(shape, 2), progress=False)
    lucid_fx.save(lucid_fx.convert(prepared), tmp_path / "q.pt")
    raw = torch.load(tmp_path / "q.pt", weights_only=True)
    assert (raw["format"], raw["version"]) == ("lucid_fx.save", FORMAT_VERSION)
    targets = [n["target"]["v"] for n in raw["model"]["graph"]["nodes"] if n["op"] == "call_function"]
    assert "torch.ops.lucid_fx.conv2d" in targets and "torch.ops.lucid_fx.linear" in targets


def test_missing_path_and_foreign_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="lucid_fx.load: .*nothing.pt does not exist"):
        lucid_fx.load(tmp_path / "nothing.pt")
    torch.save({"weight": torch.ones(2)}, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"state.pt was not written by lucid_fx.save \(expected a 'lucid_fx.save' file, format version 1\)"):
        lucid_fx.load(tmp_path / "state.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="text.pt is not a 'lucid_fx.save' file, format version 1"):
        lucid_fx.load(tmp_path / "text.pt")
    prepared, _ = _prepared("mlp")
    lucid_fx.save(prepared, tmp_path / "ok.pt")
    raw = torch.load(tmp_path / "ok.pt", weights_only=True)
    torch.save({**raw, "version": 99}, tmp_path / "v99.pt")
    with pytest.raises(ValueError, match="has format version 99; this lucid_fx reads version 1"):
        lucid_fx.load(tmp_path / "v99.pt")


_CORRUPT = ("it looks truncated or corrupted (or is not a torch.save file at all): write it again with lucid_fx.save, "
            "or copy it again if it came from elsewhere; torch.load(weights_only=True) refused it: ")


def test_a_truncated_or_foreign_file_is_called_so_with_torchs_words_last(tmp_path):
    # Before: "... refused it: [Errno 22] Invalid argument" or "... refused it: 101", and no word of corruption.
    prepared, _ = _prepared("mlp")
    lucid_fx.save(prepared, tmp_path / "ok.pt")
    whole = (tmp_path / "ok.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "text.pt").write_text("hello")
    expected = "a 'lucid_fx.save' file, format version 1 written by lucid_fx.save: "
    for name in ("cut.pt", "text.pt"):  # torch's words, by version: "OSError: [Errno 22] Invalid argument", "KeyError: 101", ...
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name} is not {expected}{_CORRUPT}") + r"[A-Za-z]+Error: \S[^\n]*$"):
            lucid_fx.load(tmp_path / name)


def user_scale(x):
    return x * 2


fx.wrap("user_scale")


class _CallsUser(nn.Module):
    def forward(self, x):
        return user_scale(x) + 1


def test_a_function_off_the_allowlist_is_named_at_save_and_allow_lets_it_through():
    gm = fx.symbolic_trace(_CallsUser())
    with pytest.raises(NotSerializable, match=r"node 'user_scale' \(call_function\).*calls 'user_scale'.*allow=\[fn\]"):
        _round_trip(gm)
    buffer = io.BytesIO()
    lucid_fx.save(gm, buffer, allow=[user_scale])
    buffer.seek(0)
    with pytest.raises(ValueError, match="unknown function 'test_save_load.user_scale'"):
        lucid_fx.load(buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer, allow=[user_scale])
    assert torch.equal(loaded(torch.ones(2)), torch.tensor([3.0, 3.0]))


@torch.library.custom_op("lucid_fx_test_save::squish", mutates_args=())
def _squish(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5


_squish.register_fake(lambda x: torch.empty_like(x))


class _CallsOp(nn.Module):
    def forward(self, x):
        return torch.ops.lucid_fx_test_save.squish(x) + 1


_SQUISH = torch.ops.lucid_fx_test_save.squish


@pytest.mark.parametrize("target", ["packet", "overload"])
def test_a_custom_op_is_named_as_python_spells_it(target):
    # Before: "calls 'pybind11_detail_function_record_v1_..._abi_1.squish'" at save, and "unknown function
    # 'torch._ops.lucid_fx_test_save.pybind11_...'" at load; allow=[op.default] was refused for a packet call.
    gm = fx.symbolic_trace(_CallsOp())
    name = "torch.ops.lucid_fx_test_save.squish"
    if target == "overload":
        next(n for n in gm.graph.nodes if n.target is _SQUISH).target = _SQUISH.default
        gm.recompile()
        name += ".default"
    with pytest.raises(NotSerializable, match=re.escape(f"node 'squish' (call_function) in the root module: calls '{name}', which is not "
                                                        f"on the allowlist") + ".*" + re.escape(f"pass it as save(..., allow=[{name}]) and load(..., allow=[{name}])")):
        _round_trip(gm)
    for allowed in (_SQUISH, _SQUISH.default):  # a packet stands for its overloads, and all its overloads for it
        buffer = io.BytesIO()
        lucid_fx.save(gm, buffer, allow=[allowed])
        buffer.seek(0)
        with pytest.raises(ValueError, match=re.escape(f"node 'squish' (call_function) in the root module: unknown function '{name}'; "
                                                       f"if you trust it, pass it as load(..., allow=[{name}])")):
            lucid_fx.load(buffer)
        for on_load in (_SQUISH, _SQUISH.default):
            buffer.seek(0)
            assert torch.equal(lucid_fx.load(buffer, allow=[on_load])(torch.ones(2)), torch.tensor([1.5, 1.5]))


def test_files_that_named_an_allowed_op_by_its_qualname_still_load():
    gm = fx.symbolic_trace(_CallsOp())
    buffer = io.BytesIO()
    lucid_fx.save(gm, buffer, allow=[_SQUISH])
    data = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    call = next(n for n in data["model"]["graph"]["nodes"] if n["op"] == "call_function" and "squish" in n["target"]["v"])
    call["target"]["v"] = f"{_SQUISH.__module__}.{_SQUISH.__qualname__}"  # what save wrote before
    old = io.BytesIO()
    torch.save(data, old)
    old.seek(0)
    assert torch.equal(lucid_fx.load(old, allow=[_SQUISH])(torch.ones(2)), torch.tensor([1.5, 1.5]))


def test_hooks_are_refused_with_what_to_do():
    model = _mlp().eval()
    model[0].register_forward_hook(lambda *args: None)
    with pytest.raises(NotSerializable, match=r"module '0' \(Linear\) has _forward_hooks registered; hooks are code"):
        _round_trip(model)


def _qat_step(model, x, target):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), target)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_qat_model_round_trips_mid_training():
    # prepare_qat parametrizes each weight through its fake quant; the file keeps the base class,
    # the float weight and the fake quant (one object, also in the weight-observer container).
    torch.manual_seed(0)
    qat = lucid_fx.prepare_qat(_mlp().train(), example_inputs=(torch.randn(2, 8),))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    _qat_step(qat, x, target)
    before = {k: v.clone() for k, v in qat.state_dict().items()}
    loaded = _round_trip(qat)
    assert all(torch.equal(before[k], v) for k, v in qat.state_dict().items())  # saving changed nothing
    _assert_same_state(qat, loaded)
    layer, saved_layer = loaded.get_submodule("0"), qat.get_submodule("0")
    assert type(layer).__name__ == "ParametrizedLinear" and loaded.training
    assert layer.parametrizations.weight[0] is loaded.lucid_fx_weight_observers["0"]
    assert type(layer) is not type(saved_layer)  # its own generated class, not the saved model's
    # Training goes on identically in both, and both convert to the same int8 model.
    torch.testing.assert_close(loaded(x), qat(x), rtol=0, atol=0)
    _qat_step(qat, x, target)
    _qat_step(loaded, x, target)
    _assert_same_state(qat, loaded)
    qmodel, qloaded = lucid_fx.convert(qat.eval()), lucid_fx.convert(loaded.eval())
    assert torch.equal(qloaded(x), qmodel(x)) and torch.equal(saved_layer.weight, layer.weight)


def test_a_qat_model_saved_before_its_first_step_trains_after_load():
    # Its fake quants still hold a one-element scale that the first step grows to one per channel;
    # a tensor read from a file cannot grow ("Trying to resize storage that is not resizable").
    torch.manual_seed(0)
    qat = lucid_fx.prepare_qat(_mlp().train(), example_inputs=(torch.randn(2, 8),))
    loaded = _round_trip(qat)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    _qat_step(qat, x, target)
    _qat_step(loaded, x, target)
    _assert_same_state(qat, loaded)
    assert loaded.get_submodule("0").parametrizations.weight[0].scale.shape == (16,)


def test_a_fake_quant_shared_with_the_layers_own_subtree_loads():
    # The file writes a parametrized module's children before its parametrizations, as load
    # reads them, so a module found in both places is built once and aliased.
    fake_quant = Q.FakeQuantize(Q.MovingAverageMinMaxObserver.with_args(averaging_constant=0.5))
    layer = nn.Linear(4, 4)
    torch.nn.utils.parametrize.register_parametrization(layer, "weight", fake_quant, unsafe=True)
    layer.inner = nn.Sequential(fake_quant)
    model = nn.Sequential(layer).train()
    model(torch.randn(3, 4))
    loaded = _round_trip(model)
    assert loaded[0].parametrizations.weight[0] is loaded[0].inner[0]
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), model(x))


def test_save_leaves_the_model_as_it_was():
    prepared, shape = _prepared("cnn")
    lucid_fx.calibrate(prepared, _batches(shape, 2), progress=False)
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    graph = _graph_of(prepared)
    _round_trip(prepared)
    assert _graph_of(prepared) == graph
    assert all(torch.equal(before[k], v) for k, v in prepared.state_dict().items())


def test_packed_weights_are_not_saved_but_rebuilt_on_the_first_call():
    from lucid_fx.kernels.cpu import PACKED, onednn_available

    prepared, shape = _prepared("cnn")
    lucid_fx.calibrate(prepared, _batches(shape, 2), progress=False)
    converted = lucid_fx.convert(prepared)
    x = _batches(shape, 1, seed=5)[0]
    expected = converted(x)  # packs its weights into the cache
    buffer = io.BytesIO()
    lucid_fx.save(converted, buffer)
    buffer.seek(0)
    raw = torch.load(buffer, weights_only=True)
    assert sorted(raw["model"]["buffers"]) == sorted(name for name, _ in converted.named_buffers(recurse=False))
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    before = PACKED.builds
    assert torch.equal(loaded(x), expected)
    # With oneDNN a new weight tensor is packed anew; without it nothing is ever packed.
    assert PACKED.builds > before if onednn_available() else PACKED.builds == before == 0


def test_a_loaded_converted_model_still_shows_its_grids_and_sources():
    """to_networkx / visualize / `lucid-fx show` read node.meta: a converted model keeps it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Hardsigmoid()).eval()
    data = [torch.randn(4, 8) for _ in range(3)]
    qmodel = lucid_fx.quantize(model, (data[0],), data, progress=False)
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    before, after = lucid_fx.to_networkx(qmodel), lucid_fx.to_networkx(lucid_fx.load(buffer))
    assert list(after.nodes) == list(before.nodes)
    for name in before.nodes:
        for key in ("domain", "qparams", "source", "lowering", "observer", "shape", "dtype", "interval", "rule"):
            assert after.nodes[name].get(key) == before.nodes[name].get(key), (name, key)
    assert after.nodes["lut"]["domain"] == "fixed" and after.nodes["linear"]["lowering"] == "linear+relu"


def test_two_allowed_functions_under_one_name_are_refused():
    first, second = (lambda x: x), (lambda x: x + 1)
    with pytest.raises(ValueError, match="allow= holds two different objects named .*<lambda>.*give them distinct names"):
        lucid_fx.save(nn.Linear(2, 2), io.BytesIO(), allow=[first, second])


# torch.nn layers a model may hold: load holds each to what its constructor makes (its twin), so
# each must round trip with its attributes as the constructor keeps them.
LAYERS = {
    "linear": (lambda: nn.Linear(4, 3), (2, 4)),
    "linear-no-bias": (lambda: nn.Linear(4, 3, bias=False), (2, 4)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, stride=2, dilation=2), (1, 2, 12)),
    "conv2d-same-reflect": (lambda: nn.Conv2d(2, 4, 3, padding="same", padding_mode="reflect", groups=2), (1, 2, 8, 8)),
    "conv-transpose2d": (lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1), (1, 2, 5, 5)),
    "batchnorm1d": (lambda: nn.BatchNorm1d(4, momentum=None).eval(), (2, 4)),
    "layernorm": (lambda: nn.LayerNorm([3, 4], elementwise_affine=False), (2, 3, 4)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 3)),
    "instancenorm": (lambda: nn.InstanceNorm1d(4, affine=True), (2, 4, 5)),
    "gelu-tanh": (lambda: nn.GELU("tanh"), (2, 4)),
    "prelu": (lambda: nn.PReLU(4), (2, 4)),
    "softmax": (lambda: nn.Softmax(-1), (2, 4)),
    "flatten": (lambda: nn.Flatten(0), (2, 2, 2)),
    "upsample": (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (1, 1, 2, 2)),
    "adaptive-avg-pool": (lambda: nn.AdaptiveAvgPool2d((2, 1)), (1, 1, 4, 4)),
    "max-pool-ceil": (lambda: nn.MaxPool2d(3, 2, ceil_mode=True), (1, 1, 6, 6)),
    "encoder-layer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval(), (1, 3, 8)),
}


@pytest.mark.parametrize("layer", LAYERS)
def test_common_torch_layers_round_trip(layer):
    factory, shape = LAYERS[layer]
    torch.manual_seed(0)
    model = nn.Sequential(factory())
    loaded = _round_trip(model)
    x = torch.randn(shape)
    _assert_same_state(loaded, model)
    assert type(loaded[0]) is type(model[0]) and torch.equal(loaded(x), model(x))


def _renamed(value, old_of):
    """``value`` (a saved file's data) with every class name string replaced by its old name."""
    if isinstance(value, str):
        return old_of.get(value, value)
    if isinstance(value, dict):
        return {_renamed(k, old_of): _renamed(v, old_of) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_renamed(v, old_of) for v in value)
    return value


def test_a_file_naming_classes_where_they_were_before_they_moved_still_loads():
    # Files saved before issue 12 name ConvertReport, Placement and Runs at their old homes.
    from _saved_files import raw, write
    from lucid_fx._allowlist import MOVED_CLASSES

    old_of = {new: old for old, new in MOVED_CLASSES.items()}
    data = raw("mlp")
    old = _renamed(data, old_of)
    text = repr(old)
    converted_names = [name for name in MOVED_CLASSES if "Dynamic" not in name and "CanonicalCall" not in name]
    assert all(name in text for name in converted_names) and not any(new in text for new in old_of)
    loaded, fresh = lucid_fx.load(write(old)), lucid_fx.load(write(data))
    assert loaded.lucid_fx_convert_report == fresh.lucid_fx_convert_report
    assert lucid_fx.placement.placements(loaded) == lucid_fx.placement.placements(fresh) != {}
    x = torch.randn(4, 8)
    assert torch.equal(loaded(x), fresh(x))
    # quantize_dynamic's layer moved to the verbs layer (lucid_fx/dynamic.py)
    dynamic = Q.quantize_dynamic(nn.Sequential(nn.Linear(8, 4)))
    buffer = io.BytesIO()
    lucid_fx.save(dynamic, buffer)
    old = _renamed(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), old_of)
    assert "lucid_fx.quantization.dynamic.DynamicQuantizedLinear" in repr(old)
    loaded = lucid_fx.load(write(old))
    assert type(loaded[0]) is Q.DynamicQuantizedLinear and torch.equal(loaded(x), dynamic(x))
    # a prepared model's node.meta[OP] (CanonicalCall moved beside BoundCall, lucid_fx/node_refs.py)
    prepared = lucid_fx.prepare(nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), example_inputs=(x,))
    buffer = io.BytesIO()
    lucid_fx.save(prepared, buffer)
    old = _renamed(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), old_of)
    assert "lucid_fx.ops.CanonicalCall" in repr(old) and "lucid_fx.node_refs.CanonicalCall" not in repr(old)
    loaded = lucid_fx.load(write(old))
    ops = [n.meta.get(_meta.OP) for n in prepared.graph.nodes]
    assert [n.meta.get(_meta.OP) for n in loaded.graph.nodes] == ops and any(op is not None for op in ops)


def _without_fields(value, cls_name, names):
    """``value`` (a saved file's data) with the fields ``names`` of every ``cls_name`` dataclass left out."""
    if isinstance(value, dict):
        if value.get("$") == "dataclass" and value.get("cls") == cls_name:
            return {**value, "v": {k: v for k, v in value["v"].items() if k not in names}}
        return {k: _without_fields(v, cls_name, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_fields(v, cls_name, names) for v in value)
    return value


def test_a_file_written_before_the_report_counted_flops_still_loads():
    # Files saved before issue 14 hold a ConvertReport of (backend, placements) and a PrepareReport without module_flops.
    from _saved_files import raw, write

    data = raw("mlp")
    new = ("flops", "opaque", "float_modules", "module_flops")
    old = _without_fields(_without_fields(data, "lucid_fx._placement.ConvertReport", new), "lucid_fx.prepare.PrepareReport", new)
    assert "module_flops" in repr(data) and "module_flops" not in repr(old)
    loaded, fresh = lucid_fx.load(write(old)), lucid_fx.load(write(data))
    assert loaded.lucid_fx_convert_report.placements == fresh.lucid_fx_convert_report.placements != {}
    assert loaded.lucid_fx_convert_report.flops == {} and fresh.lucid_fx_convert_report.flops != {}
    x = torch.randn(4, 8)
    assert torch.equal(loaded(x), fresh(x))
    # a field the class does not have is still refused
    with pytest.raises(ValueError, match="malformed ConvertReport dataclass"):
        lucid_fx.load(write(_with_extra_field(data)))


def _with_extra_field(value):
    if isinstance(value, dict):
        if value.get("$") == "dataclass" and value.get("cls") == "lucid_fx._placement.ConvertReport":
            return {**value, "v": {**value["v"], "surprise": 1}}
        return {k: _with_extra_field(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_with_extra_field(v) for v in value)
    return value


class CausalMasked(nn.Module):
    """Llama's causal mask: a tensor the graph builds on a device (``full(..., device=cpu)``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        mask = torch.full((x.shape[1], x.shape[1]), -1e4, device=x.device).triu(1)
        return torch.softmax(self.fc(x) @ x.transpose(1, 2) + mask, dim=-1)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_graph_that_builds_a_tensor_on_a_device_saves_and_loads(capture):
    # load's check runs the graph on the meta device: full(..., device=cpu) then met a meta tensor,
    # and the Llama-like family could not be loaded
    x = torch.randn(2, 5, 8)
    qmodel = lucid_fx.quantize(CausalMasked().eval(), (x,), [torch.randn(2, 5, 8) for _ in range(4)], capture=capture)
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    assert torch.equal(lucid_fx.load(buffer)(x), qmodel(x))
