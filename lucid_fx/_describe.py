"""How an error names the values a call was given: ``Tensor[4, 8] float32`` for a tensor, the same inside tuples,
lists and dicts, numbers and None as written. prepare's shape check (passes/propagate_shapes.py) and calibrate's
failed batch (lucid_fx/calibrate.py) both say what a node received with it."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["describe_value", "node_inputs"]


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return type(value).__name__ if not isinstance(value, (int, float, bool, str, type(None))) else repr(value)


def node_inputs(interpreter: fx.Interpreter, node: fx.Node) -> str:
    """What ``node`` was given in ``interpreter``'s run, positional then keyword: ``Tensor[4, 8] float32, None``."""
    args, kwargs = interpreter.fetch_args_kwargs_from_env(node)
    return ", ".join([describe_value(a) for a in args] + [f"{k}={describe_value(v)}" for k, v in kwargs.items()])
