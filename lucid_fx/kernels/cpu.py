"""CPU kernels: oneDNN int8 linear and convolutions, with a ``torch._int_mm`` fallback.

oneDNN (``torch.ops.onednn.q*_pointwise``) reads plain uint8 activations and int8 weights packed
once per weight (:data:`PACKED`). Ops computed in float32 on the codes (add, mul, matmul,
softmax) and table lookups have leaner CPU kernels in :mod:`lucid_fx.kernels.cpu_float`; every
other op runs its reference kernel (:mod:`lucid_fx.kernels.reference`).

How oneDNN is called matters as much as which op, measured without VNNI: a linear runs as a
1x1 convolution over a channels-last view of its rows (1.1-2.2x faster than oneDNN's linear,
same codes); the activation zero point goes into the bias wherever every output sums the whole
weight window and the raw accumulator is exact in float32 (linears, unpadded convolutions;
10-45% faster, ties aside the same codes; see :mod:`lucid_fx.kernels.zero_point`); convolution weights are
packed for the input shape they meet (up to :data:`SHAPED_PACKS` shapes; 0.83 against 1.29 ms
for 512 channels 3x3 on 7x7); int8 activations enter as uint8 (s8 measured 5x slower).

oneDNN convolutions compute in channels-last: an NCHW input costs a layout copy of the result (1.15 ms NHWC
against 1.60 ms NCHW for a 64-channel 3x3 conv on 56x56). Each oneDNN call costs ~50-100 us here. On AMX CPUs
some of its convolutions are wrong: each pack is checked there first (:mod:`lucid_fx.kernels.onednn_check`).
Without VNNI, oneDNN's u8 x s8 kernels add pairs of products in int16 with saturation (``vpmaddubsw``), so a
full-range int8 weight can be many steps off: :func:`weight_quant_range` gives the device's exact weight grid
(``[-64, 63]`` there); a weight outside it runs the ``_int_mm`` fallback (correct, slower), with a warning.

>>> weight_quant_range(torch.device("cuda"))
(-128, 127)
"""

import contextlib
import warnings
from typing import Iterator, Optional, Tuple, Union

import torch

from lucid_fx.kernels import native
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.conv_native import post_op_after_float
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels.int_mm import conv_float_out, int8_conv, int8_linear
from lucid_fx.kernels.linear_row import conv_is_row, float_post_op, linear_row, row_bounds, row_out_scale, takes_row
from lucid_fx.kernels.row_cache import kept_row_linear
from lucid_fx.kernels.library import WeightCache, conv_output_shape, register_kernel
from lucid_fx.kernels.onednn_check import conv_agrees
from lucid_fx.kernels.target import NARROW_GRID, is_depthwise, resolve_target
from lucid_fx.kernels.zero_point import (  # noqa: F401  (FOLDED_*: read as cpu.* by tests and users)
    FOLDED_BIASES, FOLDED_GRIDS, _float, _folded_zero_point, _unpadded_zero_point, _zero_point_exact_on_onednn,
    signed_zero_point_bias, to_signed)

__all__ = ["weight_quant_range", "use_onednn", "onednn_available", "PACKED", "FOLDED_BIASES", "FOLDED_GRIDS", "SHAPED_PACKS"]

# oneDNN-packed weights (or None: run the fallback), once per weight and geometry.
PACKED = WeightCache()
_state = {"onednn": None}


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's quantized linear and convolution ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        ops = torch.ops.onednn
        return all(hasattr(ops, name) for name in ("qlinear_prepack", "qlinear_pointwise", "qconv_prepack",
                                                   "qconv1d_pointwise", "qconv2d_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def _onednn_on() -> bool:
    if _state["onednn"] is None:
        _state["onednn"] = onednn_available()
    return _state["onednn"]


@contextlib.contextmanager
def use_onednn(enabled: bool) -> Iterator[None]:
    """Run CPU linear/convolutions through oneDNN (when available) or through the ``_int_mm`` fallback.

    >>> with use_onednn(False):
    ...     pass  # lucid_fx::linear and conv ops take the _int_mm path here
    """
    previous = _onednn_on()
    _state["onednn"] = bool(enabled) and onednn_available()
    try:
        yield
    finally:
        _state["onednn"] = previous


def weight_quant_range(device: Union[torch.device, str]) -> Tuple[int, int]:
    """The int8 weight grid ``(qmin, qmax)`` whose products the device's int8 kernels compute exactly:
    :attr:`Target.weight_range <lucid_fx.kernels.target.Target.weight_range>` of ``device``.

    ``(-64, 63)`` on a CPU without VNNI (oneDNN's int16 pair sums saturate beyond it),
    ``(-128, 127)`` on CPUs with VNNI and on CUDA (``torch._int_mm`` accumulates in int32). On
    the CPU this follows :func:`~lucid_fx.kernels.cpu_features.cpu_features`, so it can be forced.
    """
    return resolve_target(device=device).weight_range


def _cpu_target():  # the kernels' choices on this CPU
    return resolve_target("cpu")


def _exact_on_onednn(qw: torch.Tensor, groups: int = 1) -> bool:
    """Whether oneDNN computes ``qw``'s products exactly on this real CPU (depthwise, in ``groups``: always)."""
    if detected_cpu_features().vnni or is_depthwise(qw.shape, groups):
        return True
    qmin, qmax = NARROW_GRID
    if int(qw.min()) >= qmin and int(qw.max()) <= qmax:
        return True
    if _cpu_target().cpu.vnni:
        return False  # a richer CPU is forced (tests): its full-grid weights take the exact fallback
    warnings.warn(
        f"int8 weight {tuple(qw.shape)} has codes outside {(qmin, qmax)}; oneDNN would saturate on this CPU "
        "(no VNNI), so it runs on the slower _int_mm path. Quantize weights to weight_quant_range('cpu').",
        RuntimeWarning, stacklevel=4)
    return False


def _pack(qw: torch.Tensor, key, build, groups: int = 1):
    def checked():  # build() is None where oneDNN's pack failed its check here (onednn_check.conv_agrees)
        built = build() if _exact_on_onednn(qw, groups) else None
        return None if built is None else (built, torch.zeros(qw.shape[0], dtype=torch.int64))

    return PACKED.get(qw, key, checked)


def _as_uint8(q: torch.Tensor, zp: int) -> Tuple[torch.Tensor, int]:
    # int8 code c with zero point z is uint8 code c + 128 (sign bit flipped) with zero point z + 128.
    return ((q.view(torch.uint8) ^ 128), zp + 128) if q.dtype == torch.int8 else (q, zp)


def _onednn_out(out_scale: float, out_zp: int, dtype: torch.dtype) -> Tuple[float, int, Optional[torch.dtype]]:
    """oneDNN's (output_scale, output_zero_point, output_dtype); int8 results are made as uint8."""
    if dtype == torch.float32:
        return 1.0, 0, torch.float32  # oneDNN requires the identity qparams for float output
    return out_scale, out_zp + (128 if dtype == torch.int8 else 0), None


def _from_uint8(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (out ^ 128).view(torch.int8) if dtype == torch.int8 else out


def _linear_as_conv() -> bool:  # without VNNI (Target.linear_as_conv: Linear(1024) 104 vs 170 us at batch 1)
    return _cpu_target().linear_as_conv


def _small_linear(rows, zp_u8: int, qw, w_scale, bias, x_scale: float, out_scale: float, out_zp: int, post_op: str,
                  dtype, conv: bool = False) -> Optional[torch.Tensor]:
    """The linear of uint8 ``rows`` (M, K) (a 1x1 convolution's pixels: ``conv``, as the program asks) on the engine
    that takes it off oneDNN here, or None. Its constants are this call's scale and bias's (row_cache.py keeps them with
    those very tensors: a whole RowLinear cached by weight alone kept a replaced bias)."""
    engine = takes_row(_cpu_target(), _onednn_on(), post_op, dtype, rows.shape[0], qw.shape[0], qw[0].numel(), conv)
    row = engine and kept_row_linear(qw, w_scale, bias, x_scale, zp_u8, row_out_scale(out_scale, dtype), engine, post_op, rows.shape[0])
    return None if row is None else linear_row(rows, row, out_zp, *row_bounds(dtype, out_zp, post_op), dtype)


def _linear_pack(qw: torch.Tensor, w_scale: torch.Tensor, as_conv: bool):
    if not as_conv:
        return _pack(qw, "linear", lambda: torch.ops.onednn.qlinear_prepack(qw.contiguous(), None))
    n, k = qw.shape
    return _pack(qw, "linear as 1x1 conv", lambda: torch.ops.onednn.qconv_prepack(
        qw.contiguous().view(n, k, 1, 1), w_scale.to(torch.float32), 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None))


def linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype):
    ref.check_post_op(post_op)
    args = (qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype)
    if not _onednn_on() or qx.numel() == 0:
        return int8_linear(*args, pad=False)
    dtype = ref.out_storage(qx, out_dtype)
    mnk = (qx.numel() // qw.shape[1], *qw.shape)
    if float_post_op(_cpu_target(), True, post_op, dtype, mnk):  # SiLU without VNNI, at every size; a small gelu
        return native.post_op_codes(linear(*args[:6], 1.0, 0, "none", torch.float32), post_op, out_scale, out_zp, dtype)
    # int8 activations go in as uint8 (s8 measured 5x slower without VNNI); the zero point into the bias where exact.
    rows = qx if qx.dim() == 2 and qx.is_contiguous() else qx.reshape(-1, qx.shape[-1]).contiguous()
    rows, zp_u8 = _as_uint8(rows, x_zp)
    out = _small_linear(rows, zp_u8, qw, w_scale, bias, x_scale, out_scale, out_zp, post_op, dtype)
    if out is not None:
        return out.view(*qx.shape[:-1], -1)
    zp_u8, bias = _folded_zero_point(qw, w_scale, bias, x_scale, zp_u8)
    # A zero point left to oneDNN is exact in its linear; its convolution rounds the compensation
    # in float32 once the accumulator passes 2^24 (measured: 2 codes off).
    as_conv = _linear_as_conv() and zp_u8 == 0 and post_op in ref.ONEDNN_CONV_POST_OPS
    exact = _zero_point_exact_on_onednn(qw, zp_u8)  # else as int8 codes, their zero point in the bias, where exact
    signed = None if exact else signed_zero_point_bias(qw, w_scale, bias, x_scale, zp_u8)
    packed = _linear_pack(qw, w_scale, as_conv) if exact or signed is not None else None
    if packed is None:
        return int8_linear(*args, pad=False)
    if signed is not None:
        rows, zp_u8, bias = to_signed(rows), 0, signed
    weight, zeros = packed
    w_scale = _float(w_scale)
    m, k = rows.shape
    if as_conv:
        # (M, K) row-major codes are a (1, K, 1, M) channels-last image, and the (1, N, 1, M)
        # channels-last result is the (M, N) output: no copy either way.
        image = rows.as_strided((1, k, 1, m), (m * k, 1, m * k, k))
        scale, zp, onednn_dtype = _onednn_out(out_scale, out_zp, dtype)
        out = torch.ops.onednn.qconv2d_pointwise.default(  # .default: resolving the overload costs ~18 us a call
            image, x_scale, 0, weight, w_scale, zeros, bias, [1, 1], [0, 0], [1, 1], 1, scale, zp, onednn_dtype,
            *ref.onednn_post_op(post_op),
        )
        return _from_uint8(out.permute(0, 2, 3, 1).reshape(*qx.shape[:-1], qw.shape[0]), dtype)
    scale, zp = (1.0, 0) if dtype == torch.float32 else (out_scale, out_zp)
    out = torch.ops.onednn.qlinear_pointwise.default(  # the result's dtype given: int8 codes in give int8 by default
        rows, x_scale, zp_u8, weight, w_scale, zeros, bias, scale, zp, dtype,
        *ref.onednn_post_op(post_op),
    )
    return out.view(*qx.shape[:-1], qw.shape[0])


# Input shapes a convolution weight is packed for, at most; further shapes share a generic pack.
SHAPED_PACKS = 4


def _conv_pack(qw, w_scale, x_shape, stride, padding, dilation, groups):
    """The oneDNN pack of ``qw`` for this geometry and input shape, where it takes oneDNN's best layout (0.83 against
    1.29 ms for 512 -> 512 channels 3x3 on 7x7; the prepack's x qparams change nothing). A weight seen with more
    than SHAPED_PACKS shapes (a model run at many sizes) gets a generic pack for the rest."""
    if not _onednn_on():
        return None
    geometry, shape = ("conv", tuple(stride), tuple(padding), tuple(dilation), groups), tuple(x_shape)
    key = (*geometry, shape)
    if not PACKED.has(qw, key) and PACKED.count(qw, lambda k: k[:5] == geometry and len(k) == 6) >= SHAPED_PACKS:
        key, x_shape = geometry, None

    def build():  # checked on the shape it is first built for, where oneDNN's AMX kernels run (onednn_check.py)
        packed = torch.ops.onednn.qconv_prepack(qw.contiguous(), w_scale.to(torch.float32), 1.0, 0, stride, padding,
                                                dilation, groups, None if x_shape is None else list(x_shape))
        return packed if conv_agrees(packed, qw, w_scale, shape, stride, padding, dilation, groups) else None
    return _pack(qw, key, build, groups)


def _conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp, post_op,
          out_dtype):
    ref.check_post_op(post_op)
    dtype = ref.out_storage(qx, out_dtype)
    fuses = ref.ONEDNN_CONV_POST_OPS if qx.dim() == 4 else ref.ONEDNN_CONV1D_POST_OPS  # others: after the float result
    if post_op not in fuses or post_op_after_float(_cpu_target(), _onednn_on(), post_op, dtype, qx.shape, qw, groups,
                                                   stride, padding, dilation):
        y = _conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, 1.0, 0, "none", torch.float32)
        return native.post_op_codes(y, post_op, out_scale, out_zp, dtype)
    if conv_is_row(qx.shape, qw.shape, padding, groups):  # squeeze-excite's: a linear of one row
        out = _small_linear(*_as_uint8(qx.reshape(1, -1), x_zp), qw, w_scale, bias, x_scale, out_scale, out_zp,
                            post_op, dtype, conv=True)
        if out is not None:
            return out.view(1, -1, 1, 1)
    packed = _conv_pack(qw, w_scale, qx.shape, stride, padding, dilation, groups)
    if packed is None:
        return int8_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                         post_op, out_dtype, pad=False)
    qx, x_zp = _as_uint8(qx, x_zp)  # oneDNN convolutions read only u8 activations
    x_zp, bias = _unpadded_zero_point(qw, w_scale, bias, x_scale, x_zp, padding)
    scale, zp, onednn_dtype = _onednn_out(out_scale, out_zp, dtype)
    kernel = torch.ops.onednn.qconv2d_pointwise.default if qx.dim() == 4 else torch.ops.onednn.qconv1d_pointwise.default
    out = kernel(qx, x_scale, x_zp, packed[0], w_scale.to(torch.float32), packed[1], bias, stride, padding,
                 dilation, groups, scale, zp, onednn_dtype, *ref.onednn_post_op(post_op))
    layout = ref.conv2d_memory_format(qx) if qx.dim() == 4 else torch.contiguous_format
    return ref.to_layout(_from_uint8(out, dtype), layout)


def conv2d_add(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, qother, other_scale,
               other_zp, out_scale, out_zp, post_op, out_dtype):
    """``post(conv(x) + other)``; integer results use oneDNN's fused "sum" post-op.

    The fused form adds into a channels-last uint8 copy of ``other`` (oneDNN writes into that
    accumulator). It has no float-output form (oneDNN requires accum scale 1 there), so a float
    result, a broadcast ``other``, or no oneDNN runs the float conv result plus dequantized ``other``.
    """
    ref.check_post_op(post_op)
    dtype = ref.out_storage(qx, out_dtype)
    packed = _conv_pack(qw, w_scale, qx.shape, stride, padding, dilation, groups)
    conv_shape = conv_output_shape(qx, qw, stride, padding, dilation)
    if packed is None or dtype == torch.float32 or list(qother.shape) != conv_shape:
        if packed is None:
            y = conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad=False)
        else:
            y = _conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, 1.0, 0, "none",
                      torch.float32)
        y = y + ref.dequantize_per_tensor(qother, other_scale, other_zp)
        return ref.to_layout(ref.finish(y, post_op, out_scale, out_zp, dtype), ref.conv2d_memory_format(qx))
    layout = ref.conv2d_memory_format(qx)
    qx, x_zp = _as_uint8(qx, x_zp)
    accum, other_zp = _as_uint8(qother, other_zp)
    fresh = accum.contiguous(memory_format=torch.channels_last)
    accum = fresh if fresh is not qother else fresh.clone(memory_format=torch.channels_last)
    x_zp, bias = _unpadded_zero_point(qw, w_scale, bias, x_scale, x_zp, padding)
    scale, zp, _ = _onednn_out(out_scale, out_zp, dtype)
    out = torch.ops.onednn.qconv2d_pointwise.binary(
        qx, x_scale, x_zp, packed[0], w_scale.to(torch.float32), packed[1], accum, bias, stride, padding,
        dilation, groups, scale, zp, None, other_scale, other_zp, "sum", 1.0, *ref.onednn_post_op(post_op),
    )
    return ref.to_layout(_from_uint8(out, dtype), layout)


register_kernel("linear", "cpu", linear)
register_kernel("conv1d", "cpu", _conv)
register_kernel("conv2d", "cpu", _conv)
register_kernel("conv2d_add", "cpu", conv2d_add)
