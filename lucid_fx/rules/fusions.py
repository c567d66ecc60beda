"""Fusion patterns: chains of canonical ops that run as one quantized kernel, so only the last
node's output is observed. A pattern lists ops in data-flow order; each op may be a tuple of
alternatives. Conv + batch-norm groups are folded into the conv
at convert (passes/fold_batchnorm.py); at prepare the group is observed only at its end. A masked
softmax observes its unmasked scores (the group's input) and reads its mask in float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from lucid_fx._where import caller_location
from lucid_fx.ops import Tag, ops_tagged
from lucid_fx.rules.masks import MASKED_SOFTMAX

__all__ = ["FusionRule", "FUSION_RULES", "fusion"]

Step = Union[str, Tuple[str, ...]]
_CONV = tuple(sorted(ops_tagged(Tag.CONV)))  # conv1d, conv2d, conv3d
# conv + add runs as one kernel only in 2-d (lucid_fx.conv2d_add); a conv1d + add fused would have
# no lowering and run wholly in float, unfused its conv and its add each run in int8.
_CONV_ADD = ("conv2d",)


@dataclass(frozen=True)
class FusionRule:
    name: str
    pattern: Tuple[Tuple[str, ...], ...]
    where: str


def fusion(name: str, *steps: Step, where: Optional[str] = None) -> FusionRule:
    """A pattern of ``steps`` (each an op or a tuple of alternatives), defined at ``where`` (default:
    the caller's file:line). The built-in table and ``lucid_fx.register_fusion`` both build with it."""
    if len(steps) < 2:
        raise ValueError(f"fusion({name!r}): a pattern needs at least two ops, got {steps!r}")
    pattern = tuple((s,) if isinstance(s, str) else tuple(s) for s in steps)
    return FusionRule(name, pattern, where or caller_location())


# Longer patterns first: the first rule that matches at a node wins. Patterns with batch_norm are
# observed as one group at prepare (outputs stay bit-exact) and folded at convert. Every pattern
# has a lowering (tests/test_op_table.py): relu(linear(x) + y) is a linear, then an add_relu.
# Activations a weighted op's kernel applies in float before it requantizes (one rounding fewer than
# a table after it; oneDNN's qlinear/qconv post-ops). A linear also takes gelu (both forms): a transformer's
# MLP, whose gelu input then needs no grid of its own (the encoder block: 49.6 -> 51.1 dB SQNR). A tanh or
# sigmoid after a linear keeps its input observed: convert makes it the linear's post-op where that
# input's grid was only an intermediate (rules/lowering_elementwise.py), its grid narrowed as before.
_ACTIVATIONS = ("hardswish", "silu")

FUSION_RULES: List[FusionRule] = [
    fusion("conv_bn_add_relu", _CONV_ADD, "batch_norm", "add", "relu"),  # relu(bn(conv(x)) + y)
    fusion("conv_bn_relu", _CONV, "batch_norm", "relu"),  # relu(bn(conv(x)))
    fusion("conv_bn_act", _CONV, "batch_norm", _ACTIVATIONS),  # hardswish/silu(bn(conv(x))): oneDNN post-ops
    fusion("conv_bn_add", _CONV_ADD, "batch_norm", "add"),  # bn(conv(x)) + y
    fusion("conv_bn", _CONV, "batch_norm"),  # bn(conv(x)) -> conv with folded weights
    fusion("linear_bn", "linear", "batch_norm"),  # bn(linear(x)) -> linear with folded weights
    fusion("conv_add_relu", _CONV_ADD, "add", "relu"),  # relu(conv(x) + y) -> one kernel (residual block)
    fusion("conv_add", _CONV_ADD, "add"),  # conv(x) + y
    fusion("conv_relu", _CONV, "relu"),  # relu(conv(x))
    fusion("linear_relu", "linear", "relu"),  # relu(linear(x))
    fusion("conv_act", _CONV, _ACTIVATIONS),  # hardswish/silu(conv(x)) -> one kernel with the post-op
    fusion("linear_act", "linear", (*_ACTIVATIONS, "gelu")),  # hardswish/silu/gelu(linear(x)) -> one kernel with the post-op
    fusion("add_relu", "add", "relu"),  # relu(x + y)
    fusion("mul_relu", "mul", "relu"),  # relu(x * y)
    fusion(MASKED_SOFTMAX, ("masked_fill", "add"), "softmax"),  # softmax(s.masked_fill(m, v) or s + m), m in float
]
