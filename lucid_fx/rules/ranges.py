"""Value-range rules: how each canonical op maps input intervals to an output interval.

A rule is ``RangeRule(ops, fn)``; ``fn(arg, call)`` returns ``(lo, hi)`` or ``None`` (not
provably bounded). ``arg(name)`` gives the interval of an argument: a constant is a point, a
node its proven interval, and ``None`` when unknown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from lucid_fx import interval as I
from lucid_fx._where import caller_location
from lucid_fx.ops import Tag, ops_tagged

__all__ = ["RangeRule", "RANGE_RULES"]


@dataclass(frozen=True)
class RangeRule:
    ops: Tuple[str, ...]
    fn: Callable
    where: str


def rule(ops, fn) -> RangeRule:
    return RangeRule((ops,) if isinstance(ops, str) else tuple(ops), fn, caller_location())


def _const(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _clamp(arg, call):
    lo, hi = _const(call.args.get("min")), _const(call.args.get("max"))
    if lo is not None and hi is not None:
        inner = arg("input")
        return I.clip(inner, lo, hi) if I.is_bounded(inner) else (lo, hi)
    inner = arg("input")
    return I.clip(inner, lo, hi) if I.is_bounded(inner) else None


def _both(fn):
    """Binary rule that needs both operands bounded."""

    def apply(arg, call):
        a, b = arg("input"), arg("other")
        if I.is_bounded(a) and I.is_bounded(b):
            alpha = _const(call.args.get("alpha"))
            if alpha is not None and alpha != 1.0:
                b = I.mul(b, I.point(alpha))
            return fn(a, b)
        return None

    return apply


def _rsub(arg, call):
    a, b = arg("other"), arg("input")
    return I.sub(a, b) if I.is_bounded(a) and I.is_bounded(b) else None


def _passthrough(arg, call):
    return arg("input")


def _union_of_tensors(arg, call):
    ivs = arg("tensors")
    if isinstance(ivs, list) and ivs and all(I.is_bounded(iv) for iv in ivs):
        return I.union(*ivs)
    return None


def _relu(arg, call):
    inner = arg("input")
    return I.clip(inner, 0.0, None) if I.is_bounded(inner) else None


def _monotone(fn):
    def apply(arg, call):
        inner = arg("input")
        return I.monotone(fn, inner) if I.is_bounded(inner) else None

    return apply


def _abs(arg, call):
    a = arg("input")
    if not I.is_bounded(a):
        return None
    lo = 0.0 if a[0] <= 0.0 <= a[1] else min(abs(a[0]), abs(a[1]))
    return (lo, max(abs(a[0]), abs(a[1])))


def _squashing(fn, lo: float, hi: float):
    """An increasing function into [lo, hi]: that interval whatever the input, the image of a bounded one."""
    def apply(arg, call):
        inner = arg("input")
        return I.monotone(fn, inner) if I.is_bounded(inner) else (lo, hi)

    return apply


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


RANGE_RULES: List[RangeRule] = [
    rule("sigmoid", _squashing(_sigmoid, 0.0, 1.0)),  # sigmoid(x) in [0, 1]
    rule("hardsigmoid", _squashing(lambda v: min(max(v / 6 + 0.5, 0.0), 1.0), 0.0, 1.0)),  # hardsigmoid(x) in [0, 1]
    rule("softmax", lambda arg, call: (0.0, 1.0)),  # softmax(x, dim) in [0, 1], any dim
    rule("tanh", _squashing(math.tanh, -1.0, 1.0)),  # tanh(x) in [-1, 1]
    rule("softsign", _squashing(lambda v: v / (1 + abs(v)), -1.0, 1.0)),  # x / (1 + |x|) in [-1, 1]
    rule(("sin", "cos"), lambda arg, call: (-1.0, 1.0)),  # sin, cos in [-1, 1]
    rule("erf", _squashing(math.erf, -1.0, 1.0)),  # erf(x) in [-1, 1]
    rule("atan", _squashing(math.atan, -math.pi / 2, math.pi / 2)),  # atan(x) in [-pi/2, pi/2]
    rule("clamp", _clamp),  # clamp(x, a, b) in [a, b]; relu6 and hardtanh are clamps
    rule("relu", _relu),  # relu([a, b]) = [max(a, 0), max(b, 0)]
    rule("add", _both(I.add)),  # [a, b] + [c, d] = [a + c, b + d]
    rule("sub", _both(I.sub)),  # [a, b] - [c, d] = [a - d, b - c]; 1 - sigmoid(x) in [0, 1]
    rule("rsub", _rsub),  # rsub(x, c) = c - x
    rule("mul", _both(I.mul)),  # interval product
    rule("div", _both(I.div)),  # interval quotient, unbounded if the divisor spans 0
    rule("neg", lambda arg, call: I.neg(arg("input")) if I.is_bounded(arg("input")) else None),  # -[a, b] = [-b, -a]
    rule("minimum", _both(lambda a, b: (min(a[0], b[0]), min(a[1], b[1])))),  # min of intervals
    rule("maximum", _both(lambda a, b: (max(a[0], b[0]), max(a[1], b[1])))),  # max of intervals
    rule("exp", _monotone(math.exp)),  # exp is increasing
    rule("abs", _abs),  # |[a, b]|
    rule(sorted(ops_tagged(Tag.MOVES_CODES, Tag.AVERAGE)), _passthrough),  # shape ops, pools, means: inside the input's interval
    rule(("cat", "stack"), _union_of_tensors),  # cat of bounded inputs: their hull
]
