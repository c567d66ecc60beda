"""The canonical op table: every spelling of an op (module, ``torch.*``, ``F.*``, tensor method,
in-place variant, ``operator.*``) maps to one canonical name plus its constant arguments.

The table is data. An :class:`OpDef` names the canonical op and its parameters; the spellings
``torch.<name>``, ``torch.<name>_``, ``F.<name>``, ``F.<name>_``, ``torch.special.<name>`` and
the methods ``x.<name>()``/``x.<name>_()`` are *derived* from it (whichever exist), so sigmoid is
written once, not four times. Irregular spellings (``F.relu6`` is ``clamp(0, 6)``, ``nn.Hardtanh``
keeps its bounds in attributes) are listed explicitly.

Op groups are :class:`Tag` s on the ``OpDef``; the sets the rules use derive from them
(:func:`ops_tagged`), so an op joins a group in one place.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import padding as _P

from lucid_fx._where import caller_location
from lucid_fx.node_refs import BoundCall, CanonicalCall, NodeRef, canonical
from lucid_fx.op_tags import Tag

__all__ = ["OpDef", "Tag", "Spelling", "CanonicalCall", "BoundCall", "NodeRef", "canonical", "OP_DEFS", "EXTRA_SPELLINGS",
           "derive_spellings", "ops_tagged"]

ModuleConsts = Callable[[nn.Module], Dict[str, Any]]


@dataclass(frozen=True)
class OpDef:
    """One canonical op: its name, parameter order, where its spellings come from, and its groups."""

    name: str
    params: Tuple[str, ...] = ("input",)
    aliases: Tuple[str, ...] = ()
    modules: Mapping[type, ModuleConsts] = field(default_factory=dict)
    derive: bool = True
    tags: FrozenSet[Tag] = frozenset()


@dataclass(frozen=True)
class Spelling:
    """How one way of writing an op maps onto its canonical form.

    ``params``: this spelling's positional parameter names (canonical names); ``renames``: its
    keyword names that differ from the canonical ones; ``consts``: fixed arguments it implies
    (``F.relu6`` implies ``min=0, max=6``), or for modules a function reading them off the module.
    """

    kind: str  # "call_function" | "call_method" | "call_module"
    target: Any
    op: str
    params: Tuple[str, ...]
    renames: Mapping[str, str] = field(default_factory=dict)
    consts: Any = None
    inplace: bool = False
    where: str = ""

    @property
    def text(self) -> str:
        if self.kind == "call_method":
            return f"Tensor.{self.target}"
        if self.kind == "call_module":
            return f"nn.{self.target.__name__}" if self.target.__module__.startswith("torch.nn") else self.target.__name__
        mod = getattr(self.target, "__module__", "") or ""
        name = getattr(self.target, "__name__", str(self.target))
        if mod == "builtins":
            return name  # getattr
        if mod and not mod.startswith("torch") and mod not in ("_operator", "operator"):
            return f"{mod}.{name}"  # a user's function registered with register_op
        prefix = {"torch.nn.functional": "F.", "_operator": "operator.", "operator": "operator."}.get(mod, "torch.")
        if mod.startswith("torch.special") or "special" in mod:
            prefix = "torch.special."
        return prefix + name


def _attrs(**names: str) -> ModuleConsts:
    """Module consts read from attributes: ``_attrs(dim="dim")`` -> ``{"dim": m.dim}``."""
    return lambda m: {canon: getattr(m, attr) for canon, attr in names.items()}


def _none(m: nn.Module) -> Dict[str, Any]:
    return {}


_CONV = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")  # torch's order
_POOL = ("input", "kernel_size", "stride", "padding")
_AVG_POOL = _POOL + ("ceil_mode", "count_include_pad", "divisor_override")
_RESAMPLE = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
_IM2COL = ("input", "kernel_size", "dilation", "padding", "stride")  # F.unfold's order
_PADS = {cls: (lambda m, mode=mode: {"pad": tuple(m.padding), "mode": mode, "value": getattr(m, "value", None)}) for cls, mode in (
    (_P._ReflectionPadNd, "reflect"), (_P._ReplicationPadNd, "replicate"), (_P._ConstantPadNd, "constant"), (_P._CircularPadNd, "circular"))}

# Tag sets, named by what they say about an op.
_TABLE = frozenset({Tag.ELEMENTWISE})
_BOUNDED_TABLE = frozenset({Tag.BOUNDED, Tag.ELEMENTWISE})
_MOVES_VIEW = frozenset({Tag.MOVES_CODES, Tag.VIEW})
_CONV_TAGS = frozenset({Tag.WEIGHTED, Tag.CONV, Tag.PRODUCT})
_AVG_POOL_TAGS = frozenset({Tag.POOLING, Tag.AVERAGE})
_NORM = frozenset({Tag.NORMALIZATION})

# The canonical ops. Parameter tuples follow torch's own positional order.
OP_DEFS: List[OpDef] = [
    # bounded activations
    OpDef("sigmoid", aliases=("expit",), modules={nn.Sigmoid: _none}, tags=_BOUNDED_TABLE),
    OpDef("tanh", modules={nn.Tanh: _none}, tags=_BOUNDED_TABLE),
    OpDef("hardsigmoid", ("input", "inplace"), modules={nn.Hardsigmoid: _none}, tags=_BOUNDED_TABLE),
    OpDef("softmax", ("input", "dim", "dtype"), modules={nn.Softmax: _attrs(dim="dim")}, tags=frozenset({Tag.BOUNDED})),
    OpDef("softsign", modules={nn.Softsign: _none}, tags=_BOUNDED_TABLE),
    *(OpDef(name, tags=_BOUNDED_TABLE) for name in ("sin", "cos")),
    OpDef("clamp", ("input", "min", "max"), aliases=("clip",), tags=_BOUNDED_TABLE),  # bounded when both bounds are numbers
    # other activations
    OpDef("relu", ("input", "inplace"), modules={nn.ReLU: _none}, tags=_TABLE),
    OpDef("gelu", ("input", "approximate"), modules={nn.GELU: _attrs(approximate="approximate")}, tags=_TABLE),
    OpDef("silu", ("input", "inplace"), modules={nn.SiLU: _none}, tags=_TABLE),
    OpDef("hardswish", ("input", "inplace"), modules={nn.Hardswish: _none}, tags=_TABLE),
    OpDef("leaky_relu", ("input", "negative_slope", "inplace"), modules={nn.LeakyReLU: _attrs(negative_slope="negative_slope")}, tags=_TABLE),
    *(OpDef(name, params, modules={cls: _none}, tags=_TABLE) for name, params, cls in (  # tables of the op on every code
        ("mish", ("input", "inplace"), nn.Mish), ("softplus", ("input", "beta", "threshold"), nn.Softplus),
        ("selu", ("input", "inplace"), nn.SELU), ("celu", ("input", "alpha", "inplace"), nn.CELU),
        ("logsigmoid", ("input",), nn.LogSigmoid), ("tanhshrink", ("input",), nn.Tanhshrink),
        ("softshrink", ("input", "lambd"), nn.Softshrink))),  # (not hardshrink, threshold: a jump moves a rounded input far)
    OpDef("prelu", ("input", "weight"), modules={nn.PReLU: _none}),  # a slope per channel: a table per channel
    OpDef("elu", ("input", "alpha", "inplace"), modules={nn.ELU: _attrs(alpha="alpha")}, tags=_TABLE),
    OpDef("pow", ("input", "exponent"), tags=_TABLE),  # x ** c (GPT-2's tanh GELU: x ** 3): a table; x ** y stays float
    *(OpDef(name, tags=_TABLE) for name in ("exp", "abs")),
    # more of torch's unary math, written out in activations and norms (x * 0.5 * (1 + erf(x / sqrt(2))): BERT's GELU)
    *(OpDef(name, tags=_TABLE) for name in ("sqrt", "rsqrt", "log", "log1p", "expm1", "reciprocal", "square")),
    *(OpDef(name, tags=_BOUNDED_TABLE) for name in ("erf", "atan")),  # in [-1, 1], [-pi/2, pi/2]
    OpDef("neg", aliases=("negative",), tags=_TABLE),
    OpDef("log_softmax", ("input", "dim", "dtype"), modules={nn.LogSoftmax: _attrs(dim="dim")}),
    # arithmetic: elementwise in one tensor when the other operand is a number (x + 1, 2 * x)
    OpDef("add", ("input", "other", "alpha"), tags=_TABLE),
    OpDef("sub", ("input", "other", "alpha"), aliases=("subtract",), tags=_TABLE),
    OpDef("rsub", ("input", "other", "alpha"), tags=_TABLE),
    OpDef("mul", ("input", "other"), aliases=("multiply",), tags=_TABLE),
    OpDef("div", ("input", "other", "rounding_mode"), aliases=("divide", "true_divide"), tags=_TABLE),
    *(OpDef(name, ("input", "other"), tags=_TABLE) for name in ("minimum", "maximum")),
    # comparisons and where: a bool per element, a choice per element; inside one source's table (rules/one_source.py)
    *(OpDef(name, ("input", "other"), aliases=aliases, tags=_TABLE) for name, aliases in (
        ("gt", ("greater",)), ("ge", ("greater_equal",)), ("lt", ("less",)), ("le", ("less_equal",)), ("eq", ()), ("ne", ("not_equal",)))),
    OpDef("where", ("condition", "input", "other"), derive=False, tags=_TABLE),  # torch.where(c, a, b), a.where(c, b)
    OpDef("matmul", ("input", "other"), aliases=("bmm", "mm"), tags=frozenset({Tag.PRODUCT})),
    OpDef("grouped_mm", ("input", "weight", "offs", "bias", "out_dtype"), aliases=("_grouped_mm",), tags=frozenset({Tag.PRODUCT})),  # Mixtral's experts
    OpDef("mean", ("input", "dim", "keepdim"), tags=frozenset({Tag.AVERAGE})),
    OpDef("sum", ("input", "dim", "keepdim", "dtype")),  # attention pooling's (w * h).sum(1): N means
    OpDef("norm", ("input", "p", "dim", "keepdim")),  # x.norm(dim=-1, keepdim=True): CLIP's x / x.norm(...) (rules/patterns.py)
    # attention: the mask arguments are named so rules can find them (lucid_fx/rules/masks.py)
    OpDef("masked_fill", ("input", "mask", "value"), tags=frozenset({Tag.ATTENTION})),
    OpDef("scaled_dot_product_attention", ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), tags=frozenset({Tag.ATTENTION})),
    # layers
    OpDef("linear", ("input", "weight", "bias"), modules={nn.Linear: _none}, tags=frozenset({Tag.WEIGHTED, Tag.PRODUCT})),
    OpDef("conv1d", _CONV, modules={nn.Conv1d: _none}, tags=_CONV_TAGS),
    OpDef("conv2d", _CONV, modules={nn.Conv2d: _none}, tags=_CONV_TAGS),
    OpDef("conv3d", _CONV, modules={nn.Conv3d: _none}, tags=_CONV_TAGS),
    OpDef("conv_transpose2d", _CONV_T, modules={nn.ConvTranspose2d: _none}, tags=frozenset({Tag.PRODUCT})),  # not WEIGHTED: its weight is (Cin, Cout, kh, kw)
    OpDef("batch_norm", ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
          modules={nn.BatchNorm1d: _none, nn.BatchNorm2d: _none, nn.BatchNorm3d: _none}, tags=_NORM),
    OpDef("layer_norm", ("input", "normalized_shape", "weight", "bias", "eps"), modules={nn.LayerNorm: _none}, tags=_NORM),
    OpDef("rms_norm", ("input", "normalized_shape", "weight", "eps"), modules={nn.RMSNorm: _none}, tags=_NORM),
    OpDef("normalize", ("input", "p", "dim", "eps", "out"), tags=_NORM),  # F.normalize: an RMS norm of the last dim
    OpDef("group_norm", ("input", "num_groups", "weight", "bias", "eps"), modules={nn.GroupNorm: _attrs(num_groups="num_groups", eps="eps")}, tags=_NORM),
    OpDef("instance_norm", ("input", "running_mean", "running_var", "weight", "bias", "use_input_stats", "momentum", "eps"),
          modules={nn.InstanceNorm1d: _none, nn.InstanceNorm2d: _none, nn.InstanceNorm3d: _none}, tags=_NORM),
    OpDef("embedding", ("input", "weight"), modules={nn.Embedding: _none}),
    OpDef("max_pool1d", _POOL, modules={nn.MaxPool1d: _none}, tags=frozenset({Tag.POOLING, Tag.MOVES_CODES})),
    OpDef("max_pool2d", _POOL, modules={nn.MaxPool2d: _none}, tags=frozenset({Tag.POOLING, Tag.MOVES_CODES})),
    OpDef("avg_pool1d", _AVG_POOL, modules={nn.AvgPool1d: _none}, tags=_AVG_POOL_TAGS),
    OpDef("avg_pool2d", _AVG_POOL, modules={nn.AvgPool2d: _none}, tags=_AVG_POOL_TAGS),
    *(OpDef(name, ("input", "output_size", "return_indices"), modules={cls: _attrs(output_size="output_size", return_indices="return_indices")},
            tags=frozenset({Tag.POOLING, Tag.MOVES_CODES})) for name, cls in (  # a max of codes is the code of the max
        ("adaptive_max_pool1d", nn.AdaptiveMaxPool1d), ("adaptive_max_pool2d", nn.AdaptiveMaxPool2d))),
    *(OpDef(name, ("input", "dim", "keepdim"), tags=frozenset({Tag.MOVES_CODES})) for name in ("amax", "amin")),  # x.amax(-1)
    # torch.max(x, dim): (values, indices); torch.max(a, b), torch.max(x): maximum, amax (lucid_fx/op_overloads.py)
    *(OpDef(name, ("input", "dim", "keepdim"), tags=frozenset({Tag.MOVES_CODES})) for name in ("max", "min")),
    OpDef("adaptive_avg_pool1d", ("input", "output_size"), modules={nn.AdaptiveAvgPool1d: _none}, tags=_AVG_POOL_TAGS),
    OpDef("adaptive_avg_pool2d", ("input", "output_size"), modules={nn.AdaptiveAvgPool2d: _none}, tags=_AVG_POOL_TAGS),
    OpDef("dropout", ("input", "p", "training", "inplace"), modules={nn.Dropout: _none, nn.Dropout1d: _none, nn.Dropout2d: _none}, tags=_MOVES_VIEW),
    OpDef("identity", modules={nn.Identity: _none}, derive=False, tags=_MOVES_VIEW),
    # shape ops
    OpDef("flatten", ("input", "start_dim", "end_dim"), modules={nn.Flatten: _attrs(start_dim="start_dim", end_dim="end_dim")}, tags=_MOVES_VIEW),
    OpDef("reshape", ("input", "shape"), aliases=("view",), tags=_MOVES_VIEW),
    OpDef("permute", ("input", "dims"), tags=_MOVES_VIEW),
    OpDef("transpose", ("input", "dim0", "dim1"), tags=_MOVES_VIEW),
    OpDef("contiguous", tags=_MOVES_VIEW),
    OpDef("squeeze", ("input", "dim"), tags=_MOVES_VIEW),
    OpDef("unsqueeze", ("input", "dim"), tags=_MOVES_VIEW),
    OpDef("expand", ("input", "size"), tags=_MOVES_VIEW),
    OpDef("getitem", ("input", "index"), derive=False, tags=_MOVES_VIEW),
    OpDef("cat", ("tensors", "dim"), aliases=("concat", "concatenate")),
    OpDef("stack", ("tensors", "dim")),
    OpDef("chunk", ("input", "chunks", "dim"), tags=_MOVES_VIEW),
    OpDef("split", ("input", "split_size_or_sections", "dim"), tags=_MOVES_VIEW),  # GPT-2's q, k, v = qkv.split(n, 2)
    OpDef("tensor_split", ("input", "indices_or_sections", "dim"), tags=_MOVES_VIEW),  # transformers' Mamba (its CPU path)
    OpDef("unbind", ("input", "dim"), tags=_MOVES_VIEW),  # ModernBERT's q, k, v = qkv.unbind(dim=2)
    OpDef("repeat_interleave", ("input", "repeats", "dim"), tags=frozenset({Tag.MOVES_CODES})),  # GPT-J's rotary sin/cos
    OpDef("roll", ("input", "shifts", "dims"), tags=frozenset({Tag.MOVES_CODES})),  # Swin's shifted windows
    OpDef("flip", ("input", "dims"), tags=frozenset({Tag.MOVES_CODES})),
    OpDef("interpolate", _RESAMPLE, modules={nn.Upsample: _attrs(**{a: a for a in _RESAMPLE[1:5]})}),  # observers.INSIDE_RANGE
    OpDef("im2col", _IM2COL, derive=False, modules={nn.Unfold: _attrs(**{a: a for a in _IM2COL[1:]})},
          tags=frozenset({Tag.MOVES_CODES})),  # F.unfold, nn.Unfold
    OpDef("pad", ("input", "pad", "mode", "value"), modules=_PADS),  # nn.ReflectionPad2d(1): pad(x, (1,) * 4, "reflect")
    OpDef("unflatten", ("input", "dim", "sizes"), tags=_MOVES_VIEW),  # nn.MultiheadAttention's q, k, v under torch.export
    *(OpDef(name, ("input", arg), modules={cls: _attrs(**{arg: arg})}, tags=frozenset({Tag.MOVES_CODES})) for name, arg, cls in (
        ("pixel_shuffle", "upscale_factor", nn.PixelShuffle), ("pixel_unshuffle", "downscale_factor", nn.PixelUnshuffle), ("channel_shuffle", "groups", nn.ChannelShuffle))),
    OpDef("size", ("input", "dim"), derive=False),
]


def ops_tagged(*tags: Tag) -> FrozenSet[str]:
    """The canonical ops that carry any of ``tags``.

    >>> sorted(ops_tagged(Tag.WEIGHTED))
    ['conv1d', 'conv2d', 'conv3d', 'linear']
    """
    return frozenset(op.name for op in OP_DEFS if op.tags & set(tags))


def _spelling(kind, target, op, params, renames=None, consts=None, inplace=False) -> Spelling:
    return Spelling(kind, target, op, tuple(params), dict(renames or {}), consts, inplace, caller_location())


_CLAMP_RENAMES = {"min_val": "min", "max_val": "max"}

# Spellings that derivation cannot find: other names, implied constants, operator.* forms.
EXTRA_SPELLINGS: List[Spelling] = [
    _spelling("call_function", F.relu6, "clamp", ("input", "inplace"), consts={"min": 0.0, "max": 6.0}),  # relu6(x) -> clamp(x, 0, 6)
    _spelling("call_module", nn.ReLU6, "clamp", ("input",), consts=lambda m: {"min": 0.0, "max": 6.0}),  # nn.ReLU6 -> clamp(0, 6)
    _spelling("call_function", F.hardtanh, "clamp", ("input", "min", "max", "inplace"), _CLAMP_RENAMES, {"min": -1.0, "max": 1.0}),  # hardtanh(x, a, b) -> clamp(x, a, b)
    _spelling("call_function", F.hardtanh_, "clamp", ("input", "min", "max"), _CLAMP_RENAMES, {"min": -1.0, "max": 1.0}, True),  # hardtanh_ -> clamp, in place
    _spelling("call_module", nn.Hardtanh, "clamp", ("input",), consts=lambda m: {"min": m.min_val, "max": m.max_val}),  # nn.Hardtanh(a, b) -> clamp(a, b)
    _spelling("call_function", F.softmax, "softmax", ("input", "dim", "_stacklevel", "dtype")),  # F.softmax's third slot differs
    _spelling("call_function", F.log_softmax, "log_softmax", ("input", "dim", "_stacklevel", "dtype")),
    _spelling("call_function", operator.add, "add", ("input", "other")),  # a + b
    _spelling("call_function", operator.iadd, "add", ("input", "other"), inplace=True),  # a += b
    _spelling("call_function", operator.sub, "sub", ("input", "other")),  # a - b
    _spelling("call_function", operator.isub, "sub", ("input", "other"), inplace=True),  # a -= b
    _spelling("call_function", operator.mul, "mul", ("input", "other")),  # a * b
    _spelling("call_function", operator.imul, "mul", ("input", "other"), inplace=True),  # a *= b
    _spelling("call_function", operator.truediv, "div", ("input", "other")),  # a / b
    _spelling("call_function", operator.itruediv, "div", ("input", "other"), inplace=True),  # a /= b
    _spelling("call_function", operator.neg, "neg", ("input",)),  # -a
    _spelling("call_function", operator.pow, "pow", ("input", "exponent")),  # a ** c
    _spelling("call_function", operator.abs, "abs", ("input",)),  # abs(a)
    _spelling("call_function", operator.matmul, "matmul", ("input", "other")),  # a @ b
    *(_spelling("call_function", getattr(operator, op), op, ("input", "other")) for op in ("gt", "ge", "lt", "le", "eq", "ne")),  # a > b
    _spelling("call_function", torch.where, "where", ("condition", "input", "other")),  # torch.where(c, a, b)
    _spelling("call_method", "where", "where", ("input", "condition", "other")),  # a.where(c, b)
    _spelling("call_function", operator.getitem, "getitem", ("input", "index")),  # a[i]
    _spelling("call_method", "__getitem__", "getitem", ("input", "index")),
    _spelling("call_function", getattr, "getattr", ("input", "name")),  # x.shape
    _spelling("call_method", "size", "size", ("input", "dim")),
    _spelling("call_method", "dim", "size", ("input",)),
    _spelling("call_function", torch.flatten, "flatten", ("input", "start_dim", "end_dim")),
    _spelling("call_function", F.unfold, "im2col", _IM2COL),  # F.unfold (x.unfold(dim, size, step) is a view)
    *(_spelling(kind, t, "transpose", ("input",), consts={"dim0": 0, "dim1": -1})  # x.t(), torch.t(x): 2-D or fewer dims
      for kind, t in (("call_method", "t"), ("call_function", torch.t))),
]


def derive_spellings(op: OpDef) -> Iterator[Spelling]:
    """All spellings of ``op`` that exist in this torch: functions, in-place forms, methods, modules."""
    where = f"lucid_fx/ops.py:OpDef({op.name!r})"
    if op.derive:
        seen = set()
        for name in (op.name, *op.aliases):
            for namespace in (torch, F, torch.special):
                for suffix, inplace in (("", False), ("_", True)):
                    fn = getattr(namespace, name + suffix, None)
                    if callable(fn) and id(fn) not in seen:
                        seen.add(id(fn))
                        yield Spelling("call_function", fn, op.name, op.params, {}, None, inplace, where)
            for suffix, inplace in (("", False), ("_", True)):
                if hasattr(torch.Tensor, name + suffix):
                    yield Spelling("call_method", name + suffix, op.name, op.params, {}, None, inplace, where)
    for cls, consts in op.modules.items():
        yield Spelling("call_module", cls, op.name, ("input",), {}, consts, False, where)
