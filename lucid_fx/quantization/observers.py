"""Observers: identity modules that watch a tensor and turn what they saw into qparams.

Statistics live in registered buffers, so they persist through ``state_dict`` and move
with ``.to(device)``. Non-finite values are skipped (and counted) rather than allowed to
poison a running range.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import nn

from lucid_fx.quantization.dtypes import QDtype, QParams, QScheme, to_qdtype, to_qscheme
from lucid_fx.quantization.qparams import calculate_qparams

__all__ = [
    "ObserverBase",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "FixedQParamsObserver",
    "PlaceholderObserver",
    "NoopObserver",
]


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
                stacklevel=3,
            )
        return finite

    def _uncalibrated_qparams(self, shape: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
        warnings.warn(
            f"{self.observer_name}: saw no data; run calibration before asking for qparams. "
            "Returning scale=1.0, zero_point=0",
            RuntimeWarning,
            stacklevel=3,
        )
        device = self.nonfinite_count.device
        return torch.ones(shape, device=device), torch.zeros(shape, dtype=torch.int64, device=device)


class MinMaxObserver(_StatisticsObserver):
    """Tracks the running min and max of everything it sees (per tensor).

    >>> obs = MinMaxObserver()
    >>> _ = obs(torch.tensor([-2.0, 6.0]))
    >>> [round(v.item(), 4) for v in obs.calculate_qparams()]
    [0.0314, 64]
    """

    def __init__(
        self,
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        eps: float = 1e-8,
    ) -> None:
        if to_qscheme(qscheme).is_per_channel:
            raise ValueError(f"{type(self).__name__} is per-tensor; use PerChannelMinMaxObserver for {to_qscheme(qscheme).value}")
        super().__init__(qscheme, qdtype, None, eps)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    def _batch_range(self, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        x = x.detach()
        if x.numel() == 0:
            return None
        lo, hi = torch.aminmax(x)
        finite = self._count_nonfinite(x, (lo, hi))
        if finite is None:
            return lo.float(), hi.float()
        x = x[finite]
        if x.numel() == 0:
            return None
        return x.min().float(), x.max().float()

    def _update(self, cur_min: torch.Tensor, cur_max: torch.Tensor) -> None:
        self.min_val.copy_(torch.minimum(self.min_val, cur_min))
        self.max_val.copy_(torch.maximum(self.max_val, cur_max))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            return x  # a Python number flowing through the graph: nothing to observe
        found = self._batch_range(x)
        if found is not None:
            self._update(*found)
        return x

    @property
    def has_data(self) -> bool:
        return bool(torch.isfinite(self.min_val).all())

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return self._uncalibrated_qparams(tuple(self.min_val.shape))
        return calculate_qparams(self.min_val, self.max_val, self.qscheme, self.qdtype, self.eps)

    def reset_min_max_vals(self) -> None:
        self.min_val.fill_(float("inf"))
        self.max_val.fill_(float("-inf"))


class MovingAverageMinMaxObserver(MinMaxObserver):
    """Exponential moving average of per-batch min/max: the first batch seeds the range, then
    ``v += averaging_constant * (batch_v - v)``."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        eps: float = 1e-8,
    ) -> None:
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant must lie in (0, 1], got {averaging_constant!r}")
        super().__init__(qscheme, qdtype, eps)
        self.averaging_constant = float(averaging_constant)

    def _update(self, cur_min: torch.Tensor, cur_max: torch.Tensor) -> None:
        if not self.has_data:
            self.min_val.copy_(cur_min)
            self.max_val.copy_(cur_max)
            return
        c = self.averaging_constant
        self.min_val.add_(c * (cur_min - self.min_val))
        self.max_val.add_(c * (cur_max - self.max_val))


class PerChannelMinMaxObserver(_StatisticsObserver):
    """Running min/max per channel along ``ch_axis`` (the default for weights).

    >>> obs = PerChannelMinMaxObserver()
    >>> _ = obs(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    >>> obs.calculate_qparams()[0] * 127.5
    tensor([2.0000, 0.5000])
    """

    def __init__(
        self,
        ch_axis: int = 0,
        qscheme: Union[QScheme, str] = QScheme.PER_CHANNEL_SYMMETRIC,
        qdtype: Union[QDtype, str, torch.dtype] = "qint8",
        eps: float = 1e-8,
    ) -> None:
        super().__init__(qscheme, qdtype, ch_axis, eps)
        if not self.qscheme.is_per_channel:
            raise ValueError(f"{type(self).__name__} is per-channel; use MinMaxObserver for {self.qscheme.value}")
        self.register_buffer("min_val", torch.tensor([]))
        self.register_buffer("max_val", torch.tensor([]))

    def _batch_range(self, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        x = x.detach()
        if x.numel() == 0:
            return None
        if x.dim() == 0:
            x = x.reshape(1)
        axis = self.ch_axis % x.dim()
        flat = x.movedim(axis, 0).reshape(x.shape[axis], -1).float()
        # amin + amax: torch.aminmax along a dim is ~15x slower on CPU (measured, torch 2.13)
        lo, hi = flat.amin(dim=1), flat.amax(dim=1)
        finite = self._count_nonfinite(flat, (lo, hi))
        if finite is None:
            return lo, hi
        # A non-finite value must not win a min or a max: make it neutral for each reduction.
        lo = torch.where(finite, flat, torch.full_like(flat, float("inf"))).amin(dim=1)
        hi = torch.where(finite, flat, torch.full_like(flat, float("-inf"))).amax(dim=1)
        return lo, hi

    def _update(self, cur_min: torch.Tensor, cur_max: torch.Tensor) -> None:
        if self.min_val.numel() == 0:
            self.min_val.resize_(cur_min.shape).copy_(cur_min)
            self.max_val.resize_(cur_max.shape).copy_(cur_max)
            return
        if self.min_val.shape != cur_min.shape:
            raise ValueError(
                f"{self.observer_name}: saw {cur_min.numel()} channels on axis {self.ch_axis}, "
                f"but earlier batches had {self.min_val.numel()}"
            )
        self.min_val.copy_(torch.minimum(self.min_val, cur_min))
        self.max_val.copy_(torch.maximum(self.max_val, cur_max))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            return x  # a Python number flowing through the graph: nothing to observe
        found = self._batch_range(x)
        if found is not None:
            self._update(*found)
        return x

    @property
    def has_data(self) -> bool:
        return self.min_val.numel() > 0

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return self._uncalibrated_qparams((0,))
        # A channel that only ever saw non-finite values has no range: treat it as [0, 0].
        lo = torch.where(torch.isfinite(self.min_val), self.min_val, torch.zeros_like(self.min_val))
        hi = torch.where(torch.isfinite(self.max_val), self.max_val, torch.zeros_like(self.max_val))
        return calculate_qparams(lo, hi, self.qscheme, self.qdtype, self.eps)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # The channel count is only known after the first batch: adopt the saved shape.
        for name in ("min_val", "max_val"):
            key = prefix + name
            if key in state_dict:
                getattr(self, name).resize_(state_dict[key].shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def reset_min_max_vals(self) -> None:
        self.min_val.resize_(0)
        self.max_val.resize_(0)


class MovingAveragePerChannelMinMaxObserver(PerChannelMinMaxObserver):
    """Per-channel exponential moving average of min/max (first batch seeds)."""

    def __init__(
        self,
        averaging_constant: float = 0.01,
        ch_axis: int = 0,
        qscheme: Union[QScheme, str] = QScheme.PER_CHANNEL_SYMMETRIC,
        qdtype: Union[QDtype, str, torch.dtype] = "qint8",
        eps: float = 1e-8,
    ) -> None:
        if not 0.0 < averaging_constant <= 1.0:
            raise ValueError(f"averaging_constant must lie in (0, 1], got {averaging_constant!r}")
        super().__init__(ch_axis, qscheme, qdtype, eps)
        self.averaging_constant = float(averaging_constant)

    def _update(self, cur_min: torch.Tensor, cur_max: torch.Tensor) -> None:
        if self.min_val.numel() == 0:
            super()._update(cur_min, cur_max)
            return
        if self.min_val.shape != cur_min.shape:
            super()._update(cur_min, cur_max)  # raises the channel-count error
        c = self.averaging_constant
        self.min_val.add_(c * (cur_min - self.min_val))
        self.max_val.add_(c * (cur_max - self.max_val))


class FixedQParamsObserver(ObserverBase):
    """Observer with a fixed (scale, zero_point): no statistics collected.

    For ops whose output range is known a priori (sigmoid, softmax -> [0, 1]; tanh -> [-1, 1])
    the qparams are a closed-form function of the grid; ``forward`` is a pure identity and
    :meth:`calculate_qparams` returns the stored pair verbatim, valid right after construction.
    ``qscheme`` and ``eps`` are metadata only.

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
        try:
            scale_f = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"FixedQParamsObserver: scale must be a number, got {scale!r}") from None
        if not (math.isfinite(scale_f) and scale_f > 0):
            raise ValueError(f"FixedQParamsObserver: scale must be positive and finite, got {scale!r}")
        if isinstance(zero_point, torch.Tensor):
            zero_point = zero_point.item()
        if isinstance(zero_point, bool) or not float(zero_point).is_integer():
            raise ValueError(f"FixedQParamsObserver: zero_point must be an integer, got {zero_point!r}")
        zp = int(zero_point)
        if not self.qdtype.quant_min <= zp <= self.qdtype.quant_max:
            raise ValueError(
                f"FixedQParamsObserver: zero_point {zp} lies outside the {self.qdtype.name} grid "
                f"[{self.qdtype.quant_min}, {self.qdtype.quant_max}]"
            )
        self.register_buffer("scale", torch.tensor(scale_f, dtype=torch.float32))
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

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}, zero_point={int(self.zero_point)}, " + super().extra_repr()


class PlaceholderObserver(ObserverBase):
    """Carries a dtype to where it is needed; collects no statistics and has no qparams."""

    def __init__(
        self,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        eps: float = 1e-8,
    ) -> None:
        super().__init__(qscheme, qdtype, 0 if to_qscheme(qscheme).is_per_channel else None, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            f"{type(self).__name__} collects no statistics, so it has no qparams; "
            "use a statistics observer (MinMaxObserver, HistogramObserver, ...) or FixedQParamsObserver"
        )


class NoopObserver(PlaceholderObserver):
    """A placeholder that marks a tensor to be left as it is."""
