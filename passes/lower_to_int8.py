"""lower_to_int8: turn a calibrated graph into int8 kernels, by lowering table.

Reads ``node.meta[DECISION]``, ``[OP]``, ``[FUSED_INTO]``, ``[OBSERVER]`` and
``[WEIGHT_OBSERVER]`` plus the observers' statistics. Builds a new graph in which observed values
are ``uint8``/``int8`` tensors with constant scale and zero point. Each quantized op, or fused
group, is looked up by the tuple of its canonical ops (``("conv2d", "add", "relu")``) in the
backend's lowering table, falling back to the generic table. A value is quantized or dequantized
only where a consumer needs the other form, and only once. Ops with no lowering run in float
between a dequantize and a quantize, and are listed in the returned report.

Writes on the new graph's nodes ``[SOURCE]`` (the prepared node whose value each one computes),
``[QPARAMS]`` on every node that outputs integer codes, and ``[LOWERING]``, ``[OBSERVER_KIND]``,
``[DECISION]`` and ``[INTERVAL]`` on the node that ends each lowered group, so that the converted
graph can be inspected (to_networkx) and compared with the float one (compare) by node name.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.passes.insert_observers import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.quantization.dtypes import QDtype, to_qdtype
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.functional import quantize
from lucid_fx.quantization.qparams import calculate_qparams

__all__ = ["lower_to_int8", "lowering_table", "quantize_weight", "QValue", "LoweringContext", "ConvertReport"]

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


@dataclass
class ConvertReport:
    """What convert did: which nodes became int8 kernels and which ran in float."""

    backend: str
    lowered: Dict[str, str] = field(default_factory=dict)  # node -> rule key
    float_ops: Dict[str, str] = field(default_factory=dict)  # node -> why it stayed float

    def __str__(self) -> str:
        lines = [f"backend {self.backend}: {len(self.lowered)} int8 kernels, {len(self.float_ops)} ops in float"]
        lines += [f"  float: {name} ({why})" for name, why in self.float_ops.items()]
        return "\n".join(lines)


def _is_observer_call(node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(node.target, str) and node.target.startswith(OBSERVERS + ".")


class LoweringContext:
    """What a lowering rule may use: the new graph, values in either form, weights, qparams."""

    def __init__(self, prepared: fx.GraphModule, root: nn.Module, backend: str, weight_range: Tuple[int, int]) -> None:
        self.prepared, self.root, self.backend = prepared, root, backend
        self.weight_range = weight_range
        self.graph = fx.Graph()
        self.observers = getattr(prepared, OBSERVERS, nn.ModuleDict())
        self.weight_observers = getattr(prepared, WEIGHT_OBSERVERS, nn.ModuleDict())
        self._float: Dict[fx.Node, fx.Node] = {}
        self._quant: Dict[fx.Node, QValue] = {}
        self._qparams: Dict[str, Tuple[float, int, QDtype]] = {}
        self._constants = 0
        self.declined: Dict[str, str] = {}  # node name -> why its lowering rule had to decline

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
            q = self._quant[node]
            self._float[node] = self.call(_ops.dequantize_per_tensor, q.node, q.scale, q.zero_point)
            self._float[node].meta[_meta.SOURCE] = node.name
            _tag_type(self._float[node], node, torch.float32)
        return self._float[node]

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
            self.set_quant(node, QValue(q, scale, zp, qdtype))
        return self._quant[node]

    def channels_last_of(self, node: fx.Node) -> QValue:
        """``node``'s codes in channels-last layout, converted once: conv kernels compute NHWC and
        their outputs keep the layout of their input, so one conversion serves the whole net."""
        q = self.quant_of(node)
        if not q.channels_last:
            nhwc = self.graph.call_method("contiguous", (q.node,), {"memory_format": torch.channels_last})
            q = QValue(nhwc, q.scale, q.zero_point, q.qdtype, True)
            self.set_quant(node, q)
        return q

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
        self.root.register_buffer(attr, value)
        return self.graph.get_attr(attr)

    def output_qvalue(self, node: fx.Node, out: fx.Node, channels_last: bool = False) -> QValue:
        scale, zp, qdtype = self.qparams_of(node)
        return QValue(out, scale, zp, qdtype, channels_last)

    # -- weights ------------------------------------------------------------------------------
    def _may_overflow(self, node: fx.Node, codes: torch.Tensor) -> bool:
        """Whether some input could overflow the kernel's int32 accumulator: an output channel sums
        K products of an activation code (|x - zero_point| <= 255) and a weight code, so the
        worst case is 255 * sum_k |w[n, k]|, exact for these weights and any input."""
        worst = ACTIVATION_SPAN * int(codes.reshape(codes.shape[0], -1).abs().sum(1, dtype=torch.int64).max())
        if worst <= INT32_MAX:
            return False
        k = codes[0].numel()
        why = f"int32 accumulator could overflow: K={k}, worst case sum {worst:.3g} > 2^31-1; runs in float"
        self.declined[node.name] = why
        warnings.warn(
            f"convert: node {node.name!r} ({node.meta[_meta.OP].op}, K={k} inputs per output) could overflow the "
            f"int8 kernel's int32 accumulator (worst case {worst:.3g} > 2^31-1), so it runs in float instead "
            "(see lucid_fx_convert_report.float_ops). To keep it int8, split it into layers with fewer inputs",
            RuntimeWarning,
            stacklevel=2,
        )
        return True

    def _attr(self, node: Any) -> Optional[torch.Tensor]:
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = self.prepared
            for part in node.target.split("."):
                value = getattr(value, part)
            return value
        return None

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
            call = node.meta[_meta.OP]
            weight, bias = self._attr(call.args.get("weight")), self._attr(call.args.get("bias"))
            if weight is None or (call.args.get("bias") is not None and bias is None):
                return None  # a weight computed in the graph has no constant int8 form
            observer = self.observers[key] if key in self.observers else None
            base = node.name
        codes, scale = quantize_weight(weight, observer, self.weight_range)
        if self._may_overflow(node, codes):
            return None
        w = self.constant(f"{base}_qweight", codes)
        s = self.constant(f"{base}_wscale", scale)
        b = self.constant(f"{base}_bias", bias.detach().float()) if bias is not None else None
        return w, s, b


def _trained_scale(observer: Optional[nn.Module], weight: torch.Tensor, weight_range: Tuple[int, int]):
    """The per-channel scale a QAT weight FakeQuantize trained with, if it is on the kernel's grid."""
    if not isinstance(observer, FakeQuantize) or not observer.has_data or not observer.qscheme.is_symmetric:
        return None
    if (observer.quant_min, observer.quant_max) != tuple(weight_range) or observer.scale.numel() not in (1, weight.shape[0]):
        return None
    return observer.scale.detach().float().expand(weight.shape[0]).to(weight.device)


def quantize_weight(weight: torch.Tensor, observer: Optional[nn.Module], weight_range: Tuple[int, int]):
    """Per-channel symmetric int8 codes and scales of ``weight`` on the kernel's grid.

    The weight is observed afresh (batch-norm folding may have changed it since prepare) by a copy
    of the observer the QConfig chose; a per-tensor observer's range is used for every channel.
    A QAT weight keeps the qparams it was trained with, so the int8 weight is the one training saw."""
    weight = weight.detach()
    qmin, qmax = weight_range
    grid = QDtype(f"qint[{qmin},{qmax}]", 8, True, qmin, qmax, torch.int8)
    trained = _trained_scale(observer, weight, weight_range)
    if trained is not None:
        return quantize(weight, trained, torch.zeros_like(trained, dtype=torch.int64), grid, ch_axis=0), trained
    if observer is not None and hasattr(observer, "reset_min_max_vals"):
        observer = copy.deepcopy(observer)
        observer.reset_min_max_vals()
        observer(weight)
        lo, hi = observer.min_val, observer.max_val
        if lo.dim() == 0:
            lo, hi = lo.expand(weight.shape[0]), hi.expand(weight.shape[0])
    else:
        flat = weight.reshape(weight.shape[0], -1)
        lo, hi = flat.amin(1), flat.amax(1)
    scale, zero_point = calculate_qparams(lo, hi, "per_channel_symmetric", grid)
    return quantize(weight, scale, zero_point, grid, ch_axis=0), scale.float()


def lowering_table(lowerings: Dict[str, Dict[Tuple[str, ...], Any]], backend: str) -> Dict[Tuple[str, ...], Any]:
    """The rules convert uses on ``backend``: the generic table with the backend's overrides."""
    return {**lowerings.get("generic", {}), **lowerings.get(backend, {})}


def _tag_type(new: fx.Node, source: fx.Node, dtype: Optional[torch.dtype] = None) -> None:
    tensor_meta = source.meta.get(_meta.TENSOR_META)
    if tensor_meta is not None and hasattr(tensor_meta, "shape"):
        new.meta[_meta.VALUE_TYPE] = (tuple(tensor_meta.shape), dtype or tensor_meta.dtype)


def _tag_codes(value: QValue, source: fx.Node) -> None:
    meta = value.node.meta
    meta.setdefault(_meta.SOURCE, source.name)
    meta[_meta.QPARAMS] = (value.scale, value.zero_point, value.qdtype.name)
    _tag_type(value.node, source, value.qdtype.storage)


def _tag_lowered(ctx: LoweringContext, node: fx.Node, value: QValue, rule_key: str) -> None:
    meta = value.node.meta
    meta[_meta.SOURCE] = node.name
    meta[_meta.LOWERING] = rule_key
    for key in (_meta.OP, _meta.DECISION, _meta.INTERVAL, _meta.INTERVAL_RULE, _meta.MODULE_PATH):
        if key in node.meta:
            meta[key] = node.meta[key]
    observer = ctx.observers[node.meta[_meta.OBSERVER]] if node.meta.get(_meta.OBSERVER) in ctx.observers else None
    if observer is not None:
        meta[_meta.OBSERVER_KIND] = type(observer).__name__


def _tag_new_nodes(graph: fx.Graph, after: Optional[fx.Node], source: fx.Node) -> None:
    """Attribute every node emitted since ``after`` that has no source yet to ``source``."""
    node = after.next if after is not None else next(iter(graph.nodes), None)
    root = graph._root  # the sentinel that closes fx's circular node list
    while node is not None and node is not root:
        node.meta.setdefault(_meta.SOURCE, source.name)
        node = node.next


def _reads_only_shape(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()``, ``x.dim()``: the same answer for codes as for float values."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr":
        return len(node.args) > 1 and node.args[1] in ("shape", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim")


def _group(node: fx.Node, graph_nodes: List[fx.Node]) -> List[fx.Node]:
    end = node.meta.get(_meta.FUSED_INTO)
    if end is None:
        return [node]
    return [n for n in graph_nodes if n.meta.get(_meta.FUSED_INTO) == end]


def _copy_float(ctx: LoweringContext, node: fx.Node) -> fx.Node:
    new = ctx.graph.node_copy(node, ctx.float_of)
    ctx.set_float(node, new)
    return new


def lower_to_int8(
    prepared: fx.GraphModule, lowerings: Dict[str, Dict[Tuple[str, ...], Any]], backend: str, weight_range: Tuple[int, int]
) -> Tuple[fx.GraphModule, ConvertReport]:
    """Lower a calibrated (and batch-norm folded) prepared graph; returns the new module and a report."""
    root = prepared  # buffers for packed weights go on the prepared module, which becomes the root
    ctx = LoweringContext(prepared, root, backend, weight_range)
    report = ConvertReport(backend)
    nodes = list(prepared.graph.nodes)
    # Observer calls are aliases of the value they watch.
    alias: Dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if _is_observer_call(node):
            source = node.args[0]
            alias[node] = alias.get(source, source)
    resolve = lambda n: alias.get(n, n) if isinstance(n, fx.Node) else n  # noqa: E731

    def arg_float(n):
        return ctx.float_of(resolve(n))

    def arg_shape(n):
        # Shape queries read the codes already there: no dequantize just to learn a shape.
        n = resolve(n)
        if n not in ctx._float and n in ctx._quant and not ctx._quant[n].channels_last:
            return ctx._quant[n].node
        return ctx.float_of(n)

    table = lowering_table(lowerings, backend)
    for node in nodes:
        if node in alias:
            continue
        if node.op == "placeholder":
            new = ctx.graph.node_copy(node)
            new.meta[_meta.SOURCE] = node.name
            ctx.set_float(node, new)
            continue
        if node.op == "get_attr":
            ctx.set_float(node, ctx.graph.node_copy(node))
            continue
        if node.op == "output":
            ctx.graph.output(fx.node.map_arg(node.args[0], arg_float))
            continue
        decision = node.meta.get(_meta.DECISION)
        kind = decision.kind if decision is not None else "float"
        if kind == "fused":
            continue  # emitted with the last node of its group
        members = _group(node, nodes)
        key = tuple(m.meta[_meta.OP].op for m in members)
        if kind == "shared":
            key = ("shared",)
        rule = table.get(key) if kind in ("fixed", "statistics", "shared") else None
        lowered = None
        tail = next(iter(reversed(ctx.graph.nodes)), None)
        if rule is not None:
            lowered = rule(ctx, members, resolve)
        if lowered is not None:
            ctx.set_quant(node, lowered)
            _tag_lowered(ctx, node, lowered, "+".join(key))
            _tag_new_nodes(ctx.graph, tail, node)
            report.lowered[node.name] = "+".join(key)
            continue
        # No int8 kernel: the group runs in float on dequantized inputs.
        for member in members:
            read = arg_shape if _reads_only_shape(member) else arg_float
            new = ctx.graph.node_copy(member, lambda n, read=read: read(n))
            new.meta[_meta.SOURCE] = member.name
            ctx.set_float(member, new)
        if kind in ("fixed", "statistics", "shared") or len(members) > 1:
            declined = next((ctx.declined[m.name] for m in members if m.name in ctx.declined), "lowering declined")
            why = "no lowering rule for " + "+".join(key) if rule is None else declined
            report.float_ops[node.name] = why
    gm = fx.GraphModule(root, ctx.graph, "QuantizedModule")
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, report
