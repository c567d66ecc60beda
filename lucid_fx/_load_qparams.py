"""A loaded graph's quantization parameters: the numbers its ``lucid_fx::`` calls carry.

Convert writes each quantize call's and each int8 kernel's scales, zero points and ranges from
calibrated observers, as literals in the graph, and the weight scales as tensors the kernels
read: scales finite and positive (observers floor them at ``eps``), zero points and ranges on
the grid of the codes they describe, ``quant_min`` below ``quant_max``. A file holding anything
else was altered or corrupted after save wrote it, and would load, then fail on its first call
(a range the kernel refuses) or return garbage without a word (a NaN or negative scale). Each
argument is found by its name in the op's schema; a tensor constant (a weight's scales) is read
once, here, and nothing else runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.kernels.library import op_name

__all__ = ["check_qparams"]

_OUTPUT = "<output>"
_CODES = (-128, 255)  # uint8 or int8: codes whose dtype the file does not record
# schema argument -> the argument whose codes it describes (_OUTPUT: the op's own output)
_SCALES = ("scale", "scales", "x_scale", "w_scale", "a_scale", "b_scale", "other_scale", "v_scale", "out_scale")
_ZERO_POINTS = {
    "zero_point": ("dtype", "q"),  # a quantize's dtype argument, a dequantize's input codes
    "zp": ("q",), "zps": ("qs",), "x_zp": ("qx",), "a_zp": ("qa",), "b_zp": ("qb",),  # an input's codes
    "other_zp": ("qother",), "v_zp": ("v",),  # conv2d_add's residual, softmax_matmul's values
    "out_zp": (_OUTPUT,),  # the codes the kernel writes
}
_UNUSED_FOR_FLOAT = ("out_scale", "out_zp")  # a kernel returning float (out_dtype float32) reads neither


def _named_args(node: fx.Node) -> Dict[str, Any]:
    overload = getattr(node.target, "default", node.target)  # a lucid_fx packet has one overload
    names = [a.name for a in overload._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _dtype_of(value: Any) -> Optional[torch.dtype]:
    """The dtype of a graph value, as the file records it (a converted node's value type, an input's shape)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, (list, tuple)) and value:
        return _dtype_of(value[0])  # cat's parts: one grid each, all of one dtype
    if not isinstance(value, fx.Node):
        return None
    known, meta = value.meta.get(_meta.VALUE_TYPE), value.meta.get(_meta.TENSOR_META)
    return known[1] if known is not None else getattr(meta, "dtype", None)


def _grid(node: fx.Node, args: Dict[str, Any], zero_point: str) -> Tuple[int, int]:
    """The codes' range of integers: their dtype's, or uint8's and int8's together if it is unknown."""
    for name in _ZERO_POINTS.get(zero_point, ("dtype",)):
        dtype = _dtype_of(node if name == _OUTPUT else args.get(name))
        if dtype is not None and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
            info = torch.iinfo(dtype)
            return info.min, info.max
    return _CODES


def _scale_ok(value: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(value) & (value > 0)


def _in(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda value: (value >= lo) & (value <= hi)


def _first_bad(value: Any, ok: Callable[[torch.Tensor], torch.Tensor]) -> Optional[str]:
    """How the first element of ``value`` (a number, a list of them or a tensor) that is not ``ok`` reads."""
    if isinstance(value, bool) or not isinstance(value, (int, float, list, tuple, torch.Tensor)):
        return None  # not a number: the meta-device run refuses what the op cannot take
    if isinstance(value, (list, tuple)):
        return next((f"{bad} at item {i}" for i, v in enumerate(value) for bad in [_first_bad(v, ok)] if bad), None)
    if not isinstance(value, torch.Tensor):
        try:
            return None if ok(torch.tensor(float(value), dtype=torch.float64)) else repr(value)
        except OverflowError:  # an int past any float: on no grid
            return f"{value!r:.40}"
    flat = value.detach().reshape(-1)
    bad = (~ok(flat)).nonzero()
    return None if bad.numel() == 0 else f"{flat[bad[0, 0]].item()!r} at element {bad[0, 0].item()}"


def _constant(gm: fx.GraphModule, value: Any) -> Any:
    """A get_attr node's tensor (its target walked the module tree at decode); data stays as it is."""
    if isinstance(value, fx.Node):
        return functools.reduce(getattr, value.target.split("."), gm) if value.op == "get_attr" else None
    return value


def _problems(gm: fx.GraphModule, node: fx.Node):
    """(argument, its bad value or None, the tensor it is read from, the rule) for each parameter of ``node``'s call."""
    args = _named_args(node)
    float_out = isinstance(args.get("out_dtype"), torch.dtype) and args["out_dtype"].is_floating_point
    for name, arg in args.items():
        value = _constant(gm, arg)
        tensor = f" (tensor {arg.target!r})" if isinstance(value, torch.Tensor) and isinstance(arg, fx.Node) else ""
        if float_out and name in _UNUSED_FOR_FLOAT:
            continue
        if name in _SCALES:
            yield name, _first_bad(value, _scale_ok), tensor, "a scale must be finite and above 0"
        elif name in _ZERO_POINTS or name in ("quant_min", "quant_max"):
            lo, hi = _grid(node, args, name)
            yield name, _first_bad(value, _in(lo, hi)), tensor, f"it must lie in [{lo}, {hi}], the range of the codes' dtype"
    qmin, qmax = args.get("quant_min"), args.get("quant_max")
    if isinstance(qmin, int) and isinstance(qmax, int) and qmin >= qmax:
        yield "quant_min", f"{qmin} and quant_max {qmax}", "", "quant_min must be below quant_max"


def check_qparams(gm: fx.GraphModule, owner: str) -> None:
    """Every scale, zero point and range a ``lucid_fx::`` call of ``gm`` takes, as convert writes them."""
    for node in gm.graph.nodes:
        op = op_name(node)
        if op is None:
            continue
        for name, bad, tensor, rule in _problems(gm, node):
            if bad is not None:
                raise ValueError(f"node {node.name!r} ({node.op}) in {owner}: argument {name} of lucid_fx.{op}{tensor} is {bad}, but {rule}; "
                                 "convert never writes that, so the file was altered or corrupted after lucid_fx.save "
                                 "wrote it: save the model again")
