"""The lowering context: what lowering rules see (the rules layer; the lower_to_int8 pass builds one).

What lowering rules see and emit through: :class:`LoweringContext` holds the new graph being built by :mod:`lower_to_int8`, each value in
float and/or integer-code form (:class:`QValue`), the observers' qparams and the weights'
int8 forms.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._placement import Placement, Runs
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.kernels.target import Target
from lucid_fx.computed_weights import PER_CALL_WHY, parameter_value
from lucid_fx.node_refs import layer_groups
from lucid_fx.ops import canonical
from lucid_fx.quantization.dtypes import QDtype, to_qdtype
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.weight import quantize_layer_weight

__all__ = ["QValue", "LoweringContext", "float_memory_format", "readers", "watched"]
_ops = torch.ops.lucid_fx
INT32_MAX = 2**31 - 1
ACTIVATION_SPAN = 255  # largest |code - zero_point| of a uint8 or int8 activation


@dataclass(frozen=True)
class QValue:
    """A quantized value in the new graph: the node holding the integer codes and its grid."""

    node: fx.Node
    scale: float
    zero_point: int
    qdtype: QDtype
    channels_last: bool = False  # codes laid out NHWC (what oneDNN convolutions compute in)
    # Whether the codes are laid out as the float model's value is (True), may not be (False:
    # channels-last codes the float model has as NCHW, or computed from such), or unknown (None:
    # lower_to_int8 infers it from the inputs of the rule that made them).
    float_layout: Optional[bool] = None


def _is_observer_call(node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(node.target, str) and node.target.startswith(OBSERVERS + ".")


def watched(node: Any) -> Any:
    """The value an observer call watches (``node`` itself where it is no observer call)."""
    while isinstance(node, fx.Node) and _is_observer_call(node):
        node = node.args[0]
    return node


def readers(value: fx.Node) -> Tuple[List[fx.Node], List[fx.Node]]:
    """``value`` (a prepared node) and the observer calls watching it, and every other node reading any of them."""
    aliases, reads = [value], []
    for node in aliases:
        for user in node.users:
            (aliases if _is_observer_call(user) else reads).append(user)
    return aliases, reads


class LoweringContext:
    """What a lowering rule may use: the new graph, values in either form, weights, qparams."""

    def __init__(self, prepared: fx.GraphModule, root: nn.Module, target: Target) -> None:
        self.prepared, self.root, self.target = prepared, root, target  # target: the hardware convert lowers for
        self.backend = target.backend
        # where the model's values are, so its int8 constants live there too
        self.device = next((t.device for t in itertools.chain(prepared.parameters(), prepared.buffers())), None)
        self.graph = fx.Graph()
        self.observers = getattr(prepared, OBSERVERS, nn.ModuleDict())
        self.weight_observers = getattr(prepared, WEIGHT_OBSERVERS, nn.ModuleDict())
        self._float: Dict[fx.Node, fx.Node] = {}
        self._quant: Dict[fx.Node, QValue] = {}
        self._qparams: Dict[str, Tuple[float, int, QDtype]] = {}
        self._laid_out: Dict[fx.Node, QValue] = {}  # codes restored to the float model's layout
        self._constants = 0
        self.declined: Dict[str, str] = {}  # node name -> why its lowering rule had to decline
        self.absorbed: Dict[str, Tuple[str, Placement]] = {}  # node name -> (the node whose kernel computes it, how and why)

    def absorb(self, name: str, by: fx.Node, why: str, runs: Runs = Runs.KERNEL) -> None:
        """Say that node ``name`` has no value of its own: the kernel (or table) of node ``by`` computes it."""
        self.absorbed[name] = (by.name, Placement(runs, why, (name,)))

    # -- qparams ------------------------------------------------------------------------------
    def qparams_of(self, node: fx.Node) -> Optional[Tuple[float, int, QDtype]]:
        """(scale, zero_point, qdtype) of the observer watching ``node``'s output, if any."""
        key = node.meta.get(_meta.OBSERVER)
        if key is None or key not in self.observers:
            return None
        if key not in self._qparams:
            observer = self.observers[key]
            scale, zero_point = observer.calculate_qparams()
            if scale.numel() != 1:
                raise ValueError(
                    f"activation observer of node {node.name!r} is per-channel; lowering needs per-tensor "
                    "activation qparams. Use a per-tensor observer for activations in the QConfig"
                )
            self._qparams[key] = (float(scale), int(zero_point), getattr(observer, "qdtype", to_qdtype("quint8")))
        return self._qparams[key]

    # -- values -----------------------------------------------------------------------------
    def set_float(self, node: fx.Node, new: fx.Node) -> None:
        self._float[node] = new

    def set_quant(self, node: fx.Node, value: QValue) -> None:
        self._quant[node] = value
        _tag_codes(value, node)

    def has_quant(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and (node in self._quant or self.qparams_of(node) is not None)

    def float_of(self, node: Any) -> Any:
        """The value of ``node`` as a float tensor in the new graph (dequantized once if needed)."""
        if not isinstance(node, fx.Node):
            return node
        if node not in self._float:
            q = self._in_float_layout(node, self._quant[node])  # float code sees the float model's strides
            self._float[node] = self.call(_ops.dequantize_per_tensor, q.node, q.scale, q.zero_point)
            self._float[node].meta[_meta.SOURCE] = node.name
            _tag_type(self._float[node], node, torch.float32)
        return self._float[node]

    def quant_or_none(self, node: Any) -> Optional[QValue]:
        """``node``'s codes where it has them (:meth:`quant_of`), else None (a float value, a constant)."""
        return self.quant_of(node) if isinstance(node, fx.Node) and self.has_quant(node) else None

    def quant_of(self, node: fx.Node) -> QValue:
        """The value of ``node`` as integer codes (quantized once, with its observer's qparams)."""
        if node not in self._quant:
            qparams = self.qparams_of(node)
            if qparams is None:
                raise LookupError(f"node {node.name!r} has no observer, so it has no qparams")
            scale, zp, qdtype = qparams
            q = self.call(
                _ops.quantize_per_tensor, self.float_of(node), scale, zp, qdtype.quant_min, qdtype.quant_max, qdtype.storage
            )
            self.set_quant(node, QValue(q, scale, zp, qdtype, float_layout=True))
        return self._quant[node]

    def channels_last_of(self, node: fx.Node) -> QValue:
        """``node``'s codes in channels-last layout, converted once: conv kernels compute NHWC and
        their outputs keep the layout of their input, so one conversion serves the whole net."""
        q = self.quant_of(node)
        if not q.channels_last:
            nhwc = self.graph.call_method("contiguous", (q.node,), {"memory_format": torch.channels_last})
            q = QValue(nhwc, q.scale, q.zero_point, q.qdtype, True, float_memory_format(node)[0] == torch.channels_last)
            self.set_quant(node, q)
        return q

    def float_layout_of(self, node: fx.Node) -> QValue:
        """``node``'s codes laid out as the float model's value is there, restored once if needed:
        code that reads strides (``view``, float ops, the model's outputs) must see the float model's."""
        return self._in_float_layout(node, self.quant_of(node))

    def _in_float_layout(self, node: fx.Node, q: QValue) -> QValue:
        if q.float_layout is not False:
            return q
        if node not in self._laid_out:
            memory_format, exact = float_memory_format(node)
            # clone gives the canonical strides in size-1 dims too, where contiguous keeps the old ones
            method = "clone" if exact else "contiguous"
            codes = self.graph.call_method(method, (q.node,), {"memory_format": memory_format})
            self._laid_out[node] = QValue(codes, q.scale, q.zero_point, q.qdtype, memory_format == torch.channels_last, True)
            _tag_codes(self._laid_out[node], node)
        return self._laid_out[node]

    def map_float(self, args: Any) -> Any:
        return fx.node.map_arg(args, self.float_of)

    # -- emitting -----------------------------------------------------------------------------
    def call(self, target: Any, *args: Any) -> fx.Node:
        return self.graph.call_function(target, tuple(args))

    def constant(self, name: str, value: torch.Tensor) -> fx.Node:
        """Register ``value`` as a buffer of the converted module and read it with get_attr."""
        attr = f"_lucid_{name}"
        while hasattr(self.root, attr):
            self._constants += 1
            attr = f"_lucid_{name}_{self._constants}"
        self.root.register_buffer(attr, value.to(self.device) if self.device is not None else value)
        return self.graph.get_attr(attr)

    def output_qvalue(self, node: fx.Node, out: fx.Node, channels_last: bool = False) -> QValue:
        scale, zp, qdtype = self.qparams_of(node)
        float_layout = float_memory_format(node)[0] == torch.channels_last if channels_last else None
        return QValue(out, scale, zp, qdtype, channels_last, float_layout)

    # -- weights ------------------------------------------------------------------------------
    def _may_overflow(self, node: fx.Node, codes: torch.Tensor) -> bool:
        """Whether some input could overflow the kernel's int32 accumulator: an output channel sums
        K products of an activation code (|x - zero_point| <= 255) and a weight code, so the
        worst case is 255 * sum_k |w[n, k]|, exact for these weights and any input."""
        magnitudes = codes.reshape(codes.shape[0], -1).to(torch.int32).abs()  # widened first: int8 -128.abs() is -128
        worst = ACTIVATION_SPAN * int(magnitudes.sum(1, dtype=torch.int64).max())
        if worst <= INT32_MAX:
            return False
        k = codes[0].numel()
        why = f"int32 accumulator could overflow: K={k}, worst case sum {worst:.3g} > 2^31-1; runs in float"
        self.declined[node.name] = why
        warnings.warn(
            f"convert: node {node.name!r} ({canonical(node).op}, K={k} inputs per output) could overflow the "
            f"int8 kernel's int32 accumulator (worst case {worst:.3g} > 2^31-1), so it runs in float instead "
            "(see lucid_fx_convert_report.float_ops). To keep it int8, split it into layers with fewer inputs",
            RuntimeWarning,
            stacklevel=2,
        )
        return True

    def attr(self, node: Any) -> Optional[torch.Tensor]:
        """The tensor a ``get_attr`` node reads (a constant of the converted model, or a prepared weight), else None."""
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = self.prepared
            for part in node.target.split("."):
                value = getattr(value, part)
            return value
        return None

    def constant_value(self, node: Any) -> Optional[torch.Tensor]:
        """:meth:`attr`, or a value the graph computes from parameters alone (``lucid_fx.computed_weights``):
        ``F.normalize(self.w)``, the pieces nn.MultiheadAttention's cross-attention cuts from ``in_proj_weight``."""
        value = self.attr(node)
        return value if value is not None else parameter_value(node)

    def quantized_weight(self, node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node, Optional[fx.Node]]]:
        """(int8 weight, per-channel scales, float bias) get_attr nodes for a linear/conv node,
        a module (``nn.Linear``) or a function (``F.linear`` on get_attr weights)."""
        key = node.meta.get(_meta.WEIGHT_OBSERVER)
        if node.op == "call_module":
            module = self.prepared.get_submodule(node.target)
            weight, bias = module.weight, module.bias
            observer = self.weight_observers[key] if key in self.weight_observers else None
            if isinstance(observer, FakeQuantize) and node.meta.get(_meta.BN_FOLDED):
                observer = observer.activation_post_process  # folding changed the weight: observe it afresh
            base = node.target.replace(".", "_")
        else:
            call = canonical(node)
            weight, bias = self.constant_value(call.args.get("weight")), self.constant_value(call.args.get("bias"))
            if weight is None or (call.args.get("bias") is not None and bias is None):
                self.declined[node.name] = PER_CALL_WHY
                return None
            observer = self.observers[key] if key in self.observers else None
            base = node.name
        codes, scale = quantize_layer_weight(weight, observer, self.target, layer_groups(self.prepared, node))
        if self._may_overflow(node, codes):
            return None
        w = self.constant(f"{base}_qweight", codes)
        s = self.constant(f"{base}_wscale", scale)
        b = self.constant(f"{base}_bias", bias.detach().float()) if bias is not None else None
        return w, s, b


def float_memory_format(node: fx.Node) -> Tuple[torch.memory_format, bool]:
    """The memory format of ``node``'s value in the float model (from the shapes prepare recorded;
    contiguous when unknown), and whether its shape is ambiguous there: a 4-D value with a size-1
    channel or spatial dim is contiguous in both formats, with different strides."""
    meta = node.meta.get(_meta.TENSOR_META)
    shape = tuple(getattr(meta, "shape", ()))
    memory_format = getattr(meta, "memory_format", None) or torch.contiguous_format
    return memory_format, len(shape) == 4 and 1 in shape[1:]


def _tag_type(new: fx.Node, source: fx.Node, dtype: Optional[torch.dtype] = None) -> None:
    tensor_meta = source.meta.get(_meta.TENSOR_META)
    if tensor_meta is not None and hasattr(tensor_meta, "shape"):
        new.meta[_meta.VALUE_TYPE] = (tuple(tensor_meta.shape), dtype or tensor_meta.dtype)


def _tag_codes(value: QValue, source: fx.Node) -> None:
    meta = value.node.meta
    meta.setdefault(_meta.SOURCE, source.name)
    meta[_meta.QPARAMS] = (value.scale, value.zero_point, value.qdtype.name)
    _tag_type(value.node, source, value.qdtype.storage)


