"""Fuzzing lucid_fx.load with mutated real files.

Each example takes a real file (an int8 MLP, an int8 CNN with conv/bn/pool, an int8 model with
sigmoid/tanh/softmax, a QAT model mid-training, a calibrated prepared CNN), applies one to three
mutations (a key deleted or added, a value of another type, a value nested 30 to 120 deep, a node
target or kind changed, an elementwise op swapped for another, a meta entry dropped, an attribute
added or renamed, a module's class changed, a tensor's dtype, shape or device changed, a tensor
replaced by a string, a node reference broken) and loads it. 110 files per model, 550 a run.
Load must either raise a ``ValueError`` whose message starts by naming where the problem is, or
return a model that runs on the recorded input shape and gives finite outputs of the right shape
(for a prepared model, also after convert). No other exception, and never code run: the canary
(``_saved_files.fire``, and Python source that sets a global and writes a file) must stay silent.

Derandomized: the same files on every run. More cases locally:
``LUCID_FX_LOAD_FUZZ_EXAMPLES=1000 python -m pytest tests/test_load_fuzz.py`` (per model).
"""

import copy
import math
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import lucid_fx
import _saved_files as S

settings.register_profile(
    "lucid_fx_load_fuzz", derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_EXAMPLES = int(os.environ.get("LUCID_FX_LOAD_FUZZ_EXAMPLES", "0")) or 110  # per kind: 550 files a run
_KINDS = ("mlp", "cnn", "bounded", "qat", "prepared")
_LOCATION = re.compile(r"^(lucid_fx\.load: |module '[^']*'|the root module|node ('[^']*'|#\d+))")

# -- what a mutation may put in a file -------------------------------------------------------------
_FN = lambda name: {"$": "fn", "v": name}  # noqa: E731
_CANARY_FUNCTIONS = ["_saved_files.fire", "builtins.exec", "builtins.eval", "builtins.__import__", "os.system",
                     "subprocess.Popen", "torch.save", "torch.load", "torch.ops.aten.from_file", "torch._C._set_grad_enabled",
                     "operator.attrgetter", "operator.methodcaller", "lucid_fx.save_load.load", "torch.nn.functional.__builtins__"]
_OTHER_FUNCTIONS = ["torch.relu", "torch.sigmoid", "torch.cat", "torch.flatten", "torch.matmul", "torch.transpose",
                    "torch.nonzero", "operator.add", "operator.getitem", "builtins.getattr", "builtins.max", "builtins.len",
                    "torch.nn.functional.softmax", "torch.nn.functional.linear", "torch.ops.lucid_fx.linear",
                    "torch.ops.lucid_fx.quantize_per_tensor", "torch.ops.lucid_fx.lut", "math.sqrt"]
_SWAPS = ["torch.relu", "torch.sigmoid", "torch.tanh", "torch.nn.functional.relu", "torch.abs", "torch.neg"]
_PATHS = ["fc", "conv", "conv.weight", "bn.running_var", "0", "0.weight", "lucid_fx_observers", "__class__",
          "fc.forward", "fc.__dict__", "_lucid_fc_qweight", "lucid_fx_report", "", "a..b", "fc.weight.data"]
_METHODS = ["relu", "add", "contiguous", "view", "__reduce__", "apply_", "register_hook", "backward", "item", "tolist"]
_ATTR_NAMES = ["_compiled_call_impl", "forward", "__class__", "__dict__", "training", "_modules", "_parameters",
               "dump_patches", "T_destination", "call_super_init", "_version", "weight", "in_features", "stride",
               "lucid_fx_report", "_tensor_constant0", "right_inverse", "not an identifier", "x"]
_CLASSES = ["torch.nn.modules.linear.Linear", "torch.nn.modules.activation.ReLU", "torch.nn.modules.linear.Identity",
            "torch.nn.modules.conv.Conv2d", "torch.nn.modules.container.Sequential", "torch.nn.modules.batchnorm.BatchNorm2d",
            "lucid_fx.quantization.observers.MinMaxObserver", "lucid_fx.quantization.fake_quantize.FakeQuantize",
            "lucid_fx.quantization.histogram.HistogramObserver", "builtins.object", "_saved_files.CNN",
            "lucid_fx.layout.subprocess.Popen", "torch.fx.graph_module.GraphModule"]
_DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
           torch.complex64]
_VALUES = [None, 0, -1, 7, 1.5, math.nan, math.inf, True, "x", "", [], {}, [1, 2], {"a": 1}, torch.ones(2),
           {"$": "tuple", "v": []}, {"$": "nope"}, {"$": "dtype", "v": "float99"}, {"$": "node", "name": "nowhere"},
           {"$": "dataclass", "cls": "lucid_fx.demo.DemoConfig", "v": {}}, {"$": "device", "v": "cuda:99"},
           _FN("builtins.exec"), _FN("_saved_files.fire"), {"$": "class", "v": "subprocess.Popen"},
           {"$": "partial", "factory": True, "fn": _FN("builtins.exec"), "args": {"$": "tuple", "v": [S.CANARY_CODE]},
            "kw": {"$": "dict", "v": []}}]


def _fresh(value):
    """A copy: a value put in one file must not be shared with the next (or with itself)."""
    return copy.deepcopy(value)


def _entries(tree):
    """Every (container, key, value) in the file's data."""
    found, todo = [], [tree]
    while todo:
        obj = todo.pop()
        items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
        for key, value in items:
            found.append((obj, key, value))
            todo.append(value)
    return found


def _records(entries, key):
    return [v for _, _, v in entries if isinstance(v, dict) and key in v]


def _generic(kind, entries, pick, integer):
    parent, key, value = pick(entries)
    if kind == "delete":
        del parent[key]
    elif kind == "add" and isinstance(value, dict):
        value[pick(["extra", "$", "v", "kind", "meta", "name"])] = _fresh(pick(_VALUES))
    elif kind == "retype":
        parent[key] = _fresh(pick(_VALUES))
    elif kind == "nest":
        depth = integer(30, 120)  # deep enough to pass any limit; three stacked stay writable by torch.save
        for _ in range(depth):
            value = pick([[value], {"$": "tuple", "v": [value]}]) if depth < 60 else [value]
        parent[key] = value
    return f"{kind} at key {key!r:.40}"


def _node(kind, node, pick):
    if kind == "op":
        node["op"] = pick(["placeholder", "get_attr", "call_function", "call_method", "call_module", "output", "eval"])
    elif kind == "reference":
        refs = [v for _, _, v in _entries(node) if isinstance(v, dict) and v.get("$") == "node"] or [{}]
        pick(refs).update({"$": "node", "name": pick(["nowhere", node.get("name"), "output", 3])})
    elif kind == "swap":
        node["target"] = _FN(pick(_SWAPS))  # another elementwise op: still a valid model
    elif kind == "drop-meta" and isinstance(node.get("meta"), dict) and node["meta"]:
        del node["meta"][pick(sorted(node["meta"]))]  # what only inspection reads: often still valid
    else:
        node["target"] = pick([_FN(pick(_CANARY_FUNCTIONS)), _FN(pick(_OTHER_FUNCTIONS)), pick(_PATHS), pick(_METHODS),
                               {"$": "class", "v": "subprocess.Popen"}, 3, None])
    return f"{kind} of node {node.get('name')!r:.40}: {node.get('op')!r:.20} {node.get('target')!r:.60}"


def _module(kind, module, pick):
    if not isinstance(module.get("attrs"), dict):  # an earlier mutation replaced it
        module["attrs"] = {}
    if kind == "attribute":
        module["attrs"][pick(_ATTR_NAMES)] = _fresh(pick(_VALUES))
    elif kind == "rename" and module["attrs"]:
        module["attrs"][pick(_ATTR_NAMES)] = module["attrs"].pop(pick(sorted(module["attrs"])))
    elif kind == "class":
        module["class"] = pick(_CLASSES)
    return f"{kind} on a {module.get('class', module.get('class_name'))!r:.60}"


def _tensor(kind, entry, pick):
    parent, key, tensor = entry
    if kind == "dtype":
        parent[key] = (tensor.real if tensor.is_complex() else tensor).to(pick(_DTYPES))
    elif kind == "shape":
        parent[key] = pick([tensor.reshape(1, *tensor.shape), tensor.reshape(-1)[1:], tensor.new_zeros(()), tensor.new_zeros((0,)),
                            tensor.new_zeros((*tensor.shape[:-1], tensor.shape[-1] + 1)) if tensor.dim() else tensor.new_zeros(3)])
    elif kind == "device":
        parent[key] = tensor.to("meta")
    else:
        parent[key] = pick(["a string", 1.0, [1, 2], None])
    return f"{kind} of the tensor under key {key!r:.40}"


def _mutate(tree, pick, integer):
    """Apply one mutation to ``tree`` in place, choosing with ``pick(options)`` and
    ``integer(lo, hi)``; returns what it did."""
    entries = _entries(tree)
    nodes = _records(entries, "op")
    modules = [r for r in _records(entries, "kind") if r.get("kind") in ("module", "graph")]
    tensors = [e for e in entries if isinstance(e[2], torch.Tensor)]
    kinds = ["delete", "add", "retype", "nest"] * bool(entries) + ["target", "swap", "op", "reference", "drop-meta"] * bool(nodes) \
        + ["attribute", "rename", "class"] * bool(modules) + ["dtype", "shape", "device", "not-a-tensor"] * bool(tensors)
    if not kinds:
        return "nothing left to mutate"
    kind = pick(kinds)
    if kind in ("delete", "add", "retype", "nest"):
        return _generic(kind, entries, pick, integer)
    if kind == "swap":
        swappable = [n for n in nodes if isinstance(n.get("target"), dict) and n["target"].get("v") in _SWAPS]
        return _node(kind, pick(swappable), pick) if swappable else "nothing to swap"
    if kind in ("target", "op", "reference", "drop-meta"):
        return _node(kind, pick(nodes), pick)
    if kind in ("attribute", "rename", "class"):
        return _module(kind, pick(modules), pick)
    return _tensor(kind, pick(tensors), pick)


@pytest.fixture(scope="module")
def expected_shapes():
    shapes = {}
    for kind in _KINDS:
        model = lucid_fx.load(S.write(S.raw(kind)))
        with torch.no_grad():
            shapes[kind] = model(_input(kind)).shape
    return shapes


def _input(kind):
    return torch.randn(4, *S.KINDS[kind][1], generator=torch.Generator().manual_seed(0))


def _check_runs(model, kind, expected):
    x = _input(kind)
    with torch.no_grad():
        outputs = [model(x)]
        if kind in ("qat", "prepared"):
            outputs.append(lucid_fx.convert(model.eval())(x))
    for out in outputs:
        assert isinstance(out, torch.Tensor) and out.shape == expected and torch.isfinite(out).all(), out


@pytest.mark.parametrize("kind", _KINDS)
def test_a_mutated_file_is_refused_by_name_or_loads_a_model_that_runs(kind, expected_shapes):
    outcomes = []

    @settings(settings.get_profile("lucid_fx_load_fuzz"), max_examples=_EXAMPLES)
    @given(st.data())
    def run(data):
        S.reset_canary()
        tree = S.raw(kind)
        pick = lambda options: data.draw(st.sampled_from(options))  # noqa: E731
        integer = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
        done = [_mutate(tree, pick, integer) for _ in range(integer(1, 3))]
        note(f"{kind}: {done}")
        try:
            model = lucid_fx.load(S.write(tree))
        except ValueError as err:
            assert _LOCATION.match(str(err)), f"the message does not say where: {err}"
            outcomes.append("refused")
        else:
            _check_runs(model, kind, expected_shapes[kind])
            outcomes.append("ran")
        finally:
            assert not S.canary_fired(), "code from the file ran"

    run()
    # Both ends are exercised: most mutations break the file, some leave a model that must run.
    assert len(outcomes) >= _EXAMPLES and outcomes.count("ran") >= 1 and outcomes.count("refused") >= _EXAMPLES // 2, \
        {o: outcomes.count(o) for o in set(outcomes)}
