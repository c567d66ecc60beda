"""The registry: the rule tables prepare uses, and the public functions that extend them.

A :class:`Registry` holds copies of the built-in tables. ``lucid_fx.register_*`` add to the
*current* registry (the global default, or the one a ``with registry_scope():`` block made);
a later registration wins over an earlier or built-in one. Pass ``registry=`` to ``prepare``
to use one explicitly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple, Union

from torch import nn

from lucid_fx._where import caller_location
from lucid_fx.kernels.target import BACKENDS
from lucid_fx.ops import EXTRA_SPELLINGS, OP_DEFS, Spelling, derive_spellings
from lucid_fx.rules.fusions import FUSION_RULES, FusionRule, fusion
from lucid_fx.rules.lowering import LOWERINGS
from lucid_fx.rules.observers import Decision, DecisionKind, ObserverRule, compose_observer_rules
from lucid_fx.rules.ranges import RANGE_RULES, RangeRule

__all__ = [
    "Registry",
    "current_registry",
    "registry_scope",
    "register_op",
    "register_bounded_op",
    "register_fusion",
    "register_observer_rule",
    "register_float_op",
    "register_lowering",
]


# The kinds register_observer_rule takes by name: its own rules choose the observer, or none.
_ACTION_KINDS = (DecisionKind.STATISTICS, DecisionKind.SHARED, DecisionKind.FLOAT)


def _key(kind: str, target: Any) -> Tuple[str, Any]:
    return (kind, target)


@dataclass
class Registry:
    """Rule tables for one prepare: spellings, range rules, observer rules, fusions, float ops.

    The user's observer rules and fusions are kept apart from the built-in ones, in registration
    order; :attr:`observer_rules` and :attr:`fusion_rules` compose the tables prepare walks, so a
    user rule has no position to get wrong and the latest registration is tried first."""

    spellings: Dict[Tuple[str, Any], Spelling] = field(default_factory=dict)
    range_rules: Dict[str, RangeRule] = field(default_factory=dict)
    user_observer_rules: List[ObserverRule] = field(default_factory=list)
    user_fusion_rules: List[FusionRule] = field(default_factory=list)
    float_ops: Dict[str, str] = field(default_factory=dict)
    leaf_functions: List[Callable] = field(default_factory=list)
    leaf_modules: List[type] = field(default_factory=list)
    lowerings: Dict[str, Dict[Tuple[str, ...], Callable]] = field(default_factory=dict)

    @classmethod
    def builtin(cls) -> "Registry":
        reg = cls()
        for op in OP_DEFS:
            for spelling in derive_spellings(op):
                reg.spellings.setdefault(_key(spelling.kind, spelling.target), spelling)
        for spelling in EXTRA_SPELLINGS:  # explicit spellings override derived ones
            reg.spellings[_key(spelling.kind, spelling.target)] = spelling
        for rule in RANGE_RULES:
            for op in rule.ops:
                reg.range_rules[op] = rule
        reg.lowerings = {backend: dict(table) for backend, table in LOWERINGS.items()}
        return reg

    def copy(self) -> "Registry":
        return Registry(dict(self.spellings), dict(self.range_rules), list(self.user_observer_rules), list(self.user_fusion_rules),
                        dict(self.float_ops), list(self.leaf_functions), list(self.leaf_modules),
                        {backend: dict(table) for backend, table in self.lowerings.items()})

    @property
    def observer_rules(self) -> List[ObserverRule]:
        """Guards, then the user's rules (newest first), then the built-in op rules, then the fallback."""
        return compose_observer_rules(self.user_observer_rules)

    @property
    def fusion_rules(self) -> List[FusionRule]:
        """The user's fusions (newest first), then the built-in patterns: the first match wins."""
        return [*reversed(self.user_fusion_rules), *FUSION_RULES]

    def spelling_for(self, kind: str, target: Any) -> Optional[Spelling]:
        if kind == "call_module":
            for cls in type(target).__mro__ if not isinstance(target, type) else target.__mro__:
                found = self.spellings.get(_key(kind, cls))
                if found is not None:
                    return found
            return None
        try:
            return self.spellings.get(_key(kind, target))
        except TypeError:  # unhashable target
            return None

    def op_names(self) -> FrozenSet[str]:
        """Every op name a rule of this registry may key on: the spellings' canonical ops, the range rules' and
        the lowering tables' (the fused groups' members too)."""
        lowered = {op for table in self.lowerings.values() for key in table for op in key}
        return frozenset({s.op for s in self.spellings.values()} | set(self.range_rules) | lowered)

    def canonical_name(self, target: Any) -> Any:
        """The canonical op name for a user-facing op object (function, module class, method
        name or canonical name), or the object itself when it is not a known spelling."""
        if isinstance(target, str):
            if any(s.op == target for s in self.spellings.values()):
                return target
            found = self.spellings.get(_key("call_method", target))
            return found.op if found else target
        if isinstance(target, type) and issubclass(target, nn.Module):
            found = self.spelling_for("call_module", target)
        else:
            found = self.spelling_for("call_function", target)
        return found.op if found else target


_DEFAULT = Registry.builtin()
_STACK: List[Registry] = [_DEFAULT]


def current_registry() -> Registry:
    """The registry that ``register_*`` and ``prepare`` use now."""
    return _STACK[-1]


@contextlib.contextmanager
def registry_scope(registry: Optional[Registry] = None) -> Iterator[Registry]:
    """Registrations inside the block go to a copy of the current registry and vanish after it.

    >>> import lucid_fx
    >>> with lucid_fx.registry_scope() as reg:
    ...     _ = lucid_fx.register_float_op("tanh")
    ...     "tanh" in reg.float_ops
    True
    >>> "tanh" in lucid_fx.current_registry().float_ops
    False
    """
    reg = registry if registry is not None else current_registry().copy()
    _STACK.append(reg)
    try:
        yield reg
    finally:
        _STACK.remove(reg)


def _name_of(target: Any) -> str:
    return getattr(target, "__name__", None) or str(target)


def register_op(
    target: Any,
    op: Optional[str] = None,
    *,
    params: Sequence[str] = ("input",),
    consts: Any = None,
    registry: Optional[Registry] = None,
) -> str:
    """Declare ``target`` (a function, a method name, or an ``nn.Module`` class) as a spelling of
    canonical op ``op`` (default: the target's own name). Functions and module classes that are
    not torch's own are traced as leaves, so they appear as one node. Returns the op name.
    """
    reg = registry or current_registry()
    where = caller_location()
    name = op or _name_of(target)
    if isinstance(target, type) and issubclass(target, nn.Module):
        kind = "call_module"
        module_consts = consts if callable(consts) else (lambda m, c=dict(consts or {}): dict(c))
        spelling = Spelling(kind, target, name, ("input",), {}, module_consts, False, where)
        if not target.__module__.startswith("torch.nn"):
            reg.leaf_modules.append(target)
    elif isinstance(target, str):
        spelling = Spelling("call_method", target, name, tuple(params), {}, consts, target.endswith("_"), where)
    elif callable(target):
        spelling = Spelling("call_function", target, name, tuple(params), {}, consts, False, where)
        if not getattr(target, "__module__", "").startswith("torch"):
            reg.leaf_functions.append(target)
    else:
        raise ValueError(f"register_op: target must be a function, a method name or an nn.Module class, got {target!r}")
    reg.spellings[_key(spelling.kind, target)] = spelling
    return name


def register_bounded_op(
    target: Any,
    interval: Union[Tuple[float, float], Callable],
    *,
    op: Optional[str] = None,
    registry: Optional[Registry] = None,
) -> str:
    """Declare that ``target``'s output always lies in ``interval``, so it gets a
    FixedQParamsObserver. ``target`` is a canonical op name, or a function / module class /
    method name (registered as a new op named after it). ``interval`` may also be a range rule
    ``fn(arg, call) -> (lo, hi) | None``.

    >>> import torch, lucid_fx
    >>> def my_gate(x):
    ...     return torch.sigmoid(x) * torch.sigmoid(x)
    >>> with lucid_fx.registry_scope():
    ...     lucid_fx.register_bounded_op(my_gate, (0.0, 1.0))
    'my_gate'
    """
    reg = registry or current_registry()
    where = caller_location()
    if isinstance(target, str) and reg.canonical_name(target) == target and any(s.op == target for s in reg.spellings.values()):
        name = target
    else:
        name = register_op(target, op, registry=reg)
    if callable(interval):
        fn = interval
    else:
        lo, hi = (float(v) for v in interval)
        if not lo < hi:
            raise ValueError(f"register_bounded_op({name!r}): interval must have lo < hi, got {interval!r}")
        fn = lambda arg, call, _iv=(lo, hi): _iv  # noqa: E731
    reg.range_rules[name] = RangeRule((name,), fn, where)
    return name


def register_fusion(name: str, *steps: Union[str, Tuple[str, ...]], registry: Optional[Registry] = None) -> FusionRule:
    """Declare a chain of canonical ops (data-flow order) that runs as one kernel; only its last
    node is observed. Tried before the built-in patterns, the latest registration first; built by
    :func:`lucid_fx.rules.fusions.fusion`, as the built-in ones are."""
    reg = registry or current_registry()
    rule = fusion(name, *steps, where=caller_location())
    reg.user_fusion_rules.append(rule)
    return rule


def register_observer_rule(ops: Union[str, Sequence[str]], action: Union[str, Callable], *, registry: Optional[Registry] = None) -> ObserverRule:
    """Add an observer-choice rule for canonical ``ops``: tried after the guards (not a tensor,
    mutated in place, QConfig None, registered float op, inside a fused group), before the built-in
    op rules, the latest registration first (:func:`lucid_fx.rules.observers.compose_observer_rules`).

    ``action`` is a kind (``DecisionKind.STATISTICS``, ``SHARED`` or ``FLOAT``, or its value
    ``"statistics"``, ``"shared"``, ``"float"``) or a function ``(node, ctx) -> Decision | None``.
    """
    reg = registry or current_registry()
    where = caller_location()
    if isinstance(action, (str, DecisionKind)):
        kind = next((k for k in _ACTION_KINDS if action in (k, k.value)), None)
        if kind is None:
            raise ValueError(f"register_observer_rule: action must be 'statistics', 'shared', 'float' or a function, got {action!r}")
        action = lambda node, ctx, _k=kind: Decision(_k, f"registered rule: {_k.value}", qconfig=ctx.qconfig(node))  # noqa: E731
    action = _user_float_stays_float(action)
    ops_set = frozenset([ops] if isinstance(ops, str) else ops)
    rule = ObserverRule(ops_set, action, where)
    reg.user_observer_rules.append(rule)
    return rule


def _user_float_stays_float(action: Callable) -> Callable:
    """A user rule's "float" keeps the op itself float, even when its output is observed for an int8 reader."""
    import dataclasses

    def decide(node, ctx):
        decision = action(node, ctx)
        if decision is not None and decision.kind is DecisionKind.FLOAT and not decision.keep_float:
            decision = dataclasses.replace(decision, keep_float=True)
        return decision

    decide.__wrapped__ = action
    return decide


def register_float_op(target: Any, *, registry: Optional[Registry] = None) -> str:
    """Keep an op (canonical name, function, module class or method name) in float."""
    reg = registry or current_registry()
    name = reg.canonical_name(target)
    if not isinstance(name, str):
        name = register_op(target, registry=reg)
    reg.float_ops[name] = caller_location()
    return name



def register_lowering(
    ops: Union[str, Sequence[str]], rule: Callable, *, backend: str = "generic", registry: Optional[Registry] = None
) -> Tuple[str, ...]:
    """Lower canonical op ``ops`` (one name, or the ops of a fused group in data-flow order) with
    ``rule(ctx, members, resolve) -> QValue | None`` on ``backend`` ("generic", "cpu" or "cuda").
    A backend entry overrides the generic one; a later registration overrides an earlier one."""
    reg = registry or current_registry()
    if backend not in ("generic", *BACKENDS):
        valid = ", ".join(repr(b) for b in ("generic", *BACKENDS))
        raise ValueError(f"register_lowering: backend must be one of {valid}, got {backend!r}")
    if not callable(rule):
        raise ValueError(f"register_lowering: rule must be a function (ctx, members, resolve) -> QValue | None, got {rule!r}")
    key = (ops,) if isinstance(ops, str) else tuple(ops)
    reg.lowerings.setdefault(backend, {})[key] = rule
    return key
