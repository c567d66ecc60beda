"""A torch.export capture called as the model was: ``forward`` with the model's own signature.

prepare exports a model with its inputs by name, the ones at their default left out
(lucid_fx/_capture.py), so the exported graph's own ``forward`` takes the captured names only, in
the order they were captured. A positional call then binds differently from the model:
GPT-2's ``model(ids, None, mask)`` failed, and ``model(ids, mask)`` gave ``mask`` to
``attention_mask`` where the model gives it to ``token_type_ids``: a silent wrong answer. And
torch.export fixes the graph for the values of non-tensor inputs (``use_cache=False``,
``scale=2.0``) where its guard, dropped by prepare, would have checked them.

:class:`SignatureCodeGen` writes ``forward`` with the model's parameters, in order, with their
defaults. Before the graph runs, it checks each input the graph was fixed for: a parameter left
at its default at capture must still be at it, a non-tensor input must have its captured value,
an input captured as a tensor must not be None; each failure is a ``TypeError`` saying what to
pass or to prepare again with. torch.export also fixes the graph to the example's shapes (its
reshapes and masks are of that size: the BERT-like model given a batch of 1 returned a batch of 2),
so a tensor input of another shape is a ``ValueError`` naming it and both shapes. Only literal defaults and values (None, bool, int, finite float,
str) are written into code: a parameter left at another default (``dtype=torch.float32``) is left
out of the signature, and every parameter after it is keyword-only, so no positional call binds
past it.

Where the signature cannot be written (``*args``, positional-only parameters, a parameter named
like a global the code reads, inputs given by position) and for an ``ExportedProgram`` given to
prepare, ``forward`` keeps torch.export's own call (the flattened inputs, by the names torch.export
gave them) and the same checks on what it flattens to: each tensor's shape, each non-tensor's
value. ``ExportedProgram.module()`` guards these too; prepare builds a new graph without its hooks.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, NoReturn, Optional, Sequence

import torch
import torch.fx._pytree as fx_pytree
from torch import fx

__all__ = ["SignatureCodeGen", "mirror_signature", "guard_inputs", "captured_names", "literal", "KINDS", "RESERVED"]

_LITERALS = (type(None), bool, int, float, str)
# Names the generated code reads as globals or builtins: a parameter of that name would shadow them.
RESERVED = frozenset(fx.graph._custom_builtins) | {"self", "type", "bool", "int", "float", "str", "TypeError",
                                                     "getattr", "operator", "math", "builtins"}
KINDS = ("positional", "keyword")  # POSITIONAL_OR_KEYWORD, KEYWORD_ONLY


def literal(value: Any) -> bool:
    return type(value) in _LITERALS and not (type(value) is float and not math.isfinite(value))


def captured_names(in_spec: Any) -> Optional[List[str]]:
    """The keyword names of an in_spec ``((), {name: ...})``; None for another call structure."""
    if in_spec.type is not tuple or in_spec.num_children != 2:
        return None
    args, kwargs = in_spec.child(0), in_spec.child(1)
    if args.type is not tuple or args.num_children or kwargs.type is not dict:
        return None
    return list(kwargs.context)


def mirror_signature(model: Any, gm: fx.GraphModule, captured: Optional[Dict[str, Any]]) -> None:
    """Give ``gm`` (exported from ``model`` with inputs ``captured`` by name) a forward with
    ``model.forward``'s signature where that signature can be written, else torch.export's own
    call; either way, with the input checks (see the module doc)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None:
        _install(gm, info, _parameters(model, info, captured))


def guard_inputs(gm: fx.GraphModule) -> None:
    """Give ``gm`` (an ``ExportedProgram.module()`` or a copy of it) the input checks, with
    torch.export's own call."""
    mirror_signature(None, gm, None)


def _install(gm: fx.GraphModule, info: Any, params: Optional[List[Dict[str, Any]]]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = {n.name: n.meta["val"] for n in placeholders if "val" in n.meta and literal(n.meta["val"])}
    gm.graph.set_codegen(SignatureCodeGen(info, params, [_static_shape(n) for n in placeholders], fixed))
    gm.recompile()


def _parameters(model: Any, info: Any, captured: Optional[Dict[str, Any]]) -> Optional[List[Dict[str, Any]]]:
    """``model.forward``'s parameters as :class:`SignatureCodeGen` takes them; None where they
    cannot be written (torch.export's own call stays)."""
    names = captured_names(info.in_spec)
    if model is None or captured is None or names is None or set(names) != set(captured):
        return None
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    params, gap = [], False
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) or p.name in RESERVED:
            return None
        if p.kind is p.VAR_KEYWORD:
            continue  # a call passes only the named parameters; extra keywords fail as Python says
        if p.name not in captured and p.default is not p.empty and not literal(p.default):
            gap = True  # left out (its default cannot be written as code): no positional call binds past it
            continue
        record = {"name": p.name, "captured": p.name in captured}
        if p.default is not p.empty and literal(p.default):
            record["default"] = p.default
        # a required parameter after one with a default (a captured one whose default was left out) is keyword-only
        gap = gap or ("default" not in record and any("default" in q and q["kind"] == "positional" for q in params))
        record["kind"] = "positional" if p.kind is p.POSITIONAL_OR_KEYWORD and not gap else "keyword"
        if p.name in captured and literal(captured[p.name]):
            record["fixed"] = captured[p.name]
        params.append(record)
    # a name captured through **kwargs, or in another order: torch.export's own call stays
    return params if [p["name"] for p in params if p["captured"]] == names else None


def _static_shape(placeholder: fx.Node) -> Optional[List[Optional[int]]]:
    """The shape torch.export recorded for an input (None for a dynamic dim: an ExportedProgram
    exported with ``dynamic_shapes``); None for an input that is not a tensor. A dim asked to be
    dynamic that the model's code fixed (``Dim.AUTO`` over Mamba's ``for i in range(seq_len)``)
    is a symbol whose value is known: it is static (unchecked, another length failed deep inside
    the graph with an IndexError)."""
    shape = getattr(placeholder.meta.get("val"), "shape", None)
    return None if shape is None else [_known_size(d) for d in shape]


def _known_size(d: Any) -> Optional[int]:
    if type(d) is int:
        return d
    return d.node.maybe_as_int() if isinstance(d, torch.SymInt) else None


def _shape_text(shape: Sequence[Optional[int]]) -> str:
    return "(" + ", ".join("any" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_test(name: str, shape: Sequence[Optional[int]]) -> tuple:
    """(code that is true when tensor ``name`` has another shape than ``shape``, the same test in Python)."""
    if all(d is not None for d in shape):
        return f"{name}.shape != {tuple(shape)!r}", lambda x: tuple(x.shape) != tuple(shape)
    fixed = [(i, d) for i, d in enumerate(shape) if d is not None]
    code = " or ".join([f"{name}.dim() != {len(shape)}"] + [f"{name}.shape[{i}] != {d}" for i, d in fixed])
    return code, lambda x: x.dim() != len(shape) or any(x.shape[i] != d for i, d in fixed)


def _equals(name: str, value: Any) -> tuple:
    """(code that is true when ``name`` is not ``value``, the same test in Python): None by
    identity, numbers by value (2 for 2.0; True only for True), strings by value."""
    if value is None:
        return f"{name} is not None", lambda x: x is not None
    kinds = ("bool",) if type(value) is bool else ("str",) if type(value) is str else ("int", "float")
    types = tuple({"bool": bool, "str": str, "int": int, "float": float}[k] for k in kinds)
    test = f"type({name}) not in ({', '.join(kinds)},) or {name} != {value!r}"
    return test, lambda x: type(x) not in types or x != value


def _fixed_message(name: str, value: Any) -> str:
    return (f"forward: {name} was {value!r} when prepare captured the model with torch.export, which "
            f"fixes the graph for that value; call with {name}={value!r}, or prepare again with the "
            f"value you need in the example inputs")


def _rule(p: Dict[str, Any]) -> tuple:
    """(the test a bad value for parameter ``p`` meets, as code; the same in Python; the error)."""
    name = p["name"]
    if not p["captured"]:
        value = p["default"]
        return (*_equals(name, value),
                f"forward: {name} was left at its default ({value!r}) when prepare captured the model with "
                f"torch.export, so the graph has no input for it; call with {name}={value!r}, or prepare "
                f"again with {name} in the example inputs")
    if "fixed" in p:
        return (*_equals(name, p["fixed"]), _fixed_message(name, p["fixed"]))
    return (f"{name} is None", lambda x: x is None,
            f"forward: {name} was given when prepare captured the model with torch.export, and the graph "
            f"needs it; pass {name}")


def _shape_message(name: str, shape: Sequence[Optional[int]]) -> str:
    """The error for input ``name`` of another shape than ``shape`` ("{}" stands for the shape given)."""
    start = f"forward: {name} has shape {{}}, but prepare captured the model with torch.export on shape {_shape_text(shape)}"
    if None not in shape or len(shape) == 0:
        return (f"{start}, which fixes the graph to it (its reshapes and masks are of that size); call with "
                "that shape (pad or split the batch), or prepare again with dynamic_shapes=\"auto\" (or on the shape "
                "you need)")
    fixed = ", ".join(str(i) for i, d in enumerate(shape) if d is not None)
    return (f"{start}: the graph is dynamic in the dims shown as 'any' and fixed to the example's size in dim {fixed} "
            "(not marked dynamic, or fixed by the model's code: a Python loop or branch over a size fixes it); call "
            "with those sizes (pad or split), or prepare again on the sizes you need")


_REFUSE = "_lucid_fx_refuse"  # the generated forward's name for refuse


def refuse(error: type, message: str) -> NoReturn:
    """Raise ``error(message)`` for a check of the generated forward. Raised there, torch.fx would print
    the generated code to stderr and drop the traceback (its ``_WrappedCall`` does so for an exception
    whose last frame is generated code); from here it is an ordinary exception."""
    raise error(message)


class SignatureCodeGen(fx.graph._PyTreeCodeGen):
    """A pytree codegen whose ``forward`` has the captured model's parameters (``params``, as
    lucid_fx/_pytree_spec.py's ``check_params`` validates them; None: torch.export's own call) and
    checks the inputs the graph was fixed for: ``shapes`` per placeholder (None: not a tensor, or
    not of a fixed shape), and ``fixed``, the literal value of each non-tensor placeholder."""

    def __init__(self, pytree_info: Any, params: Optional[Sequence[Dict[str, Any]]],
                 shapes: Sequence[Optional[List[int]]] = (), fixed: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(pytree_info)
        self.params = None if params is None else [dict(p) for p in params]
        self.shapes = [None if s is None else list(s) for s in shapes] or [None] * len(pytree_info.orig_args)
        self.fixed = dict(fixed or {})
        if self.params is not None:  # the parameters' own checks name them; the leaves they flatten to:
            self.fixed = self._fixed_leaves()

    def flat_call(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        """The placeholder values of a call ``forward(*args, **kwargs)`` (as forward binds it),
        checked as forward checks them."""
        if self.params is None:
            parameters = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in self.pytree_info.orig_args]
        else:
            parameters = [inspect.Parameter(p["name"], inspect.Parameter.POSITIONAL_OR_KEYWORD if p["kind"] == "positional"
                                            else inspect.Parameter.KEYWORD_ONLY, default=p.get("default", inspect.Parameter.empty))
                          for p in self.params]
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
        bound.apply_defaults()
        for p in self.params or ():
            _, bad, message = _rule(p)
            if bad(bound.arguments[p["name"]]):
                raise TypeError(message)
        flat = fx_pytree.tree_flatten_spec(self._structure(bound.arguments), self.pytree_info.in_spec)
        for value, name, shape in zip(flat, self.pytree_info.orig_args, self.shapes):
            if shape is not None and _shape_test(name, shape)[1](value):
                raise ValueError(_shape_message(name, shape).replace("{}", str(tuple(value.shape))))
            if self.params is None and name in self.fixed and _equals(name, self.fixed[name])[1](value):
                raise TypeError(_fixed_message(name, self.fixed[name]))
        return flat

    def _structure(self, arguments: Dict[str, Any]) -> Any:
        """The call's (args, kwargs) as the input spec flattens them."""
        if self.params is not None:
            return (), {p["name"]: arguments[p["name"]] for p in self.params if p["captured"]}
        values, spec = [arguments[n] for n in self.pytree_info.orig_args], self.pytree_info.in_spec
        if not (spec.type is tuple and spec.num_children == 2 and spec.child(0).type is tuple and spec.child(1).type is dict):
            return values  # as _PyTreeCodeGen.gen_var_bindings writes it
        count = spec.child(0).num_children
        return values[:count], dict(zip(spec.child(1).context, values[count:]))

    def _fixed_leaves(self) -> Dict[str, Any]:
        """The captured non-tensor values by placeholder name (each is one leaf of the input spec)."""
        leaves = iter(self.pytree_info.orig_args)
        fixed = {}
        for p, spec in zip([p for p in self.params if p["captured"]], self.pytree_info.in_spec.child(1).children()):
            names = [next(leaves) for _ in range(spec.num_leaves)]
            if "fixed" in p and len(names) == 1:
                fixed[names[0]] = p["fixed"]
        return fixed

    def fixed_inputs(self) -> Dict[str, Any]:
        """The captured non-tensor values by placeholder name."""
        return dict(self.fixed)

    def gen_fn_def(self, free_vars: List[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        targets = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        if self.params is None:  # torch.export's own call (its names are fx's, never a builtin's)
            code = super().gen_fn_def(free_vars, maybe_return_annotation, expanded_def=expanded_def)
        else:
            code = self._signature_def(targets, maybe_return_annotation)
        for name, shape in zip(self.pytree_info.orig_args, self.shapes):
            if shape is not None and name in targets:
                before, after = _shape_message(name, shape).split("{}")
                code += (f"\n    if {_shape_test(name, shape)[0]}:"
                         f"\n        {_REFUSE}(ValueError, {before!r} + str(tuple({name}.shape)) + {after!r})")
            if self.params is None and name in self.fixed and name in targets:
                code += f"\n    if {_equals(name, self.fixed[name])[0]}:\n        {_REFUSE}(TypeError, {_fixed_message(name, self.fixed[name])!r})"
        return code

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        code = super()._gen_python_code(*args, **kwargs)
        code.globals[_REFUSE] = refuse  # the checks' raise (gen_fn_def's code)
        return code

    def _signature_def(self, targets: List[str], maybe_return_annotation: str) -> str:
        parts, star = ["self"], False
        for p in self.params:
            if p["kind"] == "keyword" and not star:
                parts.append("*")
                star = True
            parts.append(p["name"] + (f"={p['default']!r}" if "default" in p else ""))
        code = f"def forward({', '.join(parts)}){maybe_return_annotation}:"
        for p in self.params:
            test, _, message = _rule(p)
            code += f"\n    if {test}:\n        {_REFUSE}(TypeError, {message!r})"
        names = [p["name"] for p in self.params if p["captured"]]
        values = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
        if targets:
            code += f"\n    {', '.join(targets)}, = fx_pytree.tree_flatten_spec(([], {values}), self._in_spec)"
        return code
