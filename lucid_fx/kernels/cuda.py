"""The CUDA kernels: :mod:`lucid_fx.kernels.int_mm`'s GEMMs with operands padded to the shapes
cuBLASLt's ``torch._int_mm`` accepts, and, where Triton is installed, each GEMM's epilogue, each
quantization, dequantization, table lookup, elementwise add or mul and global average as one fused kernel
(:mod:`lucid_fx.kernels.cuda_fused`); without Triton, the same steps as torch ops."""

import torch
import torch.nn.functional as F

from lucid_fx.kernels import cuda_fused, int_mm, quantize
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.int_mm import conv_float_out, int8_conv, int8_linear
from lucid_fx.kernels.library import conv_output_shape, register_kernel

__all__: list = []


def _conv2d_add(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, qother, other_scale,
                other_zp, out_scale, out_zp, post_op, out_dtype, pad=True):
    ref.check_post_op(post_op)
    layout = ref.conv2d_memory_format(qx)
    fused = cuda_fused.available(qx, "epilogue")
    if fused and list(qother.shape) == conv_output_shape(qx, qw, stride, padding, dilation):
        out = _conv_fused(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, post_op, out_scale,
                          out_zp, ref.out_storage(qx, out_dtype), pad, (qother, other_scale, other_zp), layout)
        return ref.to_layout(out, layout)
    y = conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad)
    y = y + ref.dequantize_per_tensor(qother, other_scale, other_zp)
    out = ref.finish(y, post_op, out_scale, out_zp, ref.out_storage(qx, out_dtype))
    return ref.to_layout(out, layout)


def _cuda_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype):
    if not cuda_fused.available(qx, "epilogue"):
        return int8_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype, pad=True)
    ref.check_post_op(post_op)
    weight, rows = int_mm.linear_weight(qw, True), qx.reshape(-1, qx.shape[-1])
    if cuda_fused.available(qx, "operand"):
        cols, correction, _ = cuda_fused.gemm_operand(rows, x_zp)
    else:
        cols, correction = int_mm.as_int8(rows.contiguous(), x_zp)
    acc = int_mm.raw_gemm(cols, weight, True)[: rows.shape[0]]
    y = cuda_fused.gemm_epilogue(acc, correction, weight.row_sums, x_scale, w_scale, bias, post_op, out_scale, out_zp,
                                 ref.out_storage(qx, out_dtype))
    return y.reshape(*qx.shape[:-1], weight.n)


def _cuda_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
               post_op, out_dtype):
    if not cuda_fused.available(qx, "epilogue"):
        return int8_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                         post_op, out_dtype, pad=True)
    ref.check_post_op(post_op)
    layout = ref.conv2d_memory_format(qx) if qx.dim() == 4 else torch.contiguous_format
    out = _conv_fused(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, post_op, out_scale,
                      out_zp, ref.out_storage(qx, out_dtype), True, memory_format=layout)
    return ref.to_layout(out, layout)


def _conv_fused(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, post_op, out_scale, out_zp,
                dtype, pad, other=None, memory_format=torch.contiguous_format) -> torch.Tensor:
    """A convolution's codes (or float32 result) with the fused epilogue (:mod:`lucid_fx.kernels.cuda_fused`)
    after :func:`~lucid_fx.kernels.int_mm.conv_gemm` (groups 1) or a float convolution on integer values
    (grouped), written in ``memory_format``; ``other`` ``(codes, scale, zero_point)``, of the result's
    shape, is a residual added before the post-op."""
    one_d = qx.dim() == 3
    if one_d:
        qx, stride, padding, dilation = qx.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation]
    if groups == 1:
        kernel = (1, qw.shape[2]) if one_d else qw.shape[2:]
        acc, correction, weight, (n, ho, wo) = int_mm.conv_gemm(qx, x_zp, qw, kernel, stride, padding, dilation, pad)
        rows, c_out = weight.row_sums, weight.n
    else:
        w = int_mm.PREPARED.get(qw, ("conv_float",), lambda: qw.to(torch.float32))
        # the integers q - zp, exact in float32 (one pass where the fused dequantize serves)
        values = (cuda_fused.dequantize(qx, 1.0, x_zp) if cuda_fused.available(qx, "dequantize")
                  else qx.to(torch.float32).sub_(x_zp))
        y = F.conv2d(values, w.unsqueeze(2) if one_d else w, None, stride, padding, dilation, groups)
        (n, c_out, ho, wo), correction, rows = y.shape, 0, None
        acc = y.permute(0, 2, 3, 1).reshape(-1, c_out)  # a view where y is channels-last or one image
    out = torch.empty((n, c_out, ho, wo), dtype=dtype, device=qx.device,
                      memory_format=torch.contiguous_format if one_d else memory_format)
    if not _rows_viewable(out):
        out = torch.empty((n, ho, wo, c_out), dtype=dtype, device=qx.device).permute(0, 3, 1, 2)
    if other is not None:
        codes, other_scale, other_zp = other
        other = (codes.permute(0, 2, 3, 1).reshape(-1, c_out), other_scale, other_zp)
    cuda_fused.gemm_epilogue(acc, correction, rows, x_scale, w_scale, bias, post_op, out_scale, out_zp, dtype, other,
                             out=out.permute(0, 2, 3, 1).view(-1, c_out))
    return out.squeeze(2) if one_d else out


def _rows_viewable(out: torch.Tensor) -> bool:
    """Whether (N, C, H, W) ``out`` has a (N*H*W, C) view: channels-last, or one image."""
    try:
        out.permute(0, 2, 3, 1).view(-1, out.shape[1])
    except RuntimeError:
        return False
    return True


def _quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype):
    if x.is_floating_point() and cuda_fused.available(x, "quantize"):
        ref._check_range(quant_min, quant_max, dtype)
        return cuda_fused.quantize(x, scale, zero_point, quant_min, quant_max, dtype)
    return quantize.quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype)


def _dequantize_per_tensor(q, scale, zero_point):
    if q.dtype in (torch.uint8, torch.int8) and cuda_fused.available(q, "dequantize"):
        return cuda_fused.dequantize(q, scale, zero_point)
    return ref.dequantize_per_tensor(q, scale, zero_point)


def _lut(q, table):
    if q.dtype in (torch.uint8, torch.int8) and table.numel() == 256 and cuda_fused.available(q, "lut"):
        return cuda_fused.lut(q, table)
    return ref.lut(q, table)


def _spatial_mean(q) -> bool:
    eight_bit = q.dim() == 4 and q.dtype in (torch.uint8, torch.int8) and q.numel() > 0
    return eight_bit and cuda_fused.available(q, "global_average")


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
        if qa.dtype in (torch.uint8, torch.int8) and qb.dtype == qa.dtype and cuda_fused.available(qa, "binary"):
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
