"""The aten op table: how each op of a torch.export graph becomes the call the torch.fx front end
would have recorded, so that it gets the same canonical op (lucid_fx/ops.py) and every observer,
range and lowering rule applies to both front ends. ``passes/rewrite_aten.py`` applies it.

One :class:`AtenRow` per aten overload (an op of another namespace is named with it:
``transformers::``): the canonical op it becomes, the torch-level callable (a function, or a
``Tensor`` method name) the node is rewritten to, and which aten arguments (by
schema name) go where: ``args`` positionally, ``kwargs`` as ``torch name -> aten name``. Arguments
a row does not name are dropped (they are inference-time no-ops: ``cudnn_enable``,
``scale_grad_by_freq``). A row with a ``special`` does more than reorder (a transposed weight, a
tuple result, a slice); the pass names the function for each.

An overload without a row becomes ``torch.<name>`` / ``F.<name>`` with its arguments unchanged (the
Python bindings and the schema share argument order), if that callable exists (:data:`SAME_NAME`);
an in-place op without one becomes the Tensor method (``aten.add_`` -> ``x.add_(y)``).
Targets are torch-level callables, never ``torch.ops.aten``, so a converted graph names only what
the save/load allowlist (lucid_fx/_allowlist.py) already resolves.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["AtenRow", "ATEN_OPS", "DROPPED", "IDENTITY", "SAME_NAME", "aten_row", "same_name_target", "bind_schema"]


@dataclass(frozen=True)
class AtenRow:
    """One aten overload (``"linear.default"``) and the torch-level call it becomes."""

    overload: str
    canonical: Optional[str]  # the OpDef name the rewritten call canonicalises to; None: no canonical op
    target: Any  # a torch callable, or a Tensor method name (str)
    args: Tuple[str, ...] = ("self",)
    kwargs: Mapping[str, str] = field(default_factory=dict)
    special: str = ""  # a rewrite the pass does itself (see passes/rewrite_aten.py's SPECIALS)


_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_BN = ("input", "running_mean", "running_var", "weight", "bias")


def _row(overload, canonical, target, *args, special="", **kwargs) -> AtenRow:
    return AtenRow(overload, canonical, target, tuple(args) or ("self",), dict(kwargs), special)


ATEN_OPS: Tuple[AtenRow, ...] = (
    # layers
    _row("linear.default", "linear", F.linear, "input", "weight", "bias"),  # same order
    _row("addmm.default", "linear", F.linear, special="addmm"),  # addmm(b, x, W) -> linear(x, W.t(), b)
    _row("mm.default", "linear", F.linear, special="mm"),  # mm(x, W.t()) -> linear(x, W); else matmul
    _row("_grouped_mm.default", "grouped_mm", F.grouped_mm, "self", "mat2", offs="offs", bias="bias", out_dtype="out_dtype"),
    # transformers' fallback for torch._grouped_mm (Mixtral's experts under torch.export): the same product
    # (kept float, F.grouped_mm on the CPU wants K and N multiples of 4 in float32, as real configs have)
    _row("transformers::grouped_mm_fallback.default", "grouped_mm", F.grouped_mm, "input", "weight", offs="offs"),
    _row("baddbmm.default", "matmul", torch.matmul, special="baddbmm"),  # b + (q @ k) * alpha: BLOOM's ALiBi scores
    _row("conv1d.default", "conv1d", F.conv1d, *_CONV),  # same order
    _row("conv2d.default", "conv2d", F.conv2d, *_CONV),  # same order
    _row("conv3d.default", "conv3d", F.conv3d, *_CONV),  # same order
    _row("convolution.default", "conv2d", F.conv2d, special="convolution"),  # -> conv{1,2,3}d by len(stride), conv_transpose2d
    _row("upsample_nearest2d.vec", "interpolate", F.interpolate, special="upsample", mode="nearest"),  # F.interpolate's
    _row("upsample_bilinear2d.vec", "interpolate", F.interpolate, special="upsample", mode="bilinear"),
    _row("layer_norm.default", "layer_norm", F.layer_norm, "input", "normalized_shape", "weight", "bias", "eps"),  # drops cudnn_enable
    _row("native_layer_norm.default", "layer_norm", F.layer_norm, "input", "normalized_shape", "weight", "bias", "eps", special="first_of_tuple"),  # (out, mean, rstd)[0]
    _row("group_norm.default", "group_norm", F.group_norm, "input", "num_groups", "weight", "bias", "eps"),  # drops cudnn_enabled
    _row("native_group_norm.default", "group_norm", F.group_norm, "input", "group", "weight", "bias", "eps", special="first_of_tuple"),  # drops N, C, HxW
    _row("instance_norm.default", "instance_norm", F.instance_norm, "input", "running_mean", "running_var", "weight", "bias",
         "use_input_stats", "momentum", "eps"),  # (x, w, b, rm, rv, ...) -> (x, rm, rv, w, b, ...), drops cudnn_enabled
    _row("batch_norm.default", "batch_norm", F.batch_norm, *_BN, "training", "momentum", "eps"),  # (x, w, b, rm, rv, ...) -> (x, rm, rv, w, b, ...)
    _row("_native_batch_norm_legit_no_training.default", "batch_norm", F.batch_norm, *_BN, momentum="momentum", eps="eps", special="first_of_tuple"),  # reordered, [0]
    _row("embedding.default", "embedding", F.embedding, "indices", "weight"),  # embedding(W, ids) -> F.embedding(ids, W)
    # activations
    _row("hardtanh.default", "clamp", F.hardtanh, "self", "min_val", "max_val"),  # hardtanh(x, a, b) -> clamp(x, a, b)
    _row("hardtanh_.default", "clamp", F.hardtanh_, "self", "min_val", "max_val"),  # in place
    _row("gelu.default", "gelu", F.gelu, "self", approximate="approximate"),  # keeps "tanh"/"none"
    _row("_softmax.default", "softmax", torch.softmax, "self", "dim"),  # half_to_float is False on float32
    _row("softmax.int", "softmax", torch.softmax, "self", "dim", dtype="dtype"),
    _row("_log_softmax.default", "log_softmax", torch.log_softmax, "self", "dim"),
    _row("dropout.default", "dropout", F.dropout, "input", "p", "train"),  # dropout(x, p, train) -> F.dropout(x, p, training)
    _row("dropout_.default", "dropout", F.dropout, "self", "p", "train"),  # in eval a no-op either way
    # pooling
    _row("max_pool2d.default", "max_pool2d", F.max_pool2d, "self", "kernel_size", "stride", "padding", dilation="dilation", ceil_mode="ceil_mode"),
    _row("max_pool1d.default", "max_pool1d", F.max_pool1d, "self", "kernel_size", "stride", "padding", dilation="dilation", ceil_mode="ceil_mode"),
    _row("max_pool2d_with_indices.default", "max_pool2d", F.max_pool2d, "self", "kernel_size", "stride", "padding",
         dilation="dilation", ceil_mode="ceil_mode", special="first_of_tuple"),  # (out, indices)[0]
    # shapes: torch has no torch.view / torch.expand / torch.contiguous
    _row("view.default", "reshape", torch.reshape, "self", "size"),  # a view where reshape is one too
    _row("_unsafe_view.default", "reshape", torch.reshape, "self", "size"),
    _row("expand.default", "expand", "expand", "self", "size"),  # x.expand(size)
    _row("contiguous.default", "contiguous", "contiguous", "self"),  # x.contiguous()
    _row("slice.Tensor", "getitem", None, special="slice"),  # slice(x, d, a, b, s) -> x[:, ..., a:b:s]
    _row("select.int", "getitem", None, special="select"),  # select(x, d, i) -> x[:, ..., i]: BERT's pooler
    _row("split_with_sizes.default", "split", torch.split, "self", "split_sizes", "dim"),
    _row("split.Tensor", "split", torch.split, "self", "split_size", "dim"),
    _row("copy_.default", None, "copy_", "self", "src"),  # x.copy_(y): functionalize_inplace decides
    _row("to.dtype", None, "to", "self", "dtype"),  # x.to(dtype), as fx records it
    _row("to.dtype_layout", None, "to", "self", dtype="dtype"),
    _row("to.device", None, "to", "self", "device", "dtype"),  # x.to(device, dtype): Mistral's rotary inv_freq.to(x.device)
    _row("sym_size.int", None, "size", "self", "dim"),  # x.size(d) of a dynamic dim (ExportedProgram with dynamic_shapes)
    _row("index.Tensor", "getitem", None, special="index"),  # index(x, [None, i]) -> x[:, i]: BERT's mask, Swin's bias table
    _row("numpy_T.default", "permute", "permute", special="numpy_T"),  # x.T -> x.permute(reversed dims): Falcon's rotary
    _row("__and__.Tensor", None, operator.and_, "self", "other"),  # a & b: transformers' masks
    _row("__or__.Tensor", None, operator.or_, "self", "other"),  # a | b
    _row("_to_copy.default", None, "to", "self", dtype="dtype"),
)

# Ops that alias or copy and compute nothing at inference: their node goes, its users read the
# input (a clone that an in-place op then writes, itself or through a view, stays: torch.clone).
IDENTITY = frozenset({"alias.default", "clone.default", "lift_fresh_copy.default", "detach.default", "detach_.default"})
# Ops whose result nothing reads (shape and metadata asserts of the export): the node goes.
DROPPED = frozenset({"_assert_tensor_metadata.default", "_assert_scalar.default", "sym_constrain_range.default",
                     "sym_constrain_range_for_size.default", "_assert_async.msg"})

_BY_OVERLOAD: Dict[str, AtenRow] = {row.overload: row for row in ATEN_OPS}
# Where an op without a row is looked up: torch.<name>, then F.<name>, then torch.special.<name>.
SAME_NAME = (torch, F, torch.special)


def aten_row(overload: torch._ops.OpOverload) -> Optional[AtenRow]:
    """The row of an ``aten`` overload (or of another namespace's op the table names), or None."""
    return _BY_OVERLOAD.get(f"{overload._schema.name.removeprefix('aten::')}.{overload._overloadname}")


def same_name_target(overload: torch._ops.OpOverload) -> Optional[Any]:
    """``torch.<name>`` (or ``F.`` / ``torch.special.``) for an aten op without a row: aten.add.Tensor -> torch.add;
    with no such function, the Tensor method: aten.add_.Tensor -> x.add_(y), aten.new_ones -> x.new_ones(size)."""
    name = overload._schema.name.split("::")[-1]
    if name.startswith("_"):
        return None
    for space in SAME_NAME:
        fn = getattr(space, name, None)
        if callable(fn):
            return fn
    # the Tensor method where torch has no function: x.add_(y), x.new_ones(size), x.type_as(y)
    return name if callable(getattr(torch.Tensor, name, None)) else None


def bind_schema(overload: torch._ops.OpOverload, args: tuple, kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The arguments of an aten call by schema name, defaults filled in."""
    bound: Dict[str, Any] = {}
    for index, argument in enumerate(overload._schema.arguments):
        if index < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[index]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound
