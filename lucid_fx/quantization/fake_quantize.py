"""FakeQuantize modules for quantization-aware training."""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
from torch import nn

from lucid_fx.quantization.fixed_qparams import FixedQParamsObserver, check_fixed_state
from lucid_fx.quantization.functional import fake_quantize
from lucid_fx.quantization.observers import MovingAverageMinMaxObserver, ObserverBase, _Factory

__all__ = ["FakeQuantize", "FixedQParamsFakeQuantize"]


class FakeQuantize(nn.Module):
    """Observe, then quantize-dequantize in float with a straight-through gradient.

    Args:
        observer: observer class (or factory) that tracks the range.
        **observer_kwargs: passed to ``observer``.

    >>> fq = FakeQuantize()
    >>> y = fq(torch.tensor([0.0, 1.0]))
    >>> fq.calculate_qparams()[1].item()
    0
    """

    def __init__(self, observer: Callable[..., ObserverBase] = MovingAverageMinMaxObserver, **observer_kwargs: Any) -> None:
        super().__init__()
        self.activation_post_process = observer(**observer_kwargs)
        if not isinstance(self.activation_post_process, ObserverBase):
            raise ValueError(f"FakeQuantize: observer must build an ObserverBase, got {type(self.activation_post_process).__name__}")
        obs = self.activation_post_process
        self.qscheme, self.qdtype, self.ch_axis = obs.qscheme, obs.qdtype, obs.ch_axis
        self.quant_min, self.quant_max = obs.quant_min, obs.quant_max
        self.register_buffer("fake_quant_enabled", torch.tensor(1, dtype=torch.uint8))
        self.register_buffer("observer_enabled", torch.tensor(1, dtype=torch.uint8))
        self.register_buffer("scale", torch.tensor([1.0]))
        self.register_buffer("zero_point", torch.tensor([0], dtype=torch.int64))

    @classmethod
    def with_args(cls, **kwargs: Any) -> Callable[[], "FakeQuantize"]:
        """A zero-argument factory that builds this module with ``kwargs``."""
        return _Factory(cls, **kwargs)

    def enable_fake_quant(self, enabled: bool = True) -> "FakeQuantize":
        self.fake_quant_enabled.fill_(1 if enabled else 0)
        return self

    def disable_fake_quant(self) -> "FakeQuantize":
        return self.enable_fake_quant(False)

    def enable_observer(self, enabled: bool = True) -> "FakeQuantize":
        self.observer_enabled.fill_(1 if enabled else 0)
        return self

    def disable_observer(self) -> "FakeQuantize":
        return self.enable_observer(False)

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.activation_post_process.calculate_qparams()

    @property
    def has_data(self) -> bool:
        """Whether the observer has seen data (convert refuses qparams made from nothing)."""
        return bool(getattr(self.activation_post_process, "has_data", True))

    def _store_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        if self.scale.shape != scale.shape:
            self.scale.resize_(scale.shape)
            self.zero_point.resize_(zero_point.shape)
        self.scale.copy_(scale)
        self.zero_point.copy_(zero_point)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(self.observer_enabled):
            self.activation_post_process(x.detach())
            self._store_qparams(*self.calculate_qparams())
        if bool(self.fake_quant_enabled):
            ch_axis = self.ch_axis if self.qscheme.is_per_channel else None
            x = fake_quantize(x, self.scale, self.zero_point, self.quant_min, self.quant_max, ch_axis)
        return x

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name in ("scale", "zero_point"):
            key = prefix + name
            if key in state_dict:
                getattr(self, name).resize_(state_dict[key].shape)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (
            f"fake_quant_enabled={bool(self.fake_quant_enabled)}, observer_enabled={bool(self.observer_enabled)}, "
            f"qdtype={self.qdtype.name}, qscheme={self.qscheme.value}"
        )


class FixedQParamsFakeQuantize(FakeQuantize):
    """FakeQuantize with constant qparams from a :class:`FixedQParamsObserver` (range-bounded ops).

    >>> fq = FixedQParamsFakeQuantize(FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))
    >>> fq(torch.tensor([0.5, 2.0]))
    tensor([0.5000, 0.9961])
    """

    def __init__(self, observer: Callable[..., FixedQParamsObserver]) -> None:
        super().__init__(observer=observer)
        if not isinstance(self.activation_post_process, FixedQParamsObserver):
            raise ValueError(
                "FixedQParamsFakeQuantize needs a FixedQParamsObserver factory, got "
                f"{type(self.activation_post_process).__name__}"
            )
        self._store_qparams(*self.activation_post_process.calculate_qparams())
        self.disable_observer()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Its own scale and zero point are what fake_quantize uses: as checked as the observer's.
        check_fixed_state(state_dict, prefix, self.qdtype, type(self).__name__)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
