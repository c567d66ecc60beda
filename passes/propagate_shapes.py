"""propagate_shapes: run example inputs through the graph, recording shape and dtype.

Reads ``node.meta[MODULE_PATH]`` (for messages); writes ``node.meta["tensor_meta"]`` (torch.fx's
ShapeProp format) for every node that produces tensors.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import fx
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from lucid_fx import _meta
from lucid_fx._describe import describe_value, node_inputs

__all__ = ["propagate_shapes"]

_HOW = "Pass example_inputs as a tuple of the positional arguments of forward, with shapes the model accepts"


def _where(gm: fx.GraphModule, node: fx.Node) -> str:
    path = node.meta.get(_meta.MODULE_PATH, "")
    if node.op == "call_module":
        return f"module {node.target!r} ({type(gm.get_submodule(node.target)).__name__})"
    op = getattr(node.target, "__name__", str(node.target))
    return f"{op} in module {path!r}" if path else op


def _none_default(node: fx.Node) -> str:
    """Advice where ``node`` read a forward parameter left at its default None: torch.fx traced the branch that
    uses it (``if bias is not None``), which the None then broke."""
    names = [str(a.target) for a in node.all_input_nodes if a.op == "placeholder" and a.args and a.args[0] is None]
    if not names:
        return ""
    fixed = ", ".join(f"{name!r}: None" for name in names)
    return (f"forward's {', '.join(map(repr, names))} took {'its' if len(names) == 1 else 'their'} default None, and "
            f"torch.fx traced the code that uses {'it' if len(names) == 1 else 'them'}: pass concrete_args={{{fixed}}} "
            "to prepare (the branch for None is traced, and a call given a value is refused), or give it an example value")


class _ShapeRecorder(fx.Interpreter):
    """ShapeProp without its printed traceback: a failure names the node, its module and the
    shapes it was given."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            given = node_inputs(self, n)
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ValueError(
                f"example_inputs do not run through the model: node {n.name!r} ({_where(self.module, n)}) failed "
                f"on inputs ({given}) with {type(exc).__name__}: {first}. {_none_default(n) or _HOW}"
            ) from exc
        found = []

        def record(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            found.append(value)
            return _extract_tensor_metadata(value)

        meta = map_aggregate(result, record)
        if found:
            n.meta[_meta.TENSOR_META] = meta
        return result


def _check_count(gm: fx.GraphModule, example_inputs: Sequence) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(str(n.target).startswith("*") for n in placeholders):
        return  # forward(*args): any count
    required = sum(1 for n in placeholders if not n.args)  # a placeholder's args hold its default
    if required <= len(example_inputs) <= len(placeholders):
        return
    names = ", ".join(str(n.target) for n in placeholders)
    raise ValueError(
        f"example_inputs do not run through the model: {type(gm).__name__}.forward({names}) takes "
        f"{required if required == len(placeholders) else f'{required} to {len(placeholders)}'} positional "
        f"argument(s) but example_inputs has {len(example_inputs)} ({', '.join(describe_value(v) for v in example_inputs)}). {_HOW}"
    )


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """Annotate ``gm`` in place with the shapes and dtypes seen on ``example_inputs``.

    Raises ValueError, naming the node, its module and the input shapes it got, when the inputs
    do not fit the model.
    """
    _check_count(gm, example_inputs)
    with torch.no_grad():
        recorder = _ShapeRecorder(gm)
        recorder.extra_traceback = False  # the message already names the node
        recorder.run(*example_inputs)
    return gm
