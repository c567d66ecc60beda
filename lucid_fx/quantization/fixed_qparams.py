"""FixedQParamsObserver: constant qparams for ops whose output range is known, and their validation.

A fixed scale and zero point are checked wherever they enter, at construction and in
``load_state_dict``, because they go straight to the kernels: a scale is stored in float32, so a
value finite in float64 can be ``inf`` (1e39) or ``0`` (1e-46) there, and a zero point outside the
grid shifts every code. Each failure is a ``ValueError`` that states the valid range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Tuple, Union

import torch

from lucid_fx.quantization.dtypes import QDtype, QScheme, to_qscheme
from lucid_fx.quantization.observer_base import ObserverBase

__all__ = ["FixedQParamsObserver", "check_scale", "check_zero_point", "check_fixed_state"]

_F32 = torch.finfo(torch.float32)
_VALID_SCALE = f"a positive number that is finite and normal in float32 (from {_F32.tiny:.8g} to {_F32.max:.8g})"


def _one_value(value: Any) -> Any:
    """A number from a number or a one-element real tensor; anything else is returned as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_scale(value: Any, who: str = "FixedQParamsObserver") -> float:
    """``value`` as the float32 scale it will be stored as; ``ValueError`` stating the valid range if
    it is not a positive number that float32 holds as a finite, normal value.

    >>> check_scale(1e39)
    Traceback (most recent call last):
    ...
    ValueError: FixedQParamsObserver: scale must be a positive number that is finite and normal in float32 (from 1.1754944e-38 to 3.4028235e+38), got 1e+39 (inf in float32)
    """
    number = _one_value(value)
    if not _is_number(number):
        raise ValueError(f"{who}: scale must be {_VALID_SCALE}, got {_shown(value)}")
    try:
        as_f64 = float(number)
    except OverflowError:  # a Python int beyond float64
        as_f64 = math.inf
    as_f32 = float(torch.tensor(as_f64, dtype=torch.float32, device="cpu"))  # on the CPU even under a device context
    if not (math.isfinite(as_f32) and as_f32 >= _F32.tiny):  # NaN fails the comparisons too
        note = f" ({as_f32:g} in float32)" if math.isfinite(as_f64) and as_f64 > 0 and as_f32 != as_f64 else ""
        raise ValueError(f"{who}: scale must be {_VALID_SCALE}, got {_shown(value)}{note}")
    return as_f32


def check_zero_point(value: Any, qdtype: QDtype, who: str = "FixedQParamsObserver") -> int:
    """``value`` as an ``int``; ``ValueError`` stating the valid range unless it is an integer on ``qdtype``'s grid.

    >>> from lucid_fx.quantization import quint8
    >>> check_zero_point(0.5, quint8)
    Traceback (most recent call last):
    ...
    ValueError: FixedQParamsObserver: zero_point must be an integer in [0, 255] (the quint8 grid), got 0.5
    """
    number = _one_value(value)
    valid = f"an integer in [{qdtype.quant_min}, {qdtype.quant_max}] (the {qdtype.name} grid)"
    integral = isinstance(number, numbers.Integral) or (_is_number(number) and float(number).is_integer())
    if isinstance(number, bool) or not integral:  # NaN and ±inf are not integers either
        raise ValueError(f"{who}: zero_point must be {valid}, got {_shown(value)}")
    if not qdtype.quant_min <= int(number) <= qdtype.quant_max:
        raise ValueError(f"{who}: zero_point must be {valid}, got {int(number)}")
    return int(number)


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def check_fixed_state(state_dict: dict, prefix: str, qdtype: QDtype, who: str) -> None:
    """Validate the ``scale`` and ``zero_point`` a ``load_state_dict`` would copy into a fixed-qparams module."""
    where = f"load_state_dict into {who}" + (f" {prefix[:-1]!r}" if prefix else "")
    if prefix + "scale" in state_dict:
        check_scale(state_dict[prefix + "scale"], where)
    if prefix + "zero_point" in state_dict:
        check_zero_point(state_dict[prefix + "zero_point"], qdtype, where)


class FixedQParamsObserver(ObserverBase):
    """Observer with a fixed (scale, zero_point): no statistics collected.

    For ops whose output range is known a priori (sigmoid, softmax -> [0, 1]; tanh -> [-1, 1])
    the qparams are a closed-form function of the grid; ``forward`` is a pure identity and
    :meth:`calculate_qparams` returns the stored pair verbatim, valid right after construction.
    ``qscheme`` and ``eps`` are metadata only. ``scale`` must be a positive number that is finite
    and normal in float32; ``zero_point`` an integer on the ``qdtype`` grid (else ``ValueError``,
    here and in ``load_state_dict``).

    >>> obs = FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    >>> scale, zero_point = obs.calculate_qparams()
    >>> round(scale.item(), 6), int(zero_point.item())
    (0.003906, 0)
    """

    def __init__(
        self,
        scale: float,
        zero_point: int,
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        eps: float = 1e-8,
    ) -> None:
        super().__init__(qscheme, qdtype, None if not to_qscheme(qscheme).is_per_channel else 0, eps)
        scale_f32 = check_scale(scale)
        zp = check_zero_point(zero_point, self.qdtype)
        self.register_buffer("scale", torch.tensor(scale_f32, dtype=torch.float32))
        self.register_buffer("zero_point", torch.tensor(zp, dtype=torch.int64))

    @classmethod
    def for_interval(cls, lo: float, hi: float, qdtype: Union[QDtype, str, torch.dtype] = "quint8") -> "FixedQParamsObserver":
        """The observer for an op whose output provably lies in ``[lo, hi]``.

        >>> FixedQParamsObserver.for_interval(-1.0, 1.0, "quint8").zero_point
        tensor(128)
        """
        from lucid_fx.quantization.qparams import fixed_qparams_for_interval

        scale, zero_point = fixed_qparams_for_interval(lo, hi, qdtype)
        return cls(scale, zero_point, qdtype=qdtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        check_fixed_state(state_dict, prefix, self.qdtype, type(self).__name__)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, zero_point={int(self.zero_point)}, " + super().extra_repr()


# Saved models name their classes by qualified name, and files name this one as defined before it
# had a module of its own: keep that name, where it is still importable.
FixedQParamsObserver.__module__ = "lucid_fx.quantization.observers"
