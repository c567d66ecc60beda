"""Crafted files: load refuses each with a ValueError naming what is wrong, before anything runs."""

import io
import re

import pytest
import torch
import torch.fx.passes.shape_prop  # noqa: F401 - ShapeProp, as prepare records shapes

import lucid_fx
from _saved_files import CANARY_CODE, canary_fired, node_record, nodes, raw, reset_canary, write
from lucid_fx import _meta
from lucid_fx._allowlist import value_class_names
from lucid_fx._codec import NotSerializable
from lucid_fx._load_values import META_KEYS, META_TYPES


@pytest.fixture(autouse=True)
def _canary():
    reset_canary()
    yield
    assert not canary_fired(), "a crafted file ran code"


def _module(class_name, attrs=None):
    """A module record as save writes one, with ``attrs`` already encoded."""
    return {"kind": "module", "training": False, "class": class_name, "attrs": dict(attrs or {}), "params": {},
            "requires_grad": {}, "buffers": {}, "non_persistent": [], "children": []}


def _fn(name):
    return {"$": "fn", "v": name}


def _node(name):
    return {"$": "node", "name": name}


def _compiled_call_impl_exploit():
    """The exploit of issue 11: nn.Module reads ``_compiled_call_impl`` (a class attribute) on every
    call, so a file that sets it on a module turns ``call_module`` into a call of any allowlisted
    function, with arguments no check looked at: getattr walks from the input tensor to a Python
    function's globals, getitem fetches ``exec``, and ``max(..., key=exec)`` runs the file's code."""
    data = raw("mlp")
    relu = "torch.nn.modules.activation.ReLU"
    data["model"]["children"] += [
        ["walk", _module(relu, {"_compiled_call_impl": _fn("builtins.getattr")})],
        ["run", _module(relu, {"_compiled_call_impl": _fn("builtins.max")})],
    ]
    x = nodes(data)[0]["name"]
    getitem = _fn("operator.getitem")
    chain = [
        node_record("tensor_class", "call_module", "walk", [_node(x), "__class__"]),
        node_record("py_function", "call_module", "walk", [_node("tensor_class"), "__repr__"]),
        node_record("its_globals", "call_module", "walk", [_node("py_function"), "__globals__"]),
        node_record("builtins", "call_function", getitem, [_node("its_globals"), "__builtins__"]),
        node_record("exec_", "call_function", getitem, [_node("builtins"), "exec"]),
        node_record("ran", "call_module", "run", [[CANARY_CODE]], [("key", _node("exec_"))]),
    ]
    nodes(data)[1:1] = chain
    return write(data)


def test_a_class_level_module_attribute_cannot_be_set_to_run_code():
    with pytest.raises(ValueError, match=re.escape("module 'walk' (ReLU): attribute '_compiled_call_impl' may not be set from a file")):
        model = lucid_fx.load(_compiled_call_impl_exploit())
        model(torch.randn(4, 8))  # on main's loader this ran the file's code


def _children(data):
    return dict(data["model"]["children"])


def test_the_root_graph_module_cannot_take_a_class_level_attribute_either():
    data = raw("mlp")
    data["model"]["attrs"]["_compiled_call_impl"] = _fn("builtins.getattr")
    with pytest.raises(ValueError, match=re.escape("the root module (QuantizedModule): attribute '_compiled_call_impl' may not be "
                                                   "set from a file (lucid_fx does not set it on a GraphModule)")):
        lucid_fx.load(write(data))


# nn.Module's class attributes, each a value a file could otherwise put on an instance.
@pytest.mark.parametrize("name", ["_compiled_call_impl", "dump_patches", "call_super_init", "_version", "T_destination", "_parameters"])
def test_a_module_keeps_only_the_attributes_its_constructor_gives_it(name):
    data = raw("prepared")
    _children(data)["fc"]["attrs"][name] = 1
    with pytest.raises(ValueError, match=re.escape(f"module 'fc' (Linear): attribute {name!r} may not be set from a file (Linear does not keep it)")):
        lucid_fx.load(write(data))


def test_call_module_arguments_are_checked_like_any_node():
    data = raw("prepared")
    node = next(n for n in nodes(data) if n["op"] == "call_module" and n["target"] == "fc")
    node["args"]["v"].append(_fn("torch.relu"))
    with pytest.raises(ValueError, match=re.escape("node 'fc' (call_module) in the root module: an argument may only be data or a node, "
                                                   "got builtin_function_or_method")):
        lucid_fx.load(write(data))


# -- crafted files found in review: each must be refused at load, before anything runs ---------------
def _call_function_node(data):
    return next(n for n in nodes(data) if n["op"] == "call_function")


def _first_module_call(data):
    return next(n for n in nodes(data) if n["op"] == "call_module")


ATTACKS = {
    "function-off-the-allowlist": (
        lambda d: _call_function_node(d)["target"].update(v="os.system"),
        "node 'sigmoid' (call_function) in the root module: unknown function 'os.system'",
    ),
    "torch-save": (lambda d: _call_function_node(d)["target"].update(v="torch.save"), "unknown function 'torch.save'"),
    "canary-function-of-an-importable-module": (
        lambda d: _call_function_node(d)["target"].update(v="_saved_files.fire"), "unknown function '_saved_files.fire'",
    ),
    "class-off-the-allowlist": (
        lambda d: _children(d)["fc1"].update({"class": "subprocess.Popen"}), "module 'fc1': unknown class 'subprocess.Popen'",
    ),
    "private-tensor-method": (
        lambda d: _call_function_node(d).update(op="call_method", target="__reduce_ex__"),
        "method '__reduce_ex__' is not a public torch.Tensor method on the allowlist",
    ),
    "method-taking-a-callable": (
        lambda d: _call_function_node(d).update(op="call_method", target="apply_"),
        "method 'apply_' is not a public torch.Tensor method on the allowlist",
    ),
    "kwarg-name-injected-into-generated-code": (
        lambda d: _call_function_node(d)["kwargs"]["v"].append(["); import os; os.getcwd(); q=dict(a", 1]),
        "keyword argument names must be identifiers",
    ),
    "class-as-call-target-through-module-globals": (
        lambda d: _call_function_node(d).update(target={"$": "class", "v": "lucid_fx.layout.subprocess.Popen"}),
        "a call_function target must be a function on the allowlist",
    ),
    "get-attr-path-into-function-globals": (
        lambda d: _first_module_call(d).update(op="get_attr", target="fc1.__class__.forward.__globals__"),
        "malformed get_attr target",
    ),
    "get-attr-path-through-a-method": (
        lambda d: _first_module_call(d).update(op="get_attr", target="fc1.forward", args={"$": "tuple", "v": []}),
        "is not a submodule, parameter, buffer or tensor",
    ),
    "aten-op-reading-a-file": (
        lambda d: _call_function_node(d)["target"].update(v="torch.ops.aten.from_file"), "unknown function 'torch.ops.aten.from_file'",
    ),
    "private-torch-function": (lambda d: _call_function_node(d)["target"].update(v="torch._print"), "unknown function 'torch._print'"),
    "global-state-setter": (
        lambda d: _call_function_node(d)["target"].update(v="torch.set_anomaly_enabled"), "unknown function 'torch.set_anomaly_enabled'",
    ),
    "getattr-reaching-a-module-method": (
        lambda d: _call_function_node(d).update(target=_fn("builtins.getattr"), args={"$": "tuple", "v": [_node("x"), "register_forward_hook"]}),
        "getattr is allowed only for tensor attributes",
    ),
    "builtin-with-a-key-callback": (
        lambda d: _call_function_node(d).update(target=_fn("builtins.max"), kwargs={"$": "dict", "v": [["key", _fn("builtins.getattr")]]}),
        "an argument may only be data or a node, got builtin_function_or_method <built-in function getattr>",
    ),
    "builtin-with-a-key-node": (
        lambda d: _call_function_node(d).update(target=_fn("builtins.max"), kwargs={"$": "dict", "v": [["key", _node("x")]]}),
        "max() takes no keyword arguments from a file",
    ),
    "class-named-through-an-import": (
        lambda d: _children(d)["fc1"].update({"class": "lucid_fx.layout.subprocess.Popen"}), "unknown class 'lucid_fx.layout.subprocess.Popen'",
    ),
    "value-of-a-class-off-the-value-list": (
        lambda d: _call_function_node(d)["meta"].update({"lucid_fx.decision": {"$": "dataclass", "cls": "lucid_fx.demo.DemoConfig", "v": {}}}),
        "unknown class 'lucid_fx.demo.DemoConfig'",
    ),
    "factory-that-is-not-an-observer": (
        lambda d: _call_function_node(d)["meta"].update({"lucid_fx.interval": {"$": "partial", "factory": True, "fn": _fn("torch.relu"),
                                                                                "args": {"$": "tuple", "v": []}, "kw": {"$": "dict", "v": []}}}),
        "a factory must build an observer or fake quant, got <built-in method relu",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_crafted_files_are_refused_before_anything_runs(attack):
    edit, message = ATTACKS[attack]
    data = raw("prepared_bounded")
    edit(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        lucid_fx.load(write(data))


def test_a_file_with_pickled_code_is_refused_without_running_it(tmp_path):
    class Exploit:
        def __reduce__(self):  # unpickling this would run the canary
            return (eval, (CANARY_CODE,))

    torch.save({"format": "lucid_fx.save", "version": 1, "model": Exploit()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match=r"evil.pt is not a 'lucid_fx.save' file, format version 1.*weights_only=True\) refused it"):
        lucid_fx.load(tmp_path / "evil.pt")


# -- parametrized (QAT) modules ------------------------------------------------------------------
def _qat_layer(edit):
    data = raw("qat")
    edit(_children(data)["0"])
    return write(data)


def test_a_crafted_right_inverse_never_runs_at_load():
    # register_parametrization calls a parametrization's right_inverse: a file must not set one.
    def edit(layer):
        layer["parametrized"]["weight"]["modules"][0]["attrs"]["right_inverse"] = _fn("torch.zero_")

    with pytest.raises(ValueError, match=re.escape("module '0.parametrizations.weight.0' (FakeQuantize): attribute 'right_inverse' may not be set")):
        lucid_fx.load(_qat_layer(edit))


def test_attributes_that_would_shadow_methods_are_refused():
    with pytest.raises(ValueError, match=re.escape("module '0' (Linear): attribute 'forward' may not be set from a file")):
        lucid_fx.load(_qat_layer(lambda layer: layer["attrs"].update(forward=_fn("torch.zero_"))))


@pytest.mark.parametrize("broken", ["not-a-dict", "no-flag", "int-original-with-grad"])
def test_a_malformed_parametrization_record_is_a_value_error(broken):
    def edit(layer):
        record = layer["parametrized"]["weight"]
        if broken == "not-a-dict":
            layer["parametrized"]["weight"] = 3
        elif broken == "no-flag":
            del record["is_parameter"]
        else:
            record["original"] = torch.zeros(16, 8, dtype=torch.int64)

    with pytest.raises(ValueError, match=re.escape("module '0': malformed parametrization record for 'weight'")):
        lucid_fx.load(_qat_layer(edit))


def test_a_parametrized_record_with_a_bad_tensor_name_is_refused():
    def edit(layer):
        layer["parametrized"]["__class__"] = layer["parametrized"].pop("weight")

    with pytest.raises(ValueError, match=re.escape("module '0': parametrized tensor name '__class__' may not be set from a file")):
        lucid_fx.load(_qat_layer(edit))


# -- a file that would load a model that then fails or returns garbage ---------------------------
def _set_tensor(kind, module_name, table, name, value):
    data = raw(kind)
    record = data["model"] if module_name is None else _children(data)[module_name]
    record[table][name] = value(record[table][name])
    return write(data)


BROKEN_STATE = {
    "weight-shape-disagrees-with-the-module": (
        ("prepared", "fc", "params", "weight", lambda w: w[:, :127].clone()),
        "module 'fc' (Linear): tensor 'weight' is torch.float32 [6, 127]; Linear holds torch.float32 [6, 128] there",
    ),
    "weight-of-another-dtype": (
        ("prepared", "conv", "params", "weight", lambda w: w.half()),
        "module 'conv' (Conv2d): tensor 'weight' is torch.float16 [8, 3, 3, 3]; Conv2d holds torch.float32 [8, 3, 3, 3] there",
    ),
    "weight-on-meta": (
        ("prepared", "fc", "params", "weight", lambda w: w.to("meta")),
        "module 'fc' (Linear), tensor 'weight': a torch.strided torch.float32 tensor on meta; save writes dense tensors",
    ),
    "buffer-stored-as-a-string": (
        ("mlp", None, "buffers", "_lucid_0_qweight", lambda w: "a string"),
        "the root module (QuantizedModule), tensor '_lucid_0_qweight': expected a tensor, got str",
    ),
    "int8-weight-widened": (
        ("mlp", None, "buffers", "_lucid_0_qweight", lambda w: w.int()),
        "node '_lucid_0_qweight' (get_attr) in the root module: tensor '_lucid_0_qweight' is torch.int32 [16, 8]; "
        "the graph was built for torch.int8 [16, 8]",
    ),
    "weight-scales-emptied": (  # on the loader before issue 11, calling this model crashed the interpreter in oneDNN
        ("mlp", None, "buffers", "_lucid_2_wscale", lambda s: s[:0].clone()),
        "node '_lucid_2_wscale' (get_attr) in the root module: tensor '_lucid_2_wscale' is torch.float32 [0]; "
        "the graph was built for torch.float32 [4]",
    ),
    "batch-norm-statistics-of-another-length": (
        ("prepared", "bn", "buffers", "running_var", lambda v: v[:7].clone()),
        "module 'bn' (BatchNorm2d): tensor 'running_var' is torch.float32 [7]; BatchNorm2d holds torch.float32 [8] there",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_STATE))
def test_tensors_are_held_to_what_the_module_and_graph_expect(case):
    where, message = BROKEN_STATE[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        lucid_fx.load(_set_tensor(*where))


def test_attributes_are_held_to_what_the_constructor_keeps():
    data = raw("prepared")
    _children(data)["conv"]["attrs"]["stride"] = "ab"
    with pytest.raises(ValueError, match=re.escape("module 'conv' (Conv2d): attribute 'stride' is str where tuple belongs")):
        lucid_fx.load(write(data))
    data = raw("prepared")
    _children(data)["conv"]["attrs"]["groups"] = 2  # 3 input channels cannot split in 2 groups
    with pytest.raises(ValueError, match=re.escape("module 'conv' (Conv2d): its attributes do not make a Conv2d: in_channels must be divisible by groups")):
        lucid_fx.load(write(data))
    data = raw("prepared")
    del _children(data)["fc"]["attrs"]["out_features"]
    with pytest.raises(ValueError, match=re.escape("module 'fc' (Linear): the file lacks attribute 'out_features', which Linear is built from")):
        lucid_fx.load(write(data))


def test_a_graph_that_does_not_run_on_its_recorded_shapes_is_refused():
    data = raw("prepared")
    flatten = next(n for n in nodes(data) if n["name"] == "flatten")
    flatten.update(target=_fn("torch.relu"), args={"$": "tuple", "v": flatten["args"]["v"][:1]})  # an allowlisted op, the wrong one
    with pytest.raises(ValueError, match=re.escape("node 'flatten' (call_function) in the root module: computes torch.float32 "
                                                   "[4, 8, 4, 4], but the file records torch.float32 [4, 128]")):
        lucid_fx.load(write(data))
    data = raw("cnn")
    conv = next(n for n in nodes(data) if n["name"] == "conv2d")
    conv["args"]["v"][6] = [2, 2]  # stride 2: the int8 conv no longer makes what the pooling after it was built for
    with pytest.raises(ValueError, match=re.escape("node 'conv2d' (call_function) in the root module: computes torch.uint8 [4, 8, 4, 4], "
                                                   "but the file records torch.uint8 [4, 8, 8, 8]")):
        lucid_fx.load(write(data))


# -- malformed structure -------------------------------------------------------------------------
def _nest(value, depth):
    for _ in range(depth):
        value = [value]
    return value


def _node_named(data, name):
    return next(n for n in nodes(data) if n["name"] == name)


def _first_fake_quant(data):
    return _children(data)["lucid_fx_observers"]["children"][0][1]


STRUCTURE = {
    "record-lacks-a-key": (lambda d: _children(d)["fc"].pop("params"), "module 'fc': the module record lacks 'params'"),
    "record-with-an-unknown-key": (lambda d: _children(d)["fc"].update(extra=1), "module 'fc': unexpected key 'extra' in a module record"),
    "value-nested-too-deep": (
        lambda d: _node_named(d, "fc")["args"]["v"].append(_nest(1, 200)),
        "node 'fc' (call_module) in the root module: a value nested more than 32 deep",
    ),
    "modules-nested-too-deep": (
        lambda d: _children(d)["fc"]["children"].append(["deep", _nest_modules(120)]),
        "modules nested more than 100 deep",
    ),
    "alias-of-an-ancestor": (
        lambda d: _children(d)["fc"]["children"].append(["loop", {"kind": "alias", "path": ""}]),
        "module 'fc.loop': alias of '', which is not a module loaded before it",
    ),
    "duplicate-node-name": (
        lambda d: _node_named(d, "flatten").update(name="relu"), "node 'relu' (call_function) in the root module: duplicate node name",
    ),
    "output-not-last": (
        lambda d: nodes(d).append(dict(nodes(d)[-1], name="output_2")),
        "node 'output' (output) in the root module: placeholders must come first, the output node last and only once",
    ),
    "placeholder-named-by-a-keyword": (
        lambda d: nodes(d)[0].update(target="lambda"), "node 'x' (placeholder) in the root module: malformed placeholder name 'lambda'",
    ),
    "output-of-constants": (
        lambda d: nodes(d)[-1].update(args={"$": "tuple", "v": [-1]}),
        "node 'output' (output) in the root module: the graph must return values it computes",
    ),
    "meta-of-the-wrong-type": (
        lambda d: _node_named(d, "relu")["meta"].update({"lucid_fx.decision": "int8"}),
        "node 'relu', meta 'lucid_fx.decision' in the root module: str where Decision belongs",
    ),
    "dataclass-field-of-the-wrong-type": (
        lambda d: _node_named(d, "relu")["meta"]["lucid_fx.decision"]["v"].update(kind=3),
        "node 'relu', meta 'lucid_fx.decision' in the root module: Decision.kind: int where DecisionKind belongs",
    ),
    "meta-key-lucid_fx-never-writes": (
        lambda d: _node_named(d, "relu")["meta"].update(nn_module_stack=1), "node 'relu', meta 'nn_module_stack' in the root module: not a key lucid_fx writes",
    ),
    "meta-naming-a-later-node": (
        lambda d: _node_named(d, "relu")["meta"]["lucid_fx.op"]["v"]["args"]["v"][0][1]["v"].update(name="fc"),
        "node 'relu' (call_function) in the root module: meta 'lucid_fx.op' names node 'fc', which does not come before it in the graph",
    ),
    "prepared-node-without-its-op": (
        lambda d: _node_named(d, "relu")["meta"].pop("lucid_fx.op"),
        "node 'relu' (call_function) in the root module: meta lacks 'lucid_fx.op'",
    ),
    "fused-group-without-its-end": (
        lambda d: _node_named(d, "conv")["meta"].update({"lucid_fx.fused_into": "pool"}),
        "node 'conv' (call_module) in the root module: meta 'lucid_fx.fused_into' names 'pool', which ends no fused group",
    ),
    "observer-container-of-another-class": (
        lambda d: _children(d)["lucid_fx_observers"].update({"class": "torch.nn.modules.container.Sequential"}),
        "the root module (CNN): child 'lucid_fx_observers' is a Sequential; lucid_fx makes it a ModuleDict",
    ),
}


def _nest_modules(depth):
    record = _module("torch.nn.modules.linear.Identity")
    for _ in range(depth):
        outer = _module("torch.nn.modules.container.Sequential")
        outer["children"] = [["0", record]]
        record = outer
    return record


@pytest.mark.parametrize("case", sorted(STRUCTURE))
def test_malformed_structure_is_named(case):
    edit, message = STRUCTURE[case]
    data = raw("prepared")
    edit(data)
    with pytest.raises(ValueError, match=re.escape(message)):
        lucid_fx.load(write(data))


# -- what stays loadable ---------------------------------------------------------------------------
def test_buffers_anyone_registers_stay_loadable():
    # Converted models may carry more state as plain buffers (activation qparams, masks): a file
    # may hold a buffer its class does not, but never lack one the class has.
    converted = lucid_fx.load(write(raw("mlp")))
    converted.register_buffer("activation_qparams", torch.tensor([[0.05, 108.0]]))
    prepared = lucid_fx.load(write(raw("prepared")))
    prepared.fc.register_buffer("mask", torch.ones(6, dtype=torch.bool))
    x = torch.randn(4, 8)
    for model, shape in ((converted, (4, 8)), (prepared, (4, 3, 8, 8))):
        buffer = io.BytesIO()
        lucid_fx.save(model, buffer)
        buffer.seek(0)
        loaded = lucid_fx.load(buffer)
        assert [(k, v.dtype, list(v.shape)) for k, v in loaded.state_dict().items()] == \
            [(k, v.dtype, list(v.shape)) for k, v in model.state_dict().items()]
        x = torch.randn(shape)
        assert torch.equal(loaded(x), model(x))
    data = raw("prepared")
    del _children(data)["bn"]["buffers"]["running_var"]
    with pytest.raises(ValueError, match=re.escape("module 'bn' (BatchNorm2d): lacks tensor 'running_var' of BatchNorm2d")):
        lucid_fx.load(write(data))


def test_save_refuses_an_attribute_load_would_refuse():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].note = "calibrated on day 3"
    with pytest.raises(NotSerializable, match=re.escape("module '0' (Linear): attribute 'note' may not be set from a file (Linear does "
                                                        "not keep it); lucid_fx.load would refuse it, so save does too")):
        lucid_fx.save(model, io.BytesIO())


def test_the_value_classes_are_those_lucid_fx_writes():
    # Derived from lucid_fx's meta values and reports and the classes their fields are annotated
    # with (Untraceable is reached only through PrepareReport.float_modules): a closed set.
    names = value_class_names()
    assert {
        "lucid_fx.quantization.dtypes.QDtype", "lucid_fx.quantization.dtypes.QScheme", "lucid_fx.quantization.qconfig.QConfig",
        "lucid_fx.rules.observers.Decision", "lucid_fx.node_refs.CanonicalCall", "lucid_fx.prepare.PrepareReport",
        "lucid_fx.passes.trace_model.Untraceable", "lucid_fx._placement.ConvertReport",
        "torch.fx.passes.shape_prop.TensorMetadata",
    } <= names
    assert all(n.startswith("lucid_fx.") for n in names - {"torch.fx.passes.shape_prop.TensorMetadata"})
    written = set()
    for kind in ("mlp", "cnn", "bounded", "qat", "prepared", "prepared_bounded"):
        written |= set(re.findall(r"'cls': '([\w.]+)'", repr(raw(kind))))
    assert written <= names and "lucid_fx.node_refs.CanonicalCall" in written


def test_every_meta_key_has_a_type_to_check():
    keys = [v for k, v in vars(_meta).items() if k.isupper() and isinstance(v, str)
            and k not in _meta.NOT_NODE_KEYS + _meta.PROGRAM_KEYS]  # TRACE: gm.meta; containers; BOUND_OP: programs'
    assert sorted(META_KEYS) == sorted(keys) and set(keys) <= set(META_TYPES())
    assert _meta.BOUND_OP not in META_KEYS  # a program's key is never in a file: one that holds it is refused


class _MakesTensors(torch.nn.Module):
    def forward(self, x):
        return x + torch.ones(4) + torch.arange(4.0)  # tensors the graph makes: on the meta device in the check


class _Nonzero(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x).nonzero().float().sum() + x  # an output shape that depends on values


class _PinnedDevice(torch.nn.Module):
    def forward(self, x):
        return x + torch.ones(4, device="cpu")


@pytest.mark.parametrize("model", [_MakesTensors, _Nonzero, _PinnedDevice])
def test_graphs_that_make_tensors_or_need_values_still_load(model):
    gm = torch.fx.symbolic_trace(model())
    torch.fx.passes.shape_prop.ShapeProp(gm).propagate(torch.randn(3, 4))  # records shapes, as prepare does
    buffer = io.BytesIO()
    lucid_fx.save(gm, buffer)
    buffer.seek(0)
    x = torch.randn(3, 4)
    assert torch.equal(lucid_fx.load(buffer)(x), gm(x))
