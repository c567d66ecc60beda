"""Differential test: lucid_fx.prepare against torch.ao's prepare_fx as an oracle.

torch.ao.quantization (deprecated, still working on the torch this project pins) is used only
here, as a reference; the product never imports it. Both sides prepare the same small eval-mode
models with their default x86 / cpu mappings and the same example inputs, and every original op
node is classified by what observes its output:

* ``fixed``       a FixedQParamsObserver / FixedQParamsFakeQuantize follows the node;
* ``statistics``  another observer follows it;
* ``shared``      the observer that follows it is the very same module instance as the one on
                  its (first tensor) input;
* ``fused``       no observer: the node is inside a fused group whose last node is observed;
* ``float``       no observer otherwise (runs in float, or is not a float tensor).

lucid_fx's kind comes from ``lucid_fx.explain(prepared).by_node()`` (and is cross-checked against
lucid_fx's own prepared graph with the same structural classifier as torch.ao's). torch.ao fuses
conv+bn(+relu) and linear+relu into one module named after the group's first node, so its decision
is compared at the group's last node, the only one lucid_fx observes.

Every node must agree, except the deliberate differences listed in ``DIFFERENCES`` (one line of
reason each); those are asserted too, so the test fails if either side changes.
"""

from __future__ import annotations

import copy
import warnings
from typing import Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx.quantization.fake_quantize import FixedQParamsFakeQuantize as LucidFixedFQ
from lucid_fx.quantization.observers import FixedQParamsObserver as LucidFixedObserver

# --------------------------------------------------------------------------------------------
# Models (plain torch, eval mode, small)
# --------------------------------------------------------------------------------------------


class ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class ConvReluPoolLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)) + x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(32, 32)
        self.relu2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))


class SigmoidTanhHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 4)
        self.sig = nn.Sigmoid()
        self.fc2 = nn.Linear(16, 4)
        self.tanh = nn.Tanh()

    def forward(self, x):
        return self.sig(self.fc1(x)), self.tanh(self.fc2(x))


class Softmaxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 4)
        self.sm = nn.Softmax(dim=-1)
        self.fc2 = nn.Linear(16, 4)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        return self.sm(self.fc1(x)), F.softmax(self.fc2(x), dim=-1), torch.softmax(self.fc3(x), dim=-1)


class ReluAfterPool(nn.Module):
    """relu after ops it cannot fuse with: a max pool, and a graph input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(torch.flatten(self.relu(self.pool(self.conv(x))), 1)), F.relu(x)


class BoundedArithmetic(nn.Module):
    """Ops whose output range is provable from a bounded input."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.hs = nn.Hardsigmoid()

    def forward(self, x):
        a = torch.sigmoid(self.fc1(x)) + 1  # in [1, 2]
        b = torch.tanh(self.fc2(x)) * 2  # in [-2, 2]
        c = self.hs(x).mean(dim=1)  # in [0, 1]
        return a, b, c, F.relu6(x), torch.clamp(x, 0, 1)


MODELS = {
    "conv_bn_relu": (ConvBnRelu, (1, 3, 8, 8)),
    "conv_relu_pool_flatten_linear": (ConvReluPoolLinear, (1, 3, 8, 8)),
    "residual_conv_bn_add_relu": (ResidualBlock, (1, 8, 8, 8)),
    "mlp_linear_relu": (MLP, (2, 16)),
    "sigmoid_tanh_heads": (SigmoidTanhHeads, (2, 16)),
    "softmax": (Softmaxes, (2, 16)),
    "relu_after_pool": (ReluAfterPool, (1, 3, 8, 8)),
    "bounded_arithmetic": (BoundedArithmetic, (2, 8)),
}

# --------------------------------------------------------------------------------------------
# Deliberate differences: (model, node) -> (lucid_fx kind, torch.ao kind, reason)
# --------------------------------------------------------------------------------------------

DIFFERENCES: Dict[Tuple[str, str], Tuple[str, str, str]] = {
    ("residual_conv_bn_add_relu", "bn"): (
        "fused", "statistics",
        "lucid_fx fuses conv+bn+add+relu into one kernel; torch.ao x86 fuses only conv+bn and observes its output before add+relu",
    ),
    ("softmax", "softmax"): (
        "fixed", "float",
        "F.softmax is proven in [0, 1] by lucid_fx; torch.ao's x86 config only knows nn.Softmax and leaves F.softmax float",
    ),
    ("softmax", "softmax_1"): (
        "fixed", "float",
        "torch.softmax: same as F.softmax, torch.ao has no entry for the function spelling",
    ),
    ("relu_after_pool", "relu"): (
        "statistics", "shared",
        "relu after a non-fusable op: lucid_fx observes its clipped range; torch.ao shares the input's observer (wastes half the grid)",
    ),
    ("relu_after_pool", "relu_1"): (
        "statistics", "shared",
        "F.relu on a graph input: same policy as above (relu is an int8 op in lucid_fx, a share-qparams op in torch.ao)",
    ),
    ("bounded_arithmetic", "x"): (
        "statistics", "fixed+statistics",
        "torch.ao gives hardsigmoid's graph input a second, fixed [0, 1] input observer (clipping x); lucid_fx observes x once",
    ),
    ("bounded_arithmetic", "relu6"): (
        "fixed", "shared",
        "F.relu6 is proven in [0, 6] by lucid_fx; torch.ao shares the input's statistics observer",
    ),
    ("bounded_arithmetic", "clamp"): (
        "fixed", "shared",
        "torch.clamp(x, 0, 1) is proven in [0, 1] by lucid_fx; torch.ao shares the input's statistics observer",
    ),
}

# Nodes both sides observe with a fixed-qparams observer, but with different qparams:
# (model, node) -> ((lucid scale, zp), (torch.ao scale, zp), reason)
QPARAM_DIFFERENCES: Dict[Tuple[str, str], Tuple[Tuple[float, int], Tuple[float, int], str]] = {
    ("bounded_arithmetic", "add"): (
        (2.0 / 256, 0), (1.0 / 256, 0),
        "sigmoid(x) + 1 is in [1, 2]: lucid_fx propagates the interval; torch.ao reuses sigmoid's [0, 1] observer and clips",
    ),
    ("bounded_arithmetic", "mul"): (
        (4.0 / 256, 128), (2.0 / 256, 128),
        "tanh(x) * 2 is in [-2, 2]: lucid_fx propagates the interval; torch.ao reuses tanh's [-1, 1] observer and clips",
    ),
}

# Canonical ops torch.ao may fuse into the op that consumes them (add+relu, ...): an unobserved
# node of one of these kinds whose single user is observed counts as "fused" on the torch.ao side.
_FUSABLE_OPS = {"add", "mul", "conv1d", "conv2d", "conv3d", "linear", "batch_norm"}

# --------------------------------------------------------------------------------------------
# Preparing and classifying
# --------------------------------------------------------------------------------------------


def _model_and_input(name: str):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    return model, (torch.randn(*shape),)


def _torch_ao_prepare(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices (the oracle)
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import prepare_fx

        return prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), example_inputs)


def _ao_observer_types():
    from torch.ao.quantization.fake_quantize import FakeQuantizeBase, FixedQParamsFakeQuantize
    from torch.ao.quantization.observer import FixedQParamsObserver, ObserverBase

    return (ObserverBase, FakeQuantizeBase), (FixedQParamsObserver, FixedQParamsFakeQuantize)


class _Structure:
    """Classifies the nodes of a prepared graph by the observer modules that follow them."""

    def __init__(self, gm: fx.GraphModule, is_observer, fixed_types):
        self.gm, self.is_observer, self.fixed_types = gm, is_observer, fixed_types
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def observer_of(self, node: fx.Node) -> Optional[nn.Module]:
        if node.op == "call_module" and self.is_observer(node.target):
            return self.gm.get_submodule(node.target)
        return None

    def observers_after(self, node: fx.Node):
        found = []
        for user in node.users:
            module = self.observer_of(user)
            if module is not None and all(module is not m for m in found):
                found.append(module)
        return found

    def input_observer(self, node: fx.Node) -> Optional[nn.Module]:
        for arg in node.all_input_nodes:
            return self.observer_of(arg)
        return None

    def kind(self, node: fx.Node) -> Optional[str]:
        """fixed / statistics / shared, or None when no observer follows the node."""
        observers = self.observers_after(node)
        if not observers:
            return None
        kinds = set()
        for observer in observers:
            if isinstance(observer, self.fixed_types):
                kinds.add("fixed")
            elif observer is self.input_observer(node):
                kinds.add("shared")
            else:
                kinds.add("statistics")
        return "+".join(sorted(kinds))


def _lucid_structure(prepared: fx.GraphModule) -> _Structure:
    return _Structure(prepared, lambda t: t.startswith("lucid_fx_observers."), (LucidFixedObserver, LucidFixedFQ))


def _ao_structure(prepared: fx.GraphModule) -> _Structure:
    observer_types, fixed_types = _ao_observer_types()

    def is_observer(target: str) -> bool:
        return isinstance(prepared.get_submodule(target), observer_types)

    return _Structure(prepared, is_observer, fixed_types)


def _torch_ao_kinds(model: nn.Module, ao: fx.GraphModule, canonical_ops: Dict[str, str]) -> Dict[str, str]:
    """torch.ao's decision for every node of the original trace, at lucid_fx's granularity."""
    structure = _ao_structure(ao)
    original = fx.symbolic_trace(copy.deepcopy(model)).graph
    kinds: Dict[str, str] = {}
    # Module fusion removed the group's tail nodes; the head (first node) carries the group's observer.
    group_end: Dict[str, str] = {}
    for node in original.nodes:
        if node.op == "output" or node.name in structure.nodes:
            continue
        head = node.all_input_nodes[0]
        while head.name not in structure.nodes:
            head = head.all_input_nodes[0]
        group_end[head.name] = node.name  # nodes come in order: the last one wins
        kinds[node.name] = "fused"
    for node in original.nodes:
        if node.op == "output" or node.name not in structure.nodes:
            continue
        ao_node = structure.nodes[node.name]
        kind = structure.kind(ao_node)
        if kind is None:
            users = list(ao_node.users)
            fused = (
                canonical_ops.get(node.name) in _FUSABLE_OPS
                and len(users) == 1
                and structure.kind(users[0]) == "statistics"
            )
            kind = "fused" if fused else "float"
        if node.name in group_end:
            kinds[group_end[node.name]] = kind
            kind = "fused"
        kinds[node.name] = kind
    return kinds


def _lucid_kind(row: Dict[str, str]) -> str:
    return "float" if row["kind"] == "none" else row["kind"]


_CACHE: Dict[str, tuple] = {}


def _prepared(name: str):
    if name not in _CACHE:
        model, example_inputs = _model_and_input(name)
        lucid = lucid_fx.prepare(model, example_inputs=example_inputs)
        rows = lucid_fx.explain(lucid).by_node()
        ao = _torch_ao_prepare(model, example_inputs)
        ao_kinds = _torch_ao_kinds(model, ao, {n: r["op"] for n, r in rows.items()})
        _CACHE[name] = (model, example_inputs, lucid, rows, ao, ao_kinds)
    return _CACHE[name]


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decisions_agree_with_torch_ao(name):
    """Per node: lucid_fx's kind equals torch.ao's, except the listed deliberate differences."""
    _, _, _, rows, _, ao_kinds = _prepared(name)
    assert set(rows) == set(ao_kinds), "both sides must see the same original nodes"
    mismatches = []
    for node, row in rows.items():
        lucid, ao = _lucid_kind(row), ao_kinds[node]
        expected = DIFFERENCES.get((name, node))
        if expected is None:
            if lucid != ao:
                mismatches.append(f"{node} ({row['op']}): lucid_fx {lucid}, torch.ao {ao}")
        elif (lucid, ao) != expected[:2]:
            mismatches.append(
                f"{node} ({row['op']}): listed difference changed: expected lucid_fx {expected[0]} / torch.ao "
                f"{expected[1]}, got lucid_fx {lucid} / torch.ao {ao}"
            )
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fixed_qparams_agree_with_torch_ao(name):
    """Where both use a fixed-qparams observer, scale and zero point match (or differ as listed)."""
    _, _, lucid, rows, ao, _ = _prepared(name)
    lucid_s, ao_s = _lucid_structure(lucid), _ao_structure(ao)
    checked = 0
    for node, row in rows.items():
        if row["kind"] != "fixed" or node not in ao_s.nodes:
            continue
        ao_observers = [o for o in ao_s.observers_after(ao_s.nodes[node]) if isinstance(o, ao_s.fixed_types)]
        if not ao_observers:
            continue
        scale, zp = lucid.lucid_fx_observers[node].calculate_qparams()
        ao_scale, ao_zp = ao_observers[0].calculate_qparams()
        got = ((float(scale), int(zp)), (float(ao_scale), int(ao_zp)))
        expected = QPARAM_DIFFERENCES.get((name, node))
        if expected is None:
            assert got[0] == pytest.approx(got[1]), f"{node}: lucid_fx {got[0]} vs torch.ao {got[1]}"
        else:
            assert got[0] == pytest.approx(expected[0]) and got[1] == pytest.approx(expected[1]), (
                f"{node}: listed qparam difference changed: got lucid_fx {got[0]} / torch.ao {got[1]}"
            )
        checked += 1
    listed = [node for (model, node) in QPARAM_DIFFERENCES if model == name]
    assert checked >= len(listed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_explain_matches_lucid_graph(name):
    """explain's kind is what lucid_fx's prepared graph actually does (same classifier as torch.ao's)."""
    _, _, lucid, rows, _, _ = _prepared(name)
    structure = _lucid_structure(lucid)
    for node, row in rows.items():
        observed = structure.kind(structure.nodes[node])
        if row["kind"] in ("fused", "float", "none"):
            assert observed is None, f"{node}: explain says {row['kind']} but {observed} observer follows it"
        elif row["kind"] == "shared":
            assert observed in ("shared", "fixed"), f"{node}: explain says shared, graph has {observed}"
            assert structure.observers_after(structure.nodes[node])[0] is structure.input_observer(structure.nodes[node])
        else:
            assert observed == row["kind"], f"{node}: explain says {row['kind']}, graph has {observed}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prepared_models_compute_the_float_model(name):
    """Both prepared models compute the float model: lucid_fx bit-exactly (batch norm is folded only
    at convert), torch.ao up to rounding (it folds batch norm into the conv at prepare)."""
    model, example_inputs, lucid, _, ao, _ = _prepared(name)

    def outputs(m):
        out = m(*example_inputs)
        return out if isinstance(out, tuple) else (out,)

    with torch.no_grad():
        expected, got_lucid, got_ao = outputs(model), outputs(lucid), outputs(ao)
    assert len(got_lucid) == len(got_ao) == len(expected)
    for e, g in zip(expected, got_lucid):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for e, g in zip(expected, got_ao):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_difference_tables_are_real_differences():
    """Every listed difference names an existing node, differs, and carries a one-line reason."""
    for (model, node), (lucid, ao, reason) in DIFFERENCES.items():
        assert model in MODELS and lucid != ao and reason and "\n" not in reason
        assert node in _prepared(model)[3], f"{model}: no node {node}"
    for (model, node), (lucid, ao, reason) in QPARAM_DIFFERENCES.items():
        assert model in MODELS and lucid != ao and reason and "\n" not in reason


class _ChunkThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x):
        a, b = self.fc(x).chunk(2, dim=-1)
        return torch.cat([self.fc2(a), b], dim=1)


def test_getitem_of_chunk_feeding_a_quantized_op_is_observed():
    torch.manual_seed(0)
    model, x = _ChunkThenLinear().eval(), torch.randn(2, 8)
    structure = _lucid_structure(lucid_fx.prepare(model, example_inputs=(x,)))
    ao = _ao_structure(_torch_ao_prepare(model, (x,)))
    for name in ("getitem", "getitem_1"):
        assert ao.kind(ao.nodes[name]) is not None  # the oracle observes it
        assert structure.kind(structure.nodes[name]) is not None, f"{name} feeds a quantized op unobserved"
