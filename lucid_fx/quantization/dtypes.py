"""Quantization schemes, integer grids and the qparams bundle.

Everything downstream speaks in :class:`QScheme` and :class:`QDtype`. User input
(strings, or torch's own ``torch.qint8``-style dtype objects) is converted once,
here, by :func:`to_qscheme` and :func:`to_qdtype`; nothing else in lucid_fx looks
at torch's quantized tensor dtypes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Union

import torch

__all__ = [
    "QScheme",
    "QDtype",
    "QParams",
    "per_tensor_affine",
    "per_tensor_symmetric",
    "per_channel_affine",
    "per_channel_symmetric",
    "qint8",
    "quint8",
    "qint32",
    "qint4",
    "to_qscheme",
    "to_qdtype",
]


class QScheme(enum.Enum):
    """How a tensor's real range maps onto its integer grid."""

    PER_TENSOR_AFFINE = "per_tensor_affine"
    PER_TENSOR_SYMMETRIC = "per_tensor_symmetric"
    PER_CHANNEL_AFFINE = "per_channel_affine"
    PER_CHANNEL_SYMMETRIC = "per_channel_symmetric"

    @property
    def is_per_channel(self) -> bool:
        return self in (QScheme.PER_CHANNEL_AFFINE, QScheme.PER_CHANNEL_SYMMETRIC)

    @property
    def is_symmetric(self) -> bool:
        return self in (QScheme.PER_TENSOR_SYMMETRIC, QScheme.PER_CHANNEL_SYMMETRIC)

    def __repr__(self) -> str:
        return f"lucid_fx.quantization.{self.value}"


per_tensor_affine = QScheme.PER_TENSOR_AFFINE
per_tensor_symmetric = QScheme.PER_TENSOR_SYMMETRIC
per_channel_affine = QScheme.PER_CHANNEL_AFFINE
per_channel_symmetric = QScheme.PER_CHANNEL_SYMMETRIC


@dataclass(frozen=True)
class QDtype:
    """An integer grid: ``bits`` wide, codes in ``[quant_min, quant_max]``, stored as ``storage``."""

    name: str
    bits: int
    signed: bool
    quant_min: int
    quant_max: int
    storage: torch.dtype

    def __post_init__(self) -> None:
        if self.quant_min >= self.quant_max:
            raise ValueError(
                f"QDtype {self.name!r}: quant_min ({self.quant_min}) must be below quant_max ({self.quant_max})"
            )
        info = torch.iinfo(self.storage)
        if self.quant_min < info.min or self.quant_max > info.max:
            raise ValueError(
                f"QDtype {self.name!r}: grid [{self.quant_min}, {self.quant_max}] does not fit in {self.storage}"
            )

    @property
    def levels(self) -> int:
        """Number of codes on the grid (256 for 8-bit dtypes)."""
        return self.quant_max - self.quant_min + 1

    def __repr__(self) -> str:
        return f"lucid_fx.quantization.{self.name}"


qint8 = QDtype("qint8", 8, True, -128, 127, torch.int8)
quint8 = QDtype("quint8", 8, False, 0, 255, torch.uint8)
qint32 = QDtype("qint32", 32, True, -(2**31), 2**31 - 1, torch.int32)
qint4 = QDtype("qint4", 4, True, -8, 7, torch.int8)

_QDTYPES = {d.name: d for d in (qint8, quint8, qint32, qint4)}
# The one place torch's quantized dtype objects are read: a user may hand them to us.
_TORCH_QDTYPES = {torch.qint8: qint8, torch.quint8: quint8, torch.qint32: qint32}
_STORAGE_ALIASES = {torch.int8: qint8, torch.uint8: quint8, torch.int32: qint32}


def to_qdtype(value: Union[QDtype, str, torch.dtype]) -> QDtype:
    """Convert a user-supplied dtype (``QDtype``, name, or torch dtype) to a :class:`QDtype`.

    >>> to_qdtype("quint8")
    lucid_fx.quantization.quint8
    """
    if isinstance(value, QDtype):
        return value
    if isinstance(value, str):
        key = value.rsplit(".", 1)[-1]
        if key in _QDTYPES:
            return _QDTYPES[key]
        raise ValueError(f"unknown qdtype {value!r}; valid: {', '.join(sorted(_QDTYPES))}")
    if isinstance(value, torch.dtype):
        found = _TORCH_QDTYPES.get(value) or _STORAGE_ALIASES.get(value)
        if found is not None:
            return found
    raise ValueError(f"unknown qdtype {value!r}; valid: {', '.join(sorted(_QDTYPES))} (or the matching torch dtypes)")


def to_qscheme(value: Union[QScheme, str, "torch.qscheme"]) -> QScheme:
    """Convert a user-supplied scheme (``QScheme``, its name, or a ``torch.per_*`` object).

    >>> to_qscheme("per_channel_symmetric").is_symmetric
    True
    """
    if isinstance(value, QScheme):
        return value
    if isinstance(value, torch.qscheme):
        value = str(value).rsplit(".", 1)[-1]
    if isinstance(value, str):
        key = value.rsplit(".", 1)[-1].lower()
        for scheme in QScheme:
            if scheme.value == key:
                return scheme
    valid = ", ".join(s.value for s in QScheme)
    raise ValueError(f"unknown qscheme {value!r}; valid: {valid}")


@dataclass(frozen=True)
class QParams:
    """Everything needed to quantize one tensor: scale, zero point, scheme, grid and channel axis."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    qscheme: QScheme
    qdtype: QDtype
    ch_axis: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "qscheme", to_qscheme(self.qscheme))
        object.__setattr__(self, "qdtype", to_qdtype(self.qdtype))
        if self.qscheme.is_per_channel and self.ch_axis is None:
            raise ValueError(f"QParams: {self.qscheme.value} needs a ch_axis")
