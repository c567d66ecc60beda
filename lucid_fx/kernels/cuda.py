"""The CUDA registrations of the int8 GEMM kernels: :mod:`lucid_fx.kernels.int_mm` with operands
padded to the shapes cuBLASLt's ``torch._int_mm`` accepts."""

from lucid_fx.kernels import cuda_fused
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.int_mm import conv_float_out, conv_fused, int8_conv, int8_linear
from lucid_fx.kernels.library import conv_output_shape, register_kernel

__all__: list = []


def _conv2d_add(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, qother, other_scale,
                other_zp, out_scale, out_zp, post_op, out_dtype, pad=True):
    ref.check_post_op(post_op)
    if groups == 1 and cuda_fused.available(qx) and list(qother.shape) == conv_output_shape(qx, qw, stride, padding,
                                                                                             dilation):
        out = conv_fused(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, post_op, out_scale, out_zp,
                         ref.out_storage(qx, out_dtype), pad, (qother, other_scale, other_zp))
        return ref.to_layout(out, ref.conv2d_memory_format(qx))
    y = conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad)
    y = y + ref.dequantize_per_tensor(qother, other_scale, other_zp)
    out = ref.finish(y, post_op, out_scale, out_zp, ref.out_storage(qx, out_dtype))
    return ref.to_layout(out, ref.conv2d_memory_format(qx))


def _cuda_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype):
    return int8_linear(qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype, pad=True)


def _cuda_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
               post_op, out_dtype):
    return int8_conv(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, out_scale, out_zp,
                     post_op, out_dtype, pad=True)


register_kernel("linear", "cuda", _cuda_linear)
register_kernel("conv1d", "cuda", _cuda_conv)
register_kernel("conv2d", "cuda", _cuda_conv)
register_kernel("conv2d_add", "cuda", _conv2d_add)
