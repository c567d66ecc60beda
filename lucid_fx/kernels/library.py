"""The ``lucid_fx::`` int8 ops: schemas, default (reference) kernels and fake kernels.

Each op is defined with ``torch.library`` and its default kernel is its reference implementation
(:mod:`lucid_fx.kernels.reference`, any device). :mod:`lucid_fx.kernels.cpu` and
:mod:`lucid_fx.kernels.cuda` register faster kernels for their device on top. The fake kernels
below give shapes, dtypes and strides without computing, so graphs holding these ops trace
under ``FakeTensorMode`` and ``torch.compile``.

Weights derived once (oneDNN-packed, padded for ``torch._int_mm``) live in a
:class:`WeightCache` shared by the device modules.

>>> q = torch.ops.lucid_fx.quantize_per_tensor(torch.tensor([0.0, 0.5, 9.0]), 0.1, 3, 0, 255, torch.uint8)
>>> q
tensor([ 3,  8, 93], dtype=torch.uint8)
>>> torch.ops.lucid_fx.dequantize_per_tensor(q, 0.1, 3)
tensor([0.0000, 0.5000, 9.0000])
"""

import functools
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional

import torch
import torch.nn.functional as F

from lucid_fx.kernels import attention, channel_lut, norms, quantize, softmax_matmul
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.checks import CHECKS, fail

__all__ = ["OPS", "LIB", "KERNELS", "WeightCache", "define_op", "register_kernel", "conv_output_shape", "op_name"]

_F32 = torch.float32
# Plain torch.library registration: ~10 us of dispatch a call, against ~45 us for a custom_op (measured).
LIB = torch.library.Library("lucid_fx", "DEF")
OPS: Dict[str, torch._ops.OpOverload] = {}
# Each op's kernels by device ("default": the reference), unchecked: programs call them without dispatch or checks.
KERNELS: Dict[str, Dict[str, Callable]] = {}


def define_op(fn: Callable, fake: Callable) -> None:
    name = fn.__name__  # lucid_fx::<name>: fn its default (reference) kernel, fake its shapes
    # Zero points, strides and sizes are graph constants: "int", not the inferred "SymInt".
    schema = torch.library.infer_schema(fn, mutates_args=()).replace("SymInt", "int")
    LIB.define(name + schema)
    LIB.impl(name, _checked(name, fn), "CompositeExplicitAutograd")  # the default kernel, for every device
    KERNELS[name] = {"default": fn}
    torch.library.register_fake(f"lucid_fx::{name}", _no_meta_mix(name, fake), lib=LIB)
    OPS[name] = getattr(torch.ops.lucid_fx, name).default


def op_name(node: Any) -> Optional[str]:
    """``"linear"`` for a graph node calling ``torch.ops.lucid_fx.linear`` (or an overload of it), else None."""
    if getattr(node, "op", None) != "call_function":
        return None
    packet = getattr(node.target, "_overloadpacket", node.target)
    return getattr(packet, "_qualified_op_name", "").partition("lucid_fx::")[2] or None


def register_kernel(name: str, device: str, fn: Callable) -> Callable:
    """Make ``fn`` the kernel of ``lucid_fx::name`` for ``device`` ("cpu", "cuda"); returns ``fn``.

    The op's input check (:data:`lucid_fx.kernels.checks.CHECKS`) runs first, whichever kernel serves."""
    LIB.impl(name, _checked(name, fn), device.upper())
    KERNELS[name][device] = fn
    return fn


def _no_meta_mix(name: str, fake: Callable) -> Callable:
    """The fake kernel also serves real calls with a tensor on ``meta`` (the dispatcher picks the
    meta kernel); with real tensors beside it that would return uninitialised memory as a result."""
    def kernel(*args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [t for a in args if isinstance(a, list) for t in a
                                                                     if isinstance(t, torch.Tensor)]
        on_meta = [t.device.type == "meta" for t in tensors]
        if any(on_meta) and not all(on_meta):
            real = next(t.device for t in tensors if t.device.type != "meta")
            fail(name, f"{sum(on_meta)} of its {len(tensors)} tensor inputs are on the meta device, which holds no data, "
                 f"and the others on {real}", "load real weights into the model, on the device of its inputs, and convert again")
        return fake(*args)

    return kernel


def _checked(name: str, fn: Callable) -> Callable:
    if name not in CHECKS:
        return fn

    def kernel(*args):
        CHECKS[name](*args)  # looked up per call (~50 ns), so the table can be swapped (benchmarks)
        return fn(*args)

    kernel.__name__, kernel.__qualname__, kernel.__wrapped__ = fn.__name__, fn.__qualname__, fn
    return kernel


def _empty(shape, like: torch.Tensor, dtype: torch.dtype, memory_format=torch.contiguous_format) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device, memory_format=memory_format)


def _fake_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype):
    ref.check_post_op(post_op)
    torch._check(
        qx.shape[-1] == qw.shape[1], lambda: f"linear: input has {qx.shape[-1]} features, weight {qw.shape[1]}"
    )
    return _empty((*qx.shape[:-1], qw.shape[0]), qx, ref.out_storage(qx, out_dtype))


def conv_output_shape(qx, qw, stride, padding, dilation) -> List:
    """Output shape (N, C_out, *spatial) of a convolution of ``qx`` with ``qw`` (sizes may be symbolic)."""
    spatial = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, k, s, p, d in zip(qx.shape[2:], qw.shape[2:], stride, padding, dilation)
    ]
    return [qx.shape[0], qw.shape[0], *spatial]


def _fake_conv1d(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                 post_op, out_dtype):
    ref.check_post_op(post_op)
    return _empty(conv_output_shape(qx, qw, stride, padding, dilation), qx, ref.out_storage(qx, out_dtype))


def _fake_conv2d(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                 post_op, out_dtype):
    ref.check_post_op(post_op)
    shape = conv_output_shape(qx, qw, stride, padding, dilation)
    return _empty(shape, qx, ref.out_storage(qx, out_dtype), ref.conv2d_memory_format(qx))


def _fake_conv2d_add(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, qother,
                     other_scale, other_zp, out_scale, out_zp, post_op, out_dtype):
    out = _fake_conv2d(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale,
                       out_zp, post_op, out_dtype)
    torch._check(
        tuple(torch.broadcast_shapes(qother.shape, out.shape)) == tuple(out.shape),
        lambda: f"conv2d_add: other {tuple(qother.shape)} does not broadcast to the conv result {tuple(out.shape)}",
    )
    return out


def _fake_binary(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op):
    ref.check_post_op(post_op)
    return torch.empty_like(qa.to(_F32) + qb.to(_F32), dtype=qa.dtype)


def _fake_matmul(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp):
    return _empty(torch.matmul(qa.to(_F32), qb.to(_F32)).shape, qa, qa.dtype)


def _fake_lut(q, table):
    torch._check(table.numel() == 256, lambda: f"a lookup table has 256 entries, got {table.numel()}")
    return torch.empty_like(q, dtype=table.dtype)


def _fake_cat(qs, scales, zps, dim, out_scale, out_zp):
    return torch.cat([q.to(qs[0].dtype) for q in qs], dim)


def _fake_avg_pool2d(q, scale, zp, kernel_size, stride, padding, ceil_mode, count_include_pad, out_scale, out_zp):
    y = F.avg_pool2d(q.to(_F32), kernel_size, stride or None, padding, ceil_mode, count_include_pad)
    return _empty(y.shape, q, q.dtype, ref._pool_format(q))


def _fake_adaptive_avg_pool2d(q, scale, zp, output_size, out_scale, out_zp):
    return _empty(F.adaptive_avg_pool2d(q.to(_F32), output_size).shape, q, q.dtype, ref._pool_format(q))


def _fake_mean(q, scale, zp, dim, keepdim, out_scale, out_zp):
    return _empty(q.to(_F32).mean(dim, keepdim).shape, q, q.dtype)


def _fake_max_pool2d(q, kernel_size, stride, padding, dilation, ceil_mode):
    like = torch.empty(q.shape, device="meta")
    shape = F.max_pool2d(like, kernel_size, stride or kernel_size, padding, dilation, ceil_mode).shape
    return _empty(shape, q, q.dtype, ref._pool_format(q))


# (reference kernel, fake kernel) per op; the op's name is the reference function's name. The
# quantize at the float-to-int8 boundary also refuses NaN and ±inf (lucid_fx.kernels.quantize).
_DEFINITIONS = [
    (quantize.quantize_per_tensor, lambda x, scale, zp, qmin, qmax, dtype: torch.empty_like(x, dtype=dtype)),
    (ref.dequantize_per_tensor, lambda q, scale, zp: torch.empty_like(q, dtype=_F32)),
    (quantize.quantize_per_channel, lambda x, scale, zp, axis, qmin, qmax, dtype: torch.empty_like(x, dtype=dtype)),
    (ref.dequantize_per_channel, lambda q, scale, zp, axis: torch.empty_like(q, dtype=_F32)),
    (ref.linear, _fake_linear),
    (ref.conv1d, _fake_conv1d),
    (ref.conv2d, _fake_conv2d),
    (ref.conv2d_add, _fake_conv2d_add),
    (ref.add, _fake_binary),
    (ref.mul, _fake_binary),
    (ref.matmul, _fake_matmul),
    (ref.lut, _fake_lut),
    (channel_lut.channel_lut, channel_lut.fake_channel_lut),  # a table per channel: a standalone batch norm
    (ref.softmax, lambda q, scale, zp, dim, out_scale, out_zp: _empty(q.shape, q, q.dtype)),  # contiguous, as torch.softmax
    (attention.masked_softmax, attention.fake_masked_softmax),
    (softmax_matmul.softmax_matmul, softmax_matmul.fake_softmax_matmul),  # softmax(s) @ v, a grid a row
    (softmax_matmul.probabilities_qdq, softmax_matmul.fake_probabilities_qdq),  # reference mode's image of it
    (ref.cat, _fake_cat),
    (ref.avg_pool2d, _fake_avg_pool2d),
    (ref.adaptive_avg_pool2d, _fake_adaptive_avg_pool2d),
    (ref.mean, _fake_mean),
    (ref.max_pool2d, _fake_max_pool2d),
    (norms.layer_norm, norms.fake_norm), (norms.rms_norm, norms.fake_norm),
    (norms.group_norm, norms.fake_group_norm),  # in its input's layout
]
for _fn, _fake in _DEFINITIONS:
    define_op(_fn, _fake)


def _version_of(weight: torch.Tensor) -> Optional[int]:
    try:
        return weight._version
    except RuntimeError:  # inference tensors keep no version counter; they cannot change outside inference mode
        return None


class WeightCache:
    """Forms of weight tensors built once per weight: packed for oneDNN, padded for ``_int_mm``.

    Entries are keyed by the weight tensor's identity (held weakly, so they go with the
    weight) and stamped with its ``_version``: an in-place change rebuilds them, and a new
    tensor (``.to(device)``, a reassigned parameter) is a new key. ``builds`` counts builds.

    >>> cache = WeightCache()
    >>> w = torch.ones(2)
    >>> [cache.get(w, "double", lambda: w * 2).tolist() for _ in range(3)]
    [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    >>> cache.builds
    1
    >>> _ = w.add_(1)
    >>> cache.get(w, "double", lambda: w * 2).tolist(), cache.builds
    ([4.0, 4.0], 2)
    """

    def __init__(self) -> None:
        # id(weight) -> [weak reference to the weight, version, {key: built}]. A plain dict with a
        # weak reference per entry: WeakIdKeyDictionary builds a reference object on every lookup,
        # which measured 3 us a call, a tenth of a batch-1 linear's own overhead.
        self._entries: Dict[int, list] = {}
        self.builds = 0

    def _slot(self, weight: torch.Tensor) -> Optional[list]:
        slot = self._entries.get(id(weight))
        if slot is None or slot[0]() is not weight:
            return None
        return slot

    def _current(self, weight: torch.Tensor) -> Dict[Hashable, object]:
        """The entries of ``weight``, emptied if the weight changed since they were built."""
        version = _version_of(weight)
        slot = self._slot(weight)
        if slot is None or slot[1] != version:
            slot = [weakref.ref(weight, functools.partial(_forget, self._entries, id(weight))), version, {}]
            self._entries[id(weight)] = slot
        return slot[2]

    def get(self, weight: torch.Tensor, key: Hashable, build: Callable[[], object]) -> object:
        """The cached ``build()`` for ``(weight, key)``, built now if missing or stale."""
        built = self._current(weight)
        if key not in built:
            built[key] = build()
            self.builds += 1
        return built[key]

    def peek(self, weight: torch.Tensor, key: Hashable) -> Optional[object]:
        """The cached value for ``(weight, key)`` if it is there and current, else None."""
        slot = self._slot(weight)
        return slot[2].get(key) if slot is not None and slot[1] == _version_of(weight) else None

    def put(self, weight: torch.Tensor, key: Hashable, value: object) -> None:
        """Store ``value`` for ``(weight, key)``, replacing what was there (counted as a build)."""
        self._current(weight)[key] = value
        self.builds += 1

    def has(self, weight: torch.Tensor, key: Hashable) -> bool:
        """Whether ``(weight, key)`` is cached and current."""
        slot = self._slot(weight)
        return slot is not None and slot[1] == _version_of(weight) and key in slot[2]

    def count(self, weight: torch.Tensor, match: Callable[[Hashable], bool]) -> int:
        """How many current entries of ``weight`` have a key that ``match`` accepts."""
        slot = self._slot(weight)
        if slot is None or slot[1] != _version_of(weight):
            return 0
        return sum(1 for key in slot[2] if match(key))

    def __len__(self) -> int:
        """How many weights have entries (a weight that died has none)."""
        return sum(1 for slot in self._entries.values() if slot[0]() is not None)

    def clear(self) -> None:
        """Drop every entry (the build count stays)."""
        self._entries.clear()


def _forget(entries: Dict[int, list], key: int, ref: "weakref.ref") -> None:
    # The weight died: drop its entry, unless its id was already reused by a newer weight.
    slot = entries.get(key)
    if slot is not None and slot[0] is ref:
        del entries[key]
