"""Checks at the boundary of the ``lucid_fx::`` kernels: what each op can take, said before oneDNN is asked.

oneDNN answers an input it cannot take with "could not create a primitive descriptor" or, worse,
with numbers (a weight on ``meta``, a scale per channel too few). Each op here is checked on
shapes, dtypes and devices only, never on the data. Float values entering the int8 grid must also
be finite: ``quantize_per_tensor`` checks that inside its own pass (:mod:`lucid_fx.kernels.quantize`),
``quantize_per_channel`` and CUDA with :mod:`lucid_fx.kernels.finite`, all inside the kernels.

A failing check raises :class:`KernelInputError` (a ``ValueError``) naming the op, what is wrong
and what to do, and the graph node that called the kernel when it was called from a converted
model: :func:`calling_node` finds it from the generated ``forward``'s frame and line (fx keeps a
line -> node map per compiled graph), so the normal path pays nothing for it.

>>> torch.ops.lucid_fx.dequantize_per_tensor(torch.ones(2), 0.1, 0)
Traceback (most recent call last):
...
lucid_fx.kernels.checks.KernelInputError: lucid_fx.dequantize_per_tensor: the codes are torch.float32, ...
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, NoReturn, Optional

import torch
from torch import fx

from lucid_fx import _meta

__all__ = ["KernelInputError", "calling_node", "is_async", "CHECKS"]

_CODES = (torch.uint8, torch.int8)
_FEED_FLOAT = (
    "a converted model takes float tensors and quantizes them itself; codes come from "
    "lucid_fx.quantize_per_tensor (uint8 or int8, never int32 or the quint8/qint8 tensor dtypes)"
)


class KernelInputError(ValueError):
    """An input a ``lucid_fx::`` kernel cannot take; the message names the op, the node and the fix."""


def calling_node(depth: int = 24) -> Optional[fx.Node]:
    """The graph node whose call is running, if a converted GraphModule's generated code (or an
    ``fx.Interpreter``) is on the stack; ``None`` for a direct call. Only error paths call this."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        code, owner = frame.f_code, frame.f_locals.get("self")
        if code.co_filename.startswith("<eval_with_key>") and isinstance(owner, fx.GraphModule):
            # fx records, per compiled graph, which node each line of its forward belongs to.
            index = (getattr(owner, "_lineno_map", None) or {}).get(frame.f_lineno - code.co_firstlineno)
            nodes = list(owner.graph.nodes)
            return nodes[index] if index is not None and index < len(nodes) else None
        if code.co_name == "run_node" and isinstance(owner, fx.Interpreter):
            node = frame.f_locals.get("n")
            return node if isinstance(node, fx.Node) else None
        frame = frame.f_back
    return None


def _at(node: Optional[fx.Node]) -> str:
    if node is None:
        return ""
    source = node.meta.get(_meta.SOURCE)  # the prepared node whose value it computes
    return f" at node {node.name!r}" + (f" (computing {source!r})" if source and source != node.name else "")


def fail(op: str, problem: str, fix: str) -> NoReturn:
    """Raise :class:`KernelInputError` for ``lucid_fx.<op>``, naming the calling node if any."""
    raise KernelInputError(f"lucid_fx.{op}{_at(calling_node())}: {problem}; {fix}")


def is_async(tensor: torch.Tensor) -> bool:
    """Whether checks on ``tensor`` run asynchronously (CUDA: a host sync per check would stall the stream)."""
    return tensor.device.type == "cuda"


# -- per-op checks: each takes the op's own arguments ------------------------------------------
def _codes(op: str, what: str, q: torch.Tensor) -> None:
    if q.dtype not in _CODES:
        fail(op, f"the {what} is {q.dtype}, and int8 kernels read uint8 or int8 codes", _FEED_FLOAT)


def _same_device(op: str, what: str, tensor: Optional[torch.Tensor], like: torch.Tensor) -> None:
    if tensor is None or tensor.device == like.device:
        return
    if tensor.device.type == "meta":
        fail(op, f"the {what} is on the meta device (it holds no data)", "load real weights into the model and convert again")
    fail(op, f"the {what} is on {tensor.device} and the input on {like.device}",
         "move the model and its inputs to one device (model.to(device) moves the int8 weights too)")


def _weights(op: str, qx: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    _codes(op, "input", qx)
    if qw.dtype != torch.int8:
        fail(op, f"the weight is {qw.dtype}, not int8 codes", "pass the int8 weight convert made (lucid_fx.convert)")
    device = qx.device
    if qw.device != device or w_scale.device != device or (bias is not None and bias.device != device):
        for what, tensor in (("weight", qw), ("weight scale", w_scale), ("bias", bias)):
            _same_device(op, what, tensor, qx)
    if w_scale.numel() != qw.shape[0]:
        fail(op, f"{w_scale.numel()} weight scales for {qw.shape[0]} output channels", "pass one scale per output channel")
    if bias is not None and bias.numel() != qw.shape[0]:
        fail(op, f"a bias of {bias.numel()} values for {qw.shape[0]} output channels", "pass one bias per output channel")


def _linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype) -> None:
    _weights("linear", qx, qw, w_scale, bias)
    if qx.dim() == 0 or qw.dim() != 2 or qx.shape[-1] != qw.shape[1]:
        fail("linear", f"the input's last dim has {qx.shape[-1] if qx.dim() else 'no'} features and the "
             f"weight {tuple(qw.shape)} takes {qw.shape[-1]}", "feed inputs of the shape the float model takes")


def _grouped_linear(qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp) -> None:
    op = "grouped_linear"
    _codes(op, "input", qx)
    if qw.dtype != torch.int8:
        fail(op, f"the experts' weights are {qw.dtype}, not int8 codes", "pass the int8 weights convert made (lucid_fx.convert)")
    for what, tensor in (("weight", qw), ("weight scale", w_scale)):
        _same_device(op, what, tensor, qx)
    if qx.dim() != 2 or qw.dim() != 3 or qx.shape[1] != qw.shape[2] or tuple(w_scale.shape) != tuple(qw.shape[:2]):
        fail(op, f"rows {tuple(qx.shape)}, weights {tuple(qw.shape)} and scales {tuple(w_scale.shape)} are not (S, K) "
             "rows, (E, N, K) experts and (E, N) scales", "feed inputs of the shape the float model takes")
    if offs.dim() != 1 or offs.numel() != qw.shape[0] or offs.is_floating_point() or offs.dtype == torch.bool:
        fail(op, f"offsets of shape {tuple(offs.shape)} ({offs.dtype}) for {qw.shape[0]} experts",
             "pass one integer offset per expert: where its rows end")


def _conv(op: str, rank: int):
    def check(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, *rest) -> None:
        _weights(op, qx, qw, w_scale, bias)
        layout = "(N, C, L)" if rank == 3 else "(N, C, H, W)"
        if qx.dim() != rank or qw.dim() != rank:
            fail(op, f"the input has shape {tuple(qx.shape)}, and this kernel takes a batched {rank}-D {layout} input",
                 "feed batched inputs (x.unsqueeze(0) adds a batch of one)")
        if qx.shape[1] != qw.shape[1] * groups:
            fail(op, f"the input has {qx.shape[1]} channels and the layer takes {qw.shape[1] * groups}",
                 f"feed inputs laid out {layout} with the channel count the float model takes")
        if op == "conv2d_add":
            _codes(op, "residual input", rest[0])
            _same_device(op, "residual input", rest[0], qx)

    return check


def _unary(op: str, ranks: Optional[tuple] = None):
    def check(q, *rest) -> None:
        _codes(op, "input", q)
        if ranks is not None and q.dim() not in ranks:
            fail(op, f"the input has shape {tuple(q.shape)}, and this kernel takes {' or '.join(map(str, ranks))}-D "
                 "(C, H, W) or (N, C, H, W) codes", "feed inputs of the shape the float model takes")

    return check


def _binary(op: str):
    def check(qa, a_scale, a_zp, qb, *rest) -> None:
        _codes(op, "input 0", qa)
        _codes(op, "input 1", qb)
        _same_device(op, "input 1", qb, qa)

    return check


def _masked_softmax(q, scale, zp, mask, *rest, op: str = "masked_softmax") -> None:
    _codes(op, "scores tensor", q)
    _same_device(op, "mask", mask, q)  # (a mask of None passes)


def _softmax_matmul(q, scale, zp, mask, fill, v, *rest) -> None:
    _masked_softmax(q, scale, zp, mask, op="softmax_matmul")
    _codes("softmax_matmul", "values tensor", v)
    _same_device("softmax_matmul", "values tensor", v, q)


def _cat(qs, scales, zps, dim, out_scale, out_zp) -> None:
    for i, q in enumerate(qs):
        _codes("cat", f"input {i}", q)
        _same_device("cat", f"input {i}", q, qs[0])


def _quantize(x, scale, zero_point, *rest) -> None:
    if x.is_complex():
        fail("quantize_per_tensor", f"the value is {x.dtype}; the int8 grid holds real numbers",
             "pass the real part (x.real) or keep this part of the model in float")
    # NaN and ±inf: checked inside the kernel's own pass (lucid_fx.kernels.quantize), almost free there.


def _quantize_per_channel(x, scale, zero_point, axis, *rest) -> None:
    if x.is_complex():
        fail("quantize_per_channel", f"the value is {x.dtype}; the int8 grid holds real numbers", "pass real weights")
    # NaN and ±inf: refused by the kernel itself (lucid_fx.kernels.quantize), as quantize_per_tensor's are.


def _dequantize(op: str):
    def check(q, *rest) -> None:
        if q.is_floating_point() or q.is_complex() or q.dtype == torch.bool:
            fail(op, f"the codes are {q.dtype}, and dequantize reads integer codes", _FEED_FLOAT)

    return check


_POOL_RANKS = (3, 4)

#: op name -> check called with the op's arguments before any kernel of that op (every device).
CHECKS: Dict[str, Callable[..., None]] = {
    "quantize_per_tensor": _quantize,  # real values only (finite ones: the kernel checks in its pass)
    "quantize_per_channel": _quantize_per_channel,  # the same for a weight quantized in the graph
    "dequantize_per_tensor": _dequantize("dequantize_per_tensor"),  # integer codes only
    "dequantize_per_channel": _dequantize("dequantize_per_channel"),  # integer codes only
    "linear": _linear,  # codes, int8 weight on the input's device, K matches, one scale per output
    "grouped_linear": _grouped_linear,  # as linear, per expert; one integer offset per expert
    "conv1d": _conv("conv1d", 3),  # as linear, batched (N, C, L), C == weight channels * groups
    "conv2d": _conv("conv2d", 4),  # as linear, batched (N, C, H, W), C == weight channels * groups
    "conv2d_add": _conv("conv2d_add", 4),  # conv2d's checks, and the residual is codes too
    "add": _binary("add"),  # two code tensors on one device
    "mul": _binary("mul"),  # two code tensors on one device
    "matmul": _binary("matmul"),  # two code tensors on one device
    "lut": _unary("lut"),  # codes (the table is indexed by code)
    "channel_lut": _unary("channel_lut"),  # codes (each channel's table is indexed by code)
    "softmax": _unary("softmax"),  # codes
    "masked_softmax": _masked_softmax,  # the scores are codes, the (float or bool) mask on their device
    "softmax_matmul": _softmax_matmul,  # scores and values are codes, the mask (if any) on their device
    "cat": _cat,  # every part is codes, on one device
    "avg_pool2d": _unary("avg_pool2d", ranks=_POOL_RANKS),  # codes, (C, H, W) or (N, C, H, W)
    "adaptive_avg_pool2d": _unary("adaptive_avg_pool2d", ranks=_POOL_RANKS),  # as avg_pool2d
    "mean": _unary("mean"),  # codes
    "max_pool2d": _unary("max_pool2d", ranks=_POOL_RANKS),  # as avg_pool2d
    **{norm: _unary(norm) for norm in ("layer_norm", "rms_norm", "group_norm")},  # codes (weight, bias float, as the model's)
}
