"""Observers: identity modules that watch a tensor and turn what they saw into qparams.

Statistics live in registered buffers, so they persist through ``state_dict`` and move
with ``.to(device)``. Non-finite values are skipped (and counted) rather than allowed to
poison a running range. The base classes live in :mod:`~lucid_fx.quantization.observer_base`
and :class:`FixedQParamsObserver` in :mod:`~lucid_fx.quantization.fixed_qparams`; all are
importable from here.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from lucid_fx.quantization.dtypes import QDtype, QScheme, to_qscheme
from lucid_fx.quantization.fixed_qparams import FixedQParamsObserver
from lucid_fx.quantization.observer_base import ObserverBase, _Factory, _StatisticsObserver  # noqa: F401 (re-exported)
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
