"""Tampered quantization parameters: load refuses each, naming the node, the argument and the value.

Before these checks, each file below loaded: qmin > qmax then failed on the first call
(``ValueError: range [255, 0] does not fit in torch.uint8``), the others ran and returned garbage.
"""

import io
import math
import re

import pytest
import torch

import lucid_fx
from _saved_files import KINDS, nodes, raw, write

_ALTERED = "convert never writes that, so the file was altered or corrupted after lucid_fx.save wrote it: save the model again"


def _args(data, name):
    return next(n for n in nodes(data) if n["name"] == name)["args"]["v"]


def _set_arg(name, index, value):
    return lambda data: _args(data, name).__setitem__(index, value)


def _set_element(buffer, index, value):
    return lambda data: data["model"]["buffers"][buffer].__setitem__(index, value)


# quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype) and linear(qx, x_scale, x_zp,
# qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype) of the "mlp" file (uint8 activations)
TAMPERED = {
    "range-upside-down": (
        ("mlp", lambda d: _args(d, "quantize_per_tensor").__setitem__(slice(3, 5), [255, 0])),
        "node 'quantize_per_tensor' (call_function) in the root module: argument quant_min of lucid_fx.quantize_per_tensor "
        "is 255 and quant_max 0, but quant_min must be below quant_max",
    ),
    "range-past-the-dtype": (
        ("mlp", _set_arg("quantize_per_tensor", 4, 256)),
        "argument quant_max of lucid_fx.quantize_per_tensor is 256, but it must lie in [0, 255], the range of the codes' dtype",
    ),
    "zero-point-off-the-grid": (
        ("mlp", _set_arg("quantize_per_tensor", 2, 1000)),
        "node 'quantize_per_tensor' (call_function) in the root module: argument zero_point of lucid_fx.quantize_per_tensor "
        "is 1000, but it must lie in [0, 255], the range of the codes' dtype",
    ),
    "nan-scale": (
        ("mlp", _set_arg("quantize_per_tensor", 1, math.nan)),
        "argument scale of lucid_fx.quantize_per_tensor is nan, but a scale must be finite and above 0",
    ),
    "negative-scale": (
        ("mlp", _set_arg("quantize_per_tensor", 1, -0.05)),
        "argument scale of lucid_fx.quantize_per_tensor is -0.05, but a scale must be finite and above 0",
    ),
    "kernel-input-zero-point": (
        ("mlp", _set_arg("linear", 2, -1)),
        "node 'linear' (call_function) in the root module: argument x_zp of lucid_fx.linear is -1, but it must lie in [0, 255]",
    ),
    "kernel-output-zero-point": (
        ("mlp", _set_arg("linear", 7, 300)),
        "node 'linear' (call_function) in the root module: argument out_zp of lucid_fx.linear is 300, but it must lie in [0, 255]",
    ),
    "kernel-output-scale": (
        ("cnn", _set_arg("conv2d", 10, math.inf)),
        "node 'conv2d' (call_function) in the root module: argument out_scale of lucid_fx.conv2d is inf, but a scale must be "
        "finite and above 0",
    ),
    "nan-weight-scale": (
        ("mlp", _set_element("_lucid_2_wscale", 1, math.nan)),
        "node 'linear_1' (call_function) in the root module: argument w_scale of lucid_fx.linear (tensor '_lucid_2_wscale') "
        "is nan at element 1, but a scale must be finite and above 0",
    ),
    "zero-weight-scale": (
        ("mlp", _set_element("_lucid_0_wscale", 3, 0.0)),
        "argument w_scale of lucid_fx.linear (tensor '_lucid_0_wscale') is 0.0 at element 3, but a scale must be finite and above 0",
    ),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_quantization_parameters_are_refused_at_load(case):
    (kind, edit), message = TAMPERED[case]
    data = raw(kind)
    edit(data)
    with pytest.raises(ValueError, match=re.escape(message) + ".*" + re.escape(_ALTERED)):
        lucid_fx.load(write(data))


def test_the_output_grid_of_a_kernel_returning_float_is_not_read():
    # linear_1 returns float32 (out_dtype): its out_scale and out_zp are unused, so nothing fails on a call
    data = raw("mlp")
    _args(data, "linear_1")[6:8] = [math.nan, 1000]
    x = torch.randn(4, 8)
    assert torch.equal(lucid_fx.load(write(data))(x), lucid_fx.load(write(raw("mlp")))(x))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_untouched_files_pass_and_compute_what_was_saved(kind):
    build, shape = KINDS[kind]
    torch.manual_seed(0)
    saved = build()
    buffer = io.BytesIO()
    lucid_fx.save(saved, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)  # the checks refuse nothing convert wrote
    x = torch.randn(2, *shape)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), saved.eval()(x))
