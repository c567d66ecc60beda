"""The op table and the rule tables agree: an op a rule observes has a lowering, or is declared
float by design with its reason; op groups are tags on the canonical OpDef, and the sets the rules
use are derived from them."""

import itertools
import math

import pytest

from lucid_fx import aliasing
from lucid_fx.ops import OP_DEFS, Tag, ops_tagged
from lucid_fx.passes import fold_batchnorm, insert_observers
from lucid_fx.rules import fusions, lowering, masks, observers
from lucid_fx.rules.fusions import FUSION_RULES
from lucid_fx.rules.lowering import LOWERINGS
from lucid_fx.rules.float_policies import FLOAT_BY_DESIGN
from lucid_fx.rules.movers import SHARED_OPS
from lucid_fx.rules.ranges import RANGE_RULES

CANONICAL = {op.name for op in OP_DEFS}
KEYS = {key for table in LOWERINGS.values() for key in table}


def _lowered(op: str) -> bool:
    """Whether convert has a rule for ``op`` on its own: its key, or the codes as they are."""
    return (op,) in KEYS or (op in SHARED_OPS and ("shared",) in KEYS)


def _observed_by_builtin_rules() -> dict:
    """op -> the kind of observer a built-in rule gives it where the rule applies."""
    found = {}
    for op in sorted(CANONICAL):
        if op in SHARED_OPS:
            found[op] = "shared"  # rules/observers.py: _shared
        elif any(op in rule.ops for rule in RANGE_RULES):
            found[op] = "fixed"  # _proven_interval, wherever its range rule proves an interval
        elif (op,) in KEYS:
            found[op] = "statistics"  # _statistics: an op with a lowering rule
    return found


def test_every_observed_op_has_a_lowering_or_is_float_by_design():
    observed = _observed_by_builtin_rules()
    drift = {op: kind for op, kind in observed.items() if not _lowered(op) and op not in FLOAT_BY_DESIGN}
    assert drift == {}, "observed, with no lowering rule and not declared float by design"
    # an op kept float on purpose is never observed, is a canonical op, and says why
    assert not FLOAT_BY_DESIGN.keys() & observed.keys()
    assert FLOAT_BY_DESIGN.keys() <= CANONICAL
    assert all(len(reason) > 20 for reason in FLOAT_BY_DESIGN.values())
    # the drift this test found, fixed: int8 pools and stack, observed silu and gelu; conv3d float by design
    assert {op: observed.get(op) for op in ("avg_pool2d", "avg_pool1d", "adaptive_avg_pool1d", "stack", "silu", "gelu")} == {
        "avg_pool2d": "fixed", "avg_pool1d": "fixed", "adaptive_avg_pool1d": "fixed", "stack": "fixed",
        "silu": "statistics", "gelu": "statistics",
    }
    assert "conv3d" in FLOAT_BY_DESIGN and "conv3d" not in observed


def test_every_fusion_pattern_lowers_as_one_kernel_or_holds_a_float_by_design_op():
    # A fused group is observed only at its end and lowered by the tuple of its ops; a batch norm
    # in it is folded into its conv or linear first.
    missing = []
    for rule in FUSION_RULES:
        for ops_in_order in itertools.product(*rule.pattern):
            key = tuple(op for op in ops_in_order if op != "batch_norm")
            if key not in KEYS and not FLOAT_BY_DESIGN.keys() & set(key):
                missing.append(f"{rule.name}: {'+'.join(ops_in_order)}")
    assert missing == []


def test_bounded_ops_have_a_range_rule_that_needs_no_input_bounds():
    rule_of = {op: rule for rule in RANGE_RULES for op in rule.ops}
    unknown = lambda name: None  # noqa: E731 - nothing is known about any argument

    class Call:  # clamp is bounded by its constant arguments
        args = {"min": -2.0, "max": 3.0}

    intervals = {op: rule_of[op].fn(unknown, Call) for op in sorted(ops_tagged(Tag.BOUNDED))}
    assert intervals == {
        "clamp": (-2.0, 3.0), "cos": (-1.0, 1.0), "hardsigmoid": (0.0, 1.0), "sigmoid": (0.0, 1.0),
        "sin": (-1.0, 1.0), "softmax": (0.0, 1.0), "softsign": (-1.0, 1.0), "tanh": (-1.0, 1.0),
        "erf": (-1.0, 1.0), "atan": (-math.pi / 2, math.pi / 2),
    }


def test_the_sets_rules_use_are_derived_from_tags():
    weighted = ops_tagged(Tag.WEIGHTED)
    assert weighted == {"linear", "conv1d", "conv2d", "conv3d"}
    assert fold_batchnorm._FOLDABLE == weighted  # a batch norm after any of them folds
    assert insert_observers._WEIGHTED == weighted - FLOAT_BY_DESIGN.keys()  # int8 weights where a kernel reads them
    assert masks._PRODUCTS == weighted | {"matmul", "grouped_mm", "conv_transpose2d"}  # its weight is (Cin, Cout, kh, kw): not WEIGHTED
    assert set(fusions._CONV) == ops_tagged(Tag.CONV) and set(lowering._CONVS) == ops_tagged(Tag.CONV) - {"conv3d"}
    assert lowering.SHAPE_OPS == observers.SHARED_OPS == ops_tagged(Tag.MOVES_CODES)
    assert aliasing.VIEW_OPS == ops_tagged(Tag.VIEW) < ops_tagged(Tag.MOVES_CODES)  # a view moves codes; max-pool too
    assert lowering.ELEMENTWISE_UNARY == ops_tagged(Tag.ELEMENTWISE) and {"silu", "gelu"} <= lowering.ELEMENTWISE_UNARY
    passthrough = next(rule for rule in RANGE_RULES if "reshape" in rule.ops)
    assert set(passthrough.ops) == ops_tagged(Tag.MOVES_CODES, Tag.AVERAGE)  # values stay inside the input's interval


@pytest.mark.parametrize("tag", list(Tag))
def test_every_tag_names_a_group(tag):
    assert ops_tagged(tag), f"no op is tagged {tag}"


def test_conv3d_runs_in_float_by_design_with_no_observer_and_no_conversion():
    import torch
    from torch import nn

    import lucid_fx
    from lucid_fx import _meta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 3, 3), nn.BatchNorm3d(3), nn.ReLU()).eval()
    x = torch.randn(1, 2, 5, 5, 5)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    decisions = {n.name: n.meta[_meta.DECISION] for n in prepared.graph.nodes if _meta.DECISION in n.meta}
    assert {name: d.kind.value for name, d in decisions.items()} == {
        "input_1": "none", "_0": "fused", "_1": "fused", "_2": "float", "output": "none",
    }
    assert decisions["_2"].reason == FLOAT_BY_DESIGN["conv3d"]
    assert len(prepared.lucid_fx_observers) == 0 and len(getattr(prepared, "lucid_fx_weight_observers", {})) == 0
    lucid_fx.calibrate(prepared, [x], progress=False)
    qmodel = lucid_fx.convert(prepared)
    calls = [n.op for n in qmodel.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert not [n for n in qmodel.graph.nodes if "quantize" in str(n.target)], "no conversion around a float op"
    assert calls == ["call_module", "call_module"]  # conv3d with the batch norm folded in, relu
    assert torch.allclose(qmodel(x), model(x), atol=1e-5)
