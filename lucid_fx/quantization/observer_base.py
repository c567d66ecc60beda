"""The observer base classes: what every observer is (a scheme, a grid, qparams), and what the
statistics observers share (non-finite values skipped and counted; "saw no data" qparams).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import nn

from lucid_fx._where import user_stacklevel
from lucid_fx.quantization.dtypes import QDtype, QParams, QScheme, to_qdtype, to_qscheme

__all__ = ["ObserverBase"]


class _Factory(functools.partial):
    """A zero-argument observer factory made by ``with_args``, with a readable repr."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.keywords.items())
        return f"{self.func.__name__}.with_args({args})"


class ObserverBase(nn.Module):
    """Base of every observer: a scheme, a grid, an optional channel axis and an eps floor.

    Args:
        qscheme: a :class:`QScheme` or its name.
        qdtype: a :class:`QDtype`, its name, or the matching torch dtype.
        ch_axis: channel axis for per-channel schemes.
        eps: smallest scale ever returned.
    """

    def __init__(
        self,
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        ch_axis: Optional[int] = None,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.qscheme = to_qscheme(qscheme)
        self.qdtype = to_qdtype(qdtype)
        if self.qscheme.is_per_channel and ch_axis is None:
            raise ValueError(f"{type(self).__name__}: {self.qscheme.value} needs a ch_axis")
        self.ch_axis = ch_axis
        if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
            raise ValueError(f"{type(self).__name__}: eps must be a positive finite number, got {eps!r}")
        self.eps = float(eps)
        # Set by prepare to the graph node this observer watches; used in messages.
        self.observer_name = type(self).__name__

    @classmethod
    def with_args(cls, **kwargs: Any) -> Callable[[], "ObserverBase"]:
        """A zero-argument factory that builds this observer with ``kwargs``.

        >>> from lucid_fx.quantization import MinMaxObserver
        >>> make = MinMaxObserver.with_args(qdtype="qint8")
        >>> make().qdtype
        lucid_fx.quantization.qint8
        """
        return _Factory(cls, **kwargs)

    @property
    def quant_min(self) -> int:
        return self.qdtype.quant_min

    @property
    def quant_max(self) -> int:
        return self.qdtype.quant_max

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} does not compute qparams")

    def qparams(self) -> QParams:
        """The computed qparams as one :class:`QParams` bundle."""
        scale, zero_point = self.calculate_qparams()
        return QParams(scale, zero_point, self.qscheme, self.qdtype, self.ch_axis if self.qscheme.is_per_channel else None)

    def extra_repr(self) -> str:
        axis = f", ch_axis={self.ch_axis}" if self.ch_axis is not None else ""
        return f"qscheme={self.qscheme.value}, qdtype={self.qdtype.name}{axis}"


class _StatisticsObserver(ObserverBase):
    """Shared machinery of observers that collect statistics: non-finite skipping and the
    "saw no data" default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("nonfinite_count", torch.tensor(0, dtype=torch.int64))
        self._warned_nonfinite = False

    def _count_nonfinite(self, x: torch.Tensor, extremes: Tuple[torch.Tensor, ...] = ()) -> Optional[torch.Tensor]:
        """Mask of finite values, or ``None`` when all are finite; counts and warns once.

        ``extremes`` are the batch's min/max: they propagate NaN and keep inf, so when they are
        finite the data is, and the full scan (costly on large weights) is skipped."""
        if extremes and all(bool(torch.isfinite(e).all()) for e in extremes):
            return None
        finite = torch.isfinite(x)
        if bool(finite.all()):
            return None
        bad = int((~finite).sum())
        self.nonfinite_count += bad
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            warnings.warn(
                f"{self.observer_name}: skipped {bad} non-finite value(s) (NaN/inf) in observed data; "
                "they are excluded from the statistics (the running total is in .nonfinite_count)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return finite

    def _uncalibrated_qparams(self, shape: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
        warnings.warn(
            f"{self.observer_name}: saw no data; run calibration before asking for qparams. "
            "Returning scale=1.0, zero_point=0",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        device = self.nonfinite_count.device
        return torch.ones(shape, device=device), torch.zeros(shape, dtype=torch.int64, device=device)
