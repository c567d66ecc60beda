"""Crafted files: load refuses each with a ValueError naming what is wrong, before anything runs."""

import re

import pytest
import torch

import lucid_fx
from _saved_files import CANARY_CODE, canary_fired, node_record, nodes, raw, reset_canary, write


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
