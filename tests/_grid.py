"""Rounding an int8 model's float result onto an observer's grid, to compare it with the reference model."""

import torch


def on_output_grid(prepared, node: str, y: torch.Tensor):
    """``y`` rounded onto the grid of ``node``'s observer in ``prepared``, and that grid's step.

    A converted model gives a result that nothing reads as codes in float (passes/fold_dequantize.py),
    where the reference (simulated) model rounds it: rounding the int8 model's result the same way
    compares the two kernel for kernel."""
    observer = prepared.lucid_fx_observers[node]
    scale, zp = (float(v.reshape(-1)[0]) for v in observer.calculate_qparams())
    qmin, qmax = observer.quant_min, observer.quant_max
    dtype = torch.uint8 if qmin >= 0 else torch.int8
    codes = torch.ops.lucid_fx.quantize_per_tensor(y, scale, int(zp), qmin, qmax, dtype)
    return torch.ops.lucid_fx.dequantize_per_tensor(codes, scale, int(zp)), scale
