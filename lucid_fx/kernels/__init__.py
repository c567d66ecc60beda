"""lucid_fx.kernels: int8 kernels as ``torch.ops.lucid_fx.*`` ops, dispatched on their inputs' device.

Importing this package registers the ops. Activations are plain ``uint8`` (or ``int8``) codes
with per-tensor affine qparams; weights are plain ``int8`` codes with per-channel symmetric
scales. CPU kernels use oneDNN (packed weights cached per weight), CUDA kernels
``torch._int_mm``; every other device runs the reference kernels (dequantize, float op,
quantize). Each op's semantics are documented on its reference function in
:mod:`lucid_fx.kernels.reference`; the public helpers are listed in ``__all__``. Inputs an op
cannot take, and NaN/±inf entering the int8 grid, raise :class:`KernelInputError`
(:mod:`lucid_fx.kernels.checks`).

>>> import lucid_fx.kernels
>>> x = torch.ops.lucid_fx.quantize_per_tensor(torch.rand(2, 8), 1 / 255, 0, 0, 255, torch.uint8)
>>> w = torch.randint(-64, 64, (3, 8), dtype=torch.int8)
>>> torch.ops.lucid_fx.linear(x, 1 / 255, 0, w, torch.full((3,), 0.01), None, 0.05, 10, "relu", None).shape
torch.Size([2, 3])
"""

from lucid_fx.kernels import library  # noqa: F401  (defines the ops)
from lucid_fx.kernels import cuda  # noqa: F401  (registers CUDA kernels)
from lucid_fx.kernels import cpu  # noqa: F401  (registers CPU kernels)
from lucid_fx.kernels import cpu_float  # noqa: F401  (registers CPU kernels computed in float32)
from lucid_fx.kernels import grouped  # noqa: F401  (defines grouped_linear: experts on each device's linear)
from lucid_fx.kernels.checks import KernelInputError
from lucid_fx.kernels.cpu import onednn_available, use_onednn, weight_quant_range
from lucid_fx.kernels.cpu_features import cpu_features, force_cpu_features
from lucid_fx.kernels.library import WeightCache
from lucid_fx.kernels.reference import make_lut
from lucid_fx.kernels.target import Target, resolve_target

__all__ = [
    "weight_quant_range", "make_lut", "use_onednn", "onednn_available", "WeightCache", "cpu_features",
    "force_cpu_features", "KernelInputError", "Target", "resolve_target",
]
