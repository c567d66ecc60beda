"""save / load: round trips to identical outputs, mid-calibration resumes, no pickled code runs."""

import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
import lucid_fx.quantization as Q
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


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


def test_a_file_with_pickled_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"format": "lucid_fx.save", "version": FORMAT_VERSION, "model": _Exploit(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"evil.pt is not a 'lucid_fx.save' file, format version 1.*weights_only=True\) refused it"):
        lucid_fx.load(tmp_path / "evil.pt")
    assert not marker.exists()


def _tampered(tmp_path, edit):
    prepared, shape = _prepared("bounded")
    lucid_fx.calibrate(prepared, _batches(shape, 2), progress=False)
    lucid_fx.save(prepared, tmp_path / "ok.pt")
    raw = torch.load(tmp_path / "ok.pt", weights_only=True)
    edit(raw)
    torch.save(raw, tmp_path / "bad.pt")
    return tmp_path / "bad.pt"


def _call_function_node(raw):
    return next(n for n in raw["model"]["graph"]["nodes"] if n["op"] == "call_function")


def test_a_file_naming_a_function_off_the_allowlist_is_refused(tmp_path):
    path = _tampered(tmp_path, lambda raw: _call_function_node(raw)["target"].update(v="os.system"))
    with pytest.raises(NotSerializable, match=r"node 'sigmoid' \(call_function\).*unknown function 'os.system'"):
        lucid_fx.load(path)
    path = _tampered(tmp_path, lambda raw: _call_function_node(raw)["target"].update(v="torch.save"))
    with pytest.raises(NotSerializable, match="unknown function 'torch.save'"):
        lucid_fx.load(path)


def test_a_file_naming_a_class_off_the_allowlist_is_refused(tmp_path):
    def edit(raw):
        raw["model"]["children"][0][1]["class"] = "subprocess.Popen"

    with pytest.raises(NotSerializable, match=r"module 'fc1': unknown class 'subprocess.Popen'"):
        lucid_fx.load(_tampered(tmp_path, edit))


def test_a_file_calling_a_private_method_is_refused(tmp_path):
    def edit(raw):
        node = _call_function_node(raw)
        node.update(op="call_method", target="__reduce_ex__")

    with pytest.raises(NotSerializable, match="method '__reduce_ex__' is not a public torch.Tensor method"):
        lucid_fx.load(_tampered(tmp_path, edit))


def test_missing_path_and_foreign_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="lucid_fx.load: .*nothing.pt does not exist"):
        lucid_fx.load(tmp_path / "nothing.pt")
    torch.save({"weight": torch.ones(2)}, tmp_path / "state.pt")
    with pytest.raises(ValueError, match=r"state.pt was not written by lucid_fx.save \(expected a 'lucid_fx.save' file, format version 1\)"):
        lucid_fx.load(tmp_path / "state.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="text.pt is not a 'lucid_fx.save' file, format version 1"):
        lucid_fx.load(tmp_path / "text.pt")
    path = _tampered(tmp_path, lambda raw: raw.update(version=99))
    with pytest.raises(ValueError, match="has format version 99; this lucid_fx reads version 1"):
        lucid_fx.load(path)


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
    with pytest.raises(NotSerializable, match="unknown function 'test_save_load.user_scale'"):
        lucid_fx.load(buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer, allow=[user_scale])
    assert torch.equal(loaded(torch.ones(2)), torch.tensor([3.0, 3.0]))


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


def _crafted(mutate):
    qat = lucid_fx.prepare_qat(_mlp().train(), example_inputs=(torch.randn(2, 8),))
    buffer = io.BytesIO()
    lucid_fx.save(qat, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True)
    (child,) = [c for name, c in data["model"]["children"] if name == "0"]
    mutate(child)
    crafted = io.BytesIO()
    torch.save(data, crafted)
    crafted.seek(0)
    return crafted


def test_a_crafted_right_inverse_never_runs_at_load():
    # register_parametrization calls a parametrization's right_inverse: a file must not set one.
    def mutate(child):
        child["parametrized"]["weight"]["modules"][0]["attrs"]["right_inverse"] = {"$": "fn", "v": "torch.zero_"}

    with pytest.raises(ValueError, match=r"module '0.parametrizations.weight.0': attribute 'right_inverse' may not be set"):
        lucid_fx.load(_crafted(mutate))


def test_attributes_that_would_shadow_methods_are_refused():
    def mutate(child):
        child["attrs"]["forward"] = {"$": "fn", "v": "torch.zero_"}

    with pytest.raises(ValueError, match=r"module '0': attribute 'forward' may not be set from a file"):
        lucid_fx.load(_crafted(mutate))


@pytest.mark.parametrize("broken", ["not-a-dict", "no-flag", "int-original-with-grad"])
def test_a_malformed_parametrization_record_is_a_value_error(broken):
    def mutate(child):
        record = child["parametrized"]["weight"]
        if broken == "not-a-dict":
            child["parametrized"]["weight"] = 3
        elif broken == "no-flag":
            del record["is_parameter"]
        else:
            record["original"] = torch.zeros(16, 8, dtype=torch.int64)

    with pytest.raises(ValueError, match=r"module '0': malformed parametrization record for 'weight'"):
        lucid_fx.load(_crafted(mutate))


def test_a_parametrized_record_with_a_bad_tensor_name_is_refused():
    def mutate(child):
        child["parametrized"]["__class__"] = child["parametrized"].pop("weight")

    with pytest.raises(ValueError, match=r"module '0': parametrized tensor name '__class__' may not be set from a file"):
        lucid_fx.load(_crafted(mutate))


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
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Sigmoid()).eval()
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


def _first_get_attr_or_module(raw):
    return next(n for n in raw["model"]["graph"]["nodes"] if n["op"] in ("get_attr", "call_module"))


# Each edit is a way a crafted file tried to run code (found in review); each must be refused
# at load, before anything runs.
ATTACKS = {
    "kwarg-name-injected-into-generated-code": (
        lambda raw: _call_function_node(raw)["kwargs"]["v"].append(["); import os; os.getcwd(); q=dict(a", 1]),
        "keyword argument names must be identifiers",
    ),
    "class-as-call-target-through-module-globals": (
        lambda raw: _call_function_node(raw).update(target={"$": "class", "v": "lucid_fx.layout.subprocess.Popen"}),
        "a call_function target must be a function on the allowlist",
    ),
    "get-attr-path-into-function-globals": (
        lambda raw: _first_get_attr_or_module(raw).update(op="get_attr", target="fc1.__class__.forward.__globals__"),
        "malformed get_attr target",
    ),
    "get-attr-path-through-a-method": (
        lambda raw: _first_get_attr_or_module(raw).update(op="get_attr", target="fc1.forward"),
        "is not a submodule, parameter, buffer or tensor",
    ),
    "aten-op-reading-a-file": (
        lambda raw: _call_function_node(raw)["target"].update(v="torch.ops.aten.from_file"),
        "unknown function 'torch.ops.aten.from_file'",
    ),
    "private-torch-function": (
        lambda raw: _call_function_node(raw)["target"].update(v="torch._print"),
        "unknown function 'torch._print'",
    ),
    "global-state-setter": (
        lambda raw: _call_function_node(raw)["target"].update(v="torch.set_anomaly_enabled"),
        "unknown function 'torch.set_anomaly_enabled'",
    ),
    "getattr-reaching-a-module-method": (
        lambda raw: _call_function_node(raw).update(
            target={"$": "fn", "v": "builtins.getattr"}, args={"$": "tuple", "v": [{"$": "node", "name": "x"}, "register_forward_hook"]}
        ),
        "getattr is allowed only for tensor attributes",
    ),
    "builtin-with-a-key-callback": (
        lambda raw: _call_function_node(raw).update(
            target={"$": "fn", "v": "builtins.max"}, kwargs={"$": "dict", "v": [["key", {"$": "fn", "v": "builtins.getattr"}]]}
        ),
        "max() takes no keyword arguments from a file",
    ),
    "class-named-through-an-import": (
        lambda raw: raw["model"]["children"][0][1].update({"class": "lucid_fx.layout.subprocess.Popen"}),
        "unknown class 'lucid_fx.layout.subprocess.Popen'",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_crafted_files_are_refused_before_anything_runs(tmp_path, attack):
    edit, message = ATTACKS[attack]
    path = _tampered(tmp_path, edit)
    with pytest.raises((ValueError, NotSerializable), match=re.escape(message)):
        lucid_fx.load(path)


def test_two_allowed_functions_under_one_name_are_refused():
    first, second = (lambda x: x), (lambda x: x + 1)
    with pytest.raises(ValueError, match="allow= holds two different objects named .*<lambda>.*give them distinct names"):
        lucid_fx.save(nn.Linear(2, 2), io.BytesIO(), allow=[first, second])
