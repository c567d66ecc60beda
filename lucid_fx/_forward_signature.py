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
past it; a signature with ``*args`` or positional-only parameters keeps torch.export's own call.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch.fx._pytree as fx_pytree
import torch.utils._pytree as pytree
from torch import fx

__all__ = ["SignatureCodeGen", "mirror_signature", "check_params", "check_shapes", "export_call", "restore_signature"]

_LITERALS = (type(None), bool, int, float, str)
# Names the generated code reads as globals or builtins: a parameter of that name would shadow them.
_RESERVED = frozenset(fx.graph._custom_builtins) | {"self", "type", "bool", "int", "float", "str", "TypeError",
                                                     "getattr", "operator", "math", "builtins"}
_KINDS = ("positional", "keyword")  # POSITIONAL_OR_KEYWORD, KEYWORD_ONLY


def _literal(value: Any) -> bool:
    return type(value) in _LITERALS and not (type(value) is float and not math.isfinite(value))


def _captured_names(in_spec: Any) -> Optional[List[str]]:
    """The keyword names of an in_spec ``((), {name: ...})``; None for another call structure."""
    if in_spec.type is not tuple or in_spec.num_children != 2:
        return None
    args, kwargs = in_spec.child(0), in_spec.child(1)
    if args.type is not tuple or args.num_children or kwargs.type is not dict:
        return None
    return list(kwargs.context)


def check_params(params: Any, in_spec: Any, where: str) -> List[Dict[str, Any]]:
    """``params`` as a valid parameter list for ``in_spec``, or a ValueError naming ``where``:
    load holds a file's record to this before any of it becomes code."""
    if not isinstance(params, list) or not params:
        raise ValueError(f"{where}: the forward signature is not a list of parameters")
    seen, keyword_only, defaulted = set(), False, False
    for p in params:
        if not (isinstance(p, dict) and set(p) <= {"name", "kind", "default", "fixed", "captured"}
                and {"name", "kind", "captured"} <= set(p)):
            raise ValueError(f"{where}: malformed forward parameter {p!r:.80}")
        name = p["name"]
        if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name not in _RESERVED):
            raise ValueError(f"{where}: forward parameter name {name!r:.60} is not a Python identifier the code can take")
        if name in seen or p["kind"] not in _KINDS or type(p["captured"]) is not bool:
            raise ValueError(f"{where}: forward parameter {name!r} is repeated or malformed")
        for key in ("default", "fixed"):
            if key in p and not _literal(p[key]):
                raise ValueError(f"{where}: forward parameter {name!r} has a {key} that is not a literal")
        if p["kind"] == "positional" and keyword_only:
            raise ValueError(f"{where}: positional parameter {name!r} after a keyword-only one")
        if not p["captured"] and ("default" not in p or "fixed" in p):
            raise ValueError(f"{where}: forward parameter {name!r} was not captured and has no default")
        if p["kind"] == "positional" and "default" not in p and defaulted:
            raise ValueError(f"{where}: positional parameter {name!r} without a default follows one with a default")
        keyword_only = keyword_only or p["kind"] == "keyword"
        defaulted = defaulted or (p["kind"] == "positional" and "default" in p)
        seen.add(name)
    if _captured_names(in_spec) != [p["name"] for p in params if p["captured"]]:
        raise ValueError(f"{where}: the forward signature does not fit the graph's inputs")
    return params


def check_shapes(shapes: Any, placeholders: int, where: str) -> List[Optional[List[int]]]:
    """``shapes`` as one shape (a list of sizes) or None per placeholder, or a ValueError naming ``where``."""
    if not (isinstance(shapes, list) and len(shapes) == placeholders and all(
            s is None or (isinstance(s, list) and all(type(d) is int and d >= 0 for d in s)) for s in shapes)):
        raise ValueError(f"{where}: the input shapes are not one list of sizes (or None) per input")
    return shapes


def mirror_signature(model: Any, gm: fx.GraphModule, captured: Dict[str, Any]) -> None:
    """Give ``gm`` (exported from ``model`` with inputs ``captured`` by name) a forward with
    ``model.forward``'s signature, where that signature can be written (see the module doc)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    names = None if info is None else _captured_names(info.in_spec)
    if names is None or set(names) != set(captured):
        return
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params, gap = [], False
    for p in signature.parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) or p.name in _RESERVED:
            return
        if p.kind is p.VAR_KEYWORD:
            continue  # a call passes only the named parameters; extra keywords fail as Python says
        if p.name not in captured and p.default is not p.empty and not _literal(p.default):
            gap = True  # left out (its default cannot be written as code): no positional call binds past it
            continue
        record = {"name": p.name, "captured": p.name in captured}
        if p.default is not p.empty and _literal(p.default):
            record["default"] = p.default
        # a required parameter after one with a default (a captured one whose default was left out) is keyword-only
        gap = gap or ("default" not in record and any("default" in q and q["kind"] == "positional" for q in params))
        record["kind"] = "positional" if p.kind is p.POSITIONAL_OR_KEYWORD and not gap else "keyword"
        if p.name in captured and _literal(captured[p.name]):
            record["fixed"] = captured[p.name]
        params.append(record)
    if [p["name"] for p in params if p["captured"]] != names:
        return  # a name captured through **kwargs, or in another order: torch.export's own call stays
    gm.graph.set_codegen(SignatureCodeGen(info, params, [_static_shape(n) for n in gm.graph.nodes if n.op == "placeholder"]))
    gm.recompile()


def _static_shape(placeholder: fx.Node) -> Optional[List[int]]:
    """The shape torch.export recorded for an input, where every dim is a number (None otherwise)."""
    value = placeholder.meta.get("val")
    shape = getattr(value, "shape", None)
    return None if shape is None or not all(type(d) is int for d in shape) else list(shape)


def _equals(name: str, value: Any) -> tuple:
    """(code that is true when ``name`` is not ``value``, the same test in Python): None by
    identity, numbers by value (2 for 2.0; True only for True), strings by value."""
    if value is None:
        return f"{name} is not None", lambda x: x is not None
    kinds = ("bool",) if type(value) is bool else ("str",) if type(value) is str else ("int", "float")
    types = tuple({"bool": bool, "str": str, "int": int, "float": float}[k] for k in kinds)
    test = f"type({name}) not in ({', '.join(kinds)},) or {name} != {value!r}"
    return test, lambda x: type(x) not in types or x != value


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
        value = p["fixed"]
        return (*_equals(name, value),
                f"forward: {name} was {value!r} when prepare captured the model with torch.export, which "
                f"fixes the graph for that value; call with {name}={value!r}, or prepare again with the "
                f"value you need in the example inputs")
    return (f"{name} is None", lambda x: x is None,
            f"forward: {name} was given when prepare captured the model with torch.export, and the graph "
            f"needs it; pass {name}")


def _shape_message(name: str, shape: Sequence[int]) -> str:
    """The error for input ``name`` of another shape than ``shape`` ("{}" stands for the shape given)."""
    return (f"forward: {name} has shape {{}}, but prepare captured the model with torch.export on shape "
            f"{tuple(shape)}, which fixes the graph to it (its reshapes and masks are of that size); call with "
            "that shape (pad or split the batch), or prepare again on the shape you need")


class SignatureCodeGen(fx.graph._PyTreeCodeGen):
    """A pytree codegen whose ``forward`` has the captured model's parameters (``params``, as
    :func:`check_params` validates them) and checks the inputs the graph was fixed for."""

    def __init__(self, pytree_info: Any, params: Sequence[Dict[str, Any]], shapes: Sequence[Optional[List[int]]] = ()) -> None:
        super().__init__(pytree_info)
        self.params = [dict(p) for p in params]
        # per placeholder, the shape torch.export fixed its graph to (None: not a tensor)
        self.shapes = [None if s is None else list(s) for s in shapes] or [None] * len(pytree_info.orig_args)

    def flat_call(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> List[Any]:
        """The placeholder values of a call ``forward(*args, **kwargs)`` (as forward binds it)."""
        parameters = [inspect.Parameter(p["name"], inspect.Parameter.POSITIONAL_OR_KEYWORD if p["kind"] == "positional"
                                        else inspect.Parameter.KEYWORD_ONLY, default=p.get("default", inspect.Parameter.empty))
                      for p in self.params]
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
        bound.apply_defaults()
        for p in self.params:
            _, bad, message = _rule(p)
            if bad(bound.arguments[p["name"]]):
                raise TypeError(message)
        names = [p["name"] for p in self.params if p["captured"]]
        flat = fx_pytree.tree_flatten_spec(((), {n: bound.arguments[n] for n in names}), self.pytree_info.in_spec)
        for value, name, shape in zip(flat, self.pytree_info.orig_args, self.shapes):
            if shape is not None and tuple(value.shape) != tuple(shape):
                raise ValueError(_shape_message(name, shape).replace("{}", str(tuple(value.shape))))
        return flat

    def fixed_inputs(self) -> Dict[str, Any]:
        """The captured non-tensor values by placeholder name (each is one leaf of the input spec)."""
        leaves = iter(self.pytree_info.orig_args)
        fixed = {}
        for p, spec in zip([p for p in self.params if p["captured"]], self.pytree_info.in_spec.child(1).children()):
            names = [next(leaves) for _ in range(spec.num_leaves)]
            if "fixed" in p and len(names) == 1:
                fixed[names[0]] = p["fixed"]
        return fixed

    def gen_fn_def(self, free_vars: List[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        parts, star = ["self"], False
        for p in self.params:
            if p["kind"] == "keyword" and not star:
                parts.append("*")
                star = True
            parts.append(p["name"] + (f"={p['default']!r}" if "default" in p else ""))
        code = f"def forward({', '.join(parts)}){maybe_return_annotation}:"
        for p in self.params:
            test, _, message = _rule(p)
            code += f"\n    if {test}:\n        raise TypeError({message!r})"
        names = [p["name"] for p in self.params if p["captured"]]
        values = "{" + ", ".join(f"{n!r}: {n}" for n in names) + "}"
        targets = [v.split(":")[0].split("#")[0].strip() for v in free_vars if v != "self"]
        if targets:
            code += f"\n    {', '.join(targets)}, = fx_pytree.tree_flatten_spec(([], {values}), self._in_spec)"
        for name, shape in zip(self.pytree_info.orig_args, self.shapes):
            if shape is not None and name in targets:
                before, after = _shape_message(name, shape).split("{}")
                code += (f"\n    if {name}.shape != {tuple(shape)!r}:"
                         f"\n        raise ValueError({before!r} + str(tuple({name}.shape)) + {after!r})")
        return code


@contextlib.contextmanager
def export_call(gm: fx.GraphModule) -> Iterator[Optional[Dict[str, Any]]]:
    """For pickling, which rebuilds a GraphModule by tracing its forward: ``gm`` with torch.export's own
    call while inside (the input checks would stop that trace), yielding the parameters and input
    shapes to :func:`restore_signature` from (None, and no change, for any other forward)."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, SignatureCodeGen):
        yield None
        return
    gm.graph.set_codegen(fx.graph._PyTreeCodeGen(codegen.pytree_info))
    gm.recompile()
    try:
        yield {"params": [dict(p) for p in codegen.params], "shapes": codegen.shapes}
    finally:
        gm.graph.set_codegen(codegen)
        gm.recompile()


def restore_signature(gm: fx.GraphModule, record: Dict[str, Any]) -> None:
    """``gm`` unpickled (torch.export's call, traced: its outputs folded back into their structure)
    given the forward with the model's signature again, its flat outputs and input spec as before."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat, spec = pytree.tree_flatten(output.args[0])  # fx's immutable dicts and lists: dicts and lists, in order
    if spec.num_leaves != gm._out_spec.num_leaves:
        raise ValueError(f"unpickling: the model's outputs {spec} are not the saved ones {gm._out_spec}")
    output.args = (flat,)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    info = fx.graph._PyTreeInfo(placeholders, gm._in_spec, gm._out_spec)
    gm.graph.set_codegen(SignatureCodeGen(info, check_params(record["params"], gm._in_spec, "unpickling: forward"),
                                          check_shapes(record["shapes"], len(placeholders), "unpickling: forward")))
    gm.recompile()
