"""The hardware a model is quantized for, as one frozen object: :class:`Target`.

Which weight grid is exact and which oneDNN call is fastest depend on the backend and the CPU's
int8 features (:mod:`lucid_fx.kernels.cpu_features`). :func:`resolve_target` asks once and writes
every choice that follows into the Target; each verb (prepare, convert, quantize_dynamic, load,
demo) resolves one and carries it, and no other module asks the CPU what it is. A kernel may
still check the real CPU (``detected_cpu_features``) before a call that would be wrong there.

>>> from lucid_fx.kernels import force_cpu_features
>>> with force_cpu_features("avx2"):
...     t = resolve_target("cpu")
>>> t.cpu.name, t.weight_range, t.linear_as_conv
('avx2', (-64, 63), True)
>>> resolve_target("cuda").weight_range
(-128, 127)

A depthwise convolution's kernels add their products in 32 bits on every CPU, so its weights take
the full grid everywhere:

>>> t.layer_weight_range((32, 1, 3, 3), groups=32), t.layer_weight_range((32, 16, 3, 3), groups=1)
((-128, 127), (-64, 63))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from lucid_fx.kernels import cpu_features as cpu_features_module
from lucid_fx.kernels.cpu_features import CpuFeatures, cpu_features, cpu_kind_name, detected_cpu_features

__all__ = ["Target", "resolve_target", "cpu_kind", "kind_inputs", "check_backend", "is_depthwise", "BACKENDS", "FULL_GRID",
           "NARROW_GRID", "AMX_ROW_LIMIT"]

#: The backends lucid_fx lowers for: whose lowering table convert reads and which device runs it.
BACKENDS = ("cpu", "cuda")
FULL_GRID = (-128, 127)
# Without VNNI, oneDNN's u8 x s8 kernels add pairs of products in int16 with saturation: the
# widest weight grid they compute exactly is [-64, 63] (255 * 64 * 2 <= 32767).
NARROW_GRID = (-64, 63)


def is_depthwise(weight_shape: Sequence[int], groups: int) -> bool:
    """Whether a convolution weight of ``weight_shape`` in ``groups`` groups is depthwise: one input
    and one output channel per group (oneDNN's and native_conv.c's depthwise kernels)."""
    return groups > 1 and len(weight_shape) >= 3 and weight_shape[0] == groups and weight_shape[1] == 1


@dataclass(frozen=True)
class Target:
    """Where a model runs and the kernel choices that follow from it.

    ``backend``: the lowering table ("cpu" or "cuda"); ``device``: the device type the weights
    live on; ``cpu``: the CPU kind kernels choose their path by (forced or detected).
    """

    backend: str
    device: str
    cpu: CpuFeatures
    #: (qmin, qmax) of the int8 weights: the grid whose products the device's kernels compute exactly
    #: (of a depthwise convolution's: :meth:`layer_weight_range`).
    weight_range: Tuple[int, int]
    #: A CPU linear runs as oneDNN's 1x1 convolution (measured 1.1-2.2x faster without VNNI; with
    #: VNNI oneDNN's linear runs at 91% of peak and is kept).
    linear_as_conv: bool
    #: The activation zero point goes into the bias where that is exact (oneDNN CPU kernels).
    fold_zero_point: bool
    #: A linear that leaves a zero point to oneDNN with an accumulator past 2^24 takes the exact
    #: _int_mm path (AMX: oneDNN's compensation measured 2 codes off there), on a real AMX CPU whatever kind is forced.
    amx_zero_point_check: bool
    #: torch._int_mm on this CPU sums int16 pairs with saturation: wide weights are split in two.
    split_int_mm: bool
    #: The engine of small CPU linears (:mod:`lucid_fx.kernels.linear_row`; one row, or few and small
    #: ones: ``linear_row.small_gemm``), each with oneDNN's values bit for bit where it runs:
    #: ``"int_mm"`` with VNNI (oneDNN's VNNI float steps after exact sums: lucid_fx's GEMM on VNNI's
    #: steps where the native build has them, 4.8 against 26.7 us for 1x64 by 64, else torch._int_mm's
    #: matrix-vector product: 165 against 233 us for the batch-1 MLP on an AVX512-VNNI EPYC;
    #: small convolutions too: ``conv_native.VNNI_PIXELS``), ``"native"`` without (lucid_fx's GEMM,
    #: :mod:`lucid_fx.kernels.linear_native`: 32 against 79 us for 1x1024 by 1024, oneDNN's int8
    #: calls costing ~50 us there however small); with AMX, ``"int_mm"`` up to :attr:`row_limit` rows.
    linear_row: Optional[str]
    #: The most rows a linear on the row engine may have, whatever it measured faster, or None: 4 with AMX, whose
    #: oneDNN picks its VNNI or its AMX kernels by shape, and the two round the scales differently (the engine then
    #: computes the steps oneDNN takes for that shape, asked of it: :mod:`lucid_fx.kernels.onednn_steps`), so a
    #: row's result is oneDNN's wherever it runs. Its convolutions ask the same way (``rules/program_cpu.py``).
    row_limit: Optional[int] = None

    def layer_weight_range(self, weight_shape: Sequence[int], groups: int = 1) -> Tuple[int, int]:
        """The grid of one layer's weight: :attr:`weight_range`, but the full grid for a depthwise
        convolution, whose kernels add each product in 32 bits on every CPU (oneDNN's and
        native_conv.c's; measured exact on the full grid without VNNI, tests/kernels/test_conv_native.py).
        The MobileNetV2-like family model: 5.6 -> 6.9 dB output SQNR on an AVX2 CPU."""
        return FULL_GRID if is_depthwise(weight_shape, groups) else self.weight_range


#: Target.row_limit on an AMX CPU: a few rows, where lucid_fx's GEMM beats oneDNN's call by the most (one row of
#: 1024 by 1024: 77 against 215 us for the batch-1 MLP's three, 2 threads).
AMX_ROW_LIMIT = 4


def check_backend(backend: str) -> str:
    """``backend`` if lucid_fx lowers for it; a ValueError naming the valid ones otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    return backend


def resolve_target(backend: Optional[str] = None, device: Union[torch.device, str, None] = None) -> Target:
    """The Target for ``backend`` (default: the device's) on ``device`` (default: the backend's),
    with this machine's CPU kind (:func:`~lucid_fx.kernels.cpu_features.cpu_features`: forced by
    ``force_cpu_features`` / ``LUCID_FX_CPU_ISA``, else detected)."""
    device_type = torch.device(device).type if device is not None else None
    backend = check_backend(backend or ("cuda" if device_type == "cuda" else "cpu"))
    return _target(backend, device_type or backend, cpu_features())


def kind_inputs() -> Tuple[list, str, str]:
    """What :data:`cpu_kind` reads, for a caller that reads it in C++ (lucid_fx/program.py's call): the list that is
    non-empty while a kind is forced, the environment variable that sets one, and the detected kind's name."""
    return cpu_features_module._forced, cpu_features_module.ENV_VAR, detected_cpu_features().name


#: The name of the CPU kind :func:`resolve_target` would build for now (``resolve_target().cpu.name``), without
#: building it: what a converted model's program key reads on every call (lucid_fx/program.py).
cpu_kind = cpu_kind_name


@functools.lru_cache(maxsize=None)  # kernels look theirs up per call: one object per combination
def _target(backend: str, device_type: str, cpu: CpuFeatures) -> Target:
    on_cpu = device_type == "cpu"
    return Target(
        backend=backend,
        device=device_type,
        cpu=cpu,
        weight_range=NARROW_GRID if on_cpu and not cpu.vnni else FULL_GRID,
        linear_as_conv=not cpu.vnni,
        fold_zero_point=on_cpu,
        amx_zero_point_check=cpu.amx or detected_cpu_features().amx,  # a forced kind on an AMX CPU runs its oneDNN
        split_int_mm=not cpu.vnni,
        linear_row=None if not on_cpu else "int_mm" if cpu.vnni else "native",
        row_limit=AMX_ROW_LIMIT if cpu.amx or detected_cpu_features().amx else None,  # as amx_zero_point_check
    )
