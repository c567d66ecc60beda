"""The CUDA kernels: :mod:`lucid_fx.kernels.int_mm`'s GEMMs with operands padded to the shapes
cuBLASLt's ``torch._int_mm`` accepts, and, where Triton is installed, each GEMM's epilogue, each
quantization, dequantization, table lookup, elementwise add or mul and global average as one fused kernel
(:mod:`lucid_fx.kernels.cuda_fused`); without Triton, the same steps as torch ops."""

import torch

from lucid_fx.kernels import cuda_fused, quantize
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.int_mm import conv_float_out, conv_fused, int8_conv, int8_linear
from lucid_fx.kernels.library import conv_output_shape, register_kernel

__all__: list = []


def _conv2d_add(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, qother, other_scale,
                other_zp, out_scale, out_zp, post_op, out_dtype, pad=True):
    ref.check_post_op(post_op)
    layout = ref.conv2d_memory_format(qx)
    if cuda_fused.available(qx) and list(qother.shape) == conv_output_shape(qx, qw, stride, padding, dilation):
        out = conv_fused(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, post_op, out_scale,
                         out_zp, ref.out_storage(qx, out_dtype), pad, (qother, other_scale, other_zp), layout)
        return ref.to_layout(out, layout)
    y = conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad)
    y = y + ref.dequantize_per_tensor(qother, other_scale, other_zp)
    out = ref.finish(y, post_op, out_scale, out_zp, ref.out_storage(qx, out_dtype))
    return ref.to_layout(out, layout)


def _cuda_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype):
    return int8_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype, pad=True)


def _cuda_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
               post_op, out_dtype):
    return int8_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                     post_op, out_dtype, pad=True)


def _quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype):
    if x.is_floating_point() and cuda_fused.available(x):
        ref._check_range(quant_min, quant_max, dtype)
        return cuda_fused.quantize(x, scale, zero_point, quant_min, quant_max, dtype)
    return quantize.quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype)


def _dequantize_per_tensor(q, scale, zero_point):
    if q.dtype in (torch.uint8, torch.int8) and cuda_fused.available(q):
        return cuda_fused.dequantize(q, scale, zero_point)
    return ref.dequantize_per_tensor(q, scale, zero_point)


def _lut(q, table):
    if q.dtype in (torch.uint8, torch.int8) and table.numel() == 256 and cuda_fused.available(q):
        return cuda_fused.lut(q, table)
    return ref.lut(q, table)


def _spatial_mean(q) -> bool:
    return q.dim() == 4 and q.dtype in (torch.uint8, torch.int8) and q.numel() > 0 and cuda_fused.available(q)


def _adaptive_avg_pool2d(q, scale, zp, output_size, out_scale, out_zp):
    if _spatial_mean(q) and all(size == 1 for size in output_size):
        return ref.to_layout(cuda_fused.global_average(q, scale, zp, out_scale, out_zp), ref.conv2d_memory_format(q))
    return ref.adaptive_avg_pool2d(q, scale, zp, output_size, out_scale, out_zp)


def _mean(q, scale, zp, dim, keepdim, out_scale, out_zp):
    if _spatial_mean(q) and sorted(d % 4 for d in dim) == [2, 3]:
        out = cuda_fused.global_average(q, scale, zp, out_scale, out_zp)
        return out if keepdim else out.view(out.shape[:2])
    return ref.mean(q, scale, zp, dim, keepdim, out_scale, out_zp)


def _elementwise(mul: bool):
    fallback = ref.mul if mul else ref.add

    def kernel(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op):
        ref.check_post_op(post_op)
        if qa.dtype in (torch.uint8, torch.int8) and qb.dtype == qa.dtype and cuda_fused.available(qa):
            out = cuda_fused.binary(mul, qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op)
            if out is not None:
                return out
        return fallback(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op)

    kernel.__name__ = kernel.__qualname__ = fallback.__name__
    return kernel


register_kernel("linear", "cuda", _cuda_linear)
register_kernel("conv1d", "cuda", _cuda_conv)
register_kernel("conv2d", "cuda", _cuda_conv)
register_kernel("conv2d_add", "cuda", _conv2d_add)
register_kernel("quantize_per_tensor", "cuda", _quantize_per_tensor)
register_kernel("dequantize_per_tensor", "cuda", _dequantize_per_tensor)
register_kernel("lut", "cuda", _lut)
register_kernel("add", "cuda", _elementwise(mul=False))
register_kernel("mul", "cuda", _elementwise(mul=True))
register_kernel("adaptive_avg_pool2d", "cuda", _adaptive_avg_pool2d)
register_kernel("mean", "cuda", _mean)
