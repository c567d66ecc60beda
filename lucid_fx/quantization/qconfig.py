"""QConfig (what observes activations and weights), QConfigMapping (which QConfig where), defaults."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from lucid_fx.quantization.dtypes import QDtype, per_channel_symmetric, per_tensor_affine, qint8, quint8, to_qdtype
from lucid_fx.quantization.fake_quantize import FakeQuantize, FixedQParamsFakeQuantize
from lucid_fx.quantization.histogram import HistogramObserver
from lucid_fx.quantization.observers import (
    FixedQParamsObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from lucid_fx.quantization.qparams import fixed_qparams_for_interval

__all__ = [
    "QConfig",
    "QConfigMapping",
    "default_qconfig",
    "default_qat_qconfig",
    "default_dynamic_qconfig",
    "minmax_qconfig",
    "get_default_qconfig_mapping",
    "get_default_qat_qconfig_mapping",
    "fixed_qparams_observer",
    "fixed_qparams_fake_quant",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_fixed_qparams_range_0to1_fake_quant",
    "default_fixed_qparams_range_neg1to1_fake_quant",
]

Factory = Callable[[], Any]


@dataclass(frozen=True)
class QConfig:
    """How to observe one module's output activation and its weight.

    Args:
        activation: zero-argument factory of the activation observer (or FakeQuantize).
        weight: zero-argument factory of the weight observer (or FakeQuantize).
        range_analysis: when True (default), outputs whose range is proven bounded get a
            FixedQParamsObserver instead of ``activation``.
    """

    activation: Factory
    weight: Factory
    range_analysis: bool = True

    def __post_init__(self) -> None:
        for field in ("activation", "weight"):
            value = getattr(self, field)
            if not callable(value):
                raise ValueError(f"QConfig.{field} must be a zero-argument factory (e.g. MinMaxObserver.with_args()), got {value!r}")
            if isinstance(value, ObserverBase):
                raise ValueError(
                    f"QConfig.{field} got an observer instance; pass a factory such as "
                    f"{type(value).__name__}.with_args(...) so each node gets its own observer"
                )

    @property
    def activation_qdtype(self) -> QDtype:
        return _probe_qdtype(self.activation)

    @property
    def weight_qdtype(self) -> QDtype:
        return _probe_qdtype(self.weight)


def _probe_qdtype(factory: Factory) -> QDtype:
    keywords = getattr(factory, "keywords", {}) or {}
    if "qdtype" in keywords:
        return to_qdtype(keywords["qdtype"])
    return factory().qdtype


_UNSET = object()
_GLOBAL = object()  # _lookup's default: the global QConfig


class QConfigMapping:
    """Which QConfig applies where. Lookup order: graph node name (``set_node_name``), exact
    module name, then its parents (longest first), then module-name regexes (first registered
    wins), then object type, then global.
    ``None`` as a QConfig means "leave this float".

    >>> m = QConfigMapping().set_global(default_qconfig).set_module_name("head", None)
    >>> m.qconfig_for("head.fc", object_type=None) is None
    True
    >>> m.qconfig_for("body.fc", object_type=None) is default_qconfig
    True
    """

    def __init__(self) -> None:
        self.global_qconfig: Optional[QConfig] = None
        self.object_type_qconfigs: Dict[Any, Optional[QConfig]] = {}
        self.module_name_qconfigs: Dict[str, Optional[QConfig]] = {}
        self.module_name_regex_qconfigs: List[Tuple[re.Pattern, Optional[QConfig]]] = []
        self.node_name_qconfigs: Dict[str, Optional[QConfig]] = {}

    @staticmethod
    def _check(qconfig: Optional[QConfig]) -> Optional[QConfig]:
        if qconfig is not None and not isinstance(qconfig, QConfig):
            raise ValueError(f"expected a QConfig or None, got {type(qconfig).__name__}")
        return qconfig

    def set_global(self, qconfig: Optional[QConfig]) -> "QConfigMapping":
        self.global_qconfig = self._check(qconfig)
        return self

    def set_object_type(self, object_type: Any, qconfig: Optional[QConfig]) -> "QConfigMapping":
        """Set the QConfig for a module class, a function (``torch.sigmoid``) or a canonical op name."""
        self.object_type_qconfigs[object_type] = self._check(qconfig)
        return self

    def set_module_name(self, module_name: str, qconfig: Optional[QConfig]) -> "QConfigMapping":
        """Set the QConfig for a submodule by qualified name; it also covers that module's children."""
        self.module_name_qconfigs[module_name] = self._check(qconfig)
        return self

    def set_node_name(self, node_name: str, qconfig: Optional[QConfig]) -> "QConfigMapping":
        """Set the QConfig for one node of the traced graph, by the name ``compare`` and
        ``explain`` report (``"submodule.node"`` inside a submodule traced on its own); it wins
        over every other setting. ``quantize(..., target_sqnr_db=...)`` keeps nodes float so."""
        self.node_name_qconfigs[node_name] = self._check(qconfig)
        return self

    def set_module_name_regex(self, pattern: str, qconfig: Optional[QConfig]) -> "QConfigMapping":
        """Set the QConfig for every module whose qualified name fully matches ``pattern``."""
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"set_module_name_regex: invalid pattern {pattern!r}: {exc}") from None
        self.module_name_regex_qconfigs.append((compiled, self._check(qconfig)))
        return self

    def set_module_name_prefix(self, prefix: str, qconfig: Optional[QConfig]) -> "QConfigMapping":
        """Set the QConfig for every module whose qualified name starts with ``prefix``."""
        return self.set_module_name_regex(re.escape(prefix) + ".*", qconfig)

    def qconfig_for(self, module_name: str = "", object_type: Any = None, *, also_types: Tuple[Any, ...] = ()) -> Optional[QConfig]:
        """The QConfig for a node that belongs to ``module_name`` and is of ``object_type``.

        ``also_types`` are other spellings of the same op (the canonical name, say) tried after
        ``object_type``.
        """
        found = self._lookup(module_name, (object_type, *also_types))
        return None if found is _UNSET else found

    def chose_explicitly(self, module_name: str, types: Tuple[Any, ...]) -> bool:
        """Whether a module-name, module-pattern or object-type entry (not the global QConfig)
        decides for a node of ``module_name`` and ``types``."""
        return self._lookup(module_name, types, default=_UNSET) is not _UNSET

    def _lookup(self, module_name: str, types: Tuple[Any, ...], default: Any = _GLOBAL) -> Any:
        """The entry that decides for a node of ``module_name`` and ``types``; ``default`` (the
        global QConfig unless given) when none does."""
        if module_name:
            parts = module_name.split(".")
            for i in range(len(parts), 0, -1):
                name = ".".join(parts[:i])
                if name in self.module_name_qconfigs:
                    return self.module_name_qconfigs[name]
            for pattern, qconfig in self.module_name_regex_qconfigs:
                if pattern.fullmatch(module_name):
                    return qconfig
        for t in types:
            if t is not None and _hashable(t) and t in self.object_type_qconfigs:
                return self.object_type_qconfigs[t]
        return self.global_qconfig if default is _GLOBAL else default

    def __repr__(self) -> str:
        return (
            f"QConfigMapping(global={self.global_qconfig!r}, object_type={len(self.object_type_qconfigs)}, "
            f"module_name={len(self.module_name_qconfigs)}, regex={len(self.module_name_regex_qconfigs)})"
        )


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# The defaults: histogram-calibrated per-tensor affine uint8 activations, per-channel symmetric
# int8 weights (what int8 GEMM kernels want).
default_qconfig = QConfig(
    activation=HistogramObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
    weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
)
minmax_qconfig = QConfig(
    activation=MinMaxObserver.with_args(qscheme=per_tensor_affine, qdtype=quint8),
    weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
)
default_qat_qconfig = QConfig(
    activation=FakeQuantize.with_args(observer=MovingAverageMinMaxObserver, qscheme=per_tensor_affine, qdtype=quint8),
    weight=FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8
    ),
)
# Dynamic quantization: activation qparams are computed per batch at run time.
default_dynamic_qconfig = QConfig(
    activation=PlaceholderObserver.with_args(qdtype=quint8),
    weight=PerChannelMinMaxObserver.with_args(ch_axis=0, qscheme=per_channel_symmetric, qdtype=qint8),
)


def fixed_qparams_observer(lo: float, hi: float, qdtype: Union[QDtype, str] = quint8) -> Factory:
    """Factory of the FixedQParamsObserver for outputs in ``[lo, hi]`` on ``qdtype``'s grid."""
    scale, zero_point = fixed_qparams_for_interval(lo, hi, qdtype)
    return FixedQParamsObserver.with_args(scale=scale, zero_point=zero_point, qdtype=to_qdtype(qdtype))


def fixed_qparams_fake_quant(lo: float, hi: float, qdtype: Union[QDtype, str] = quint8) -> Factory:
    """Factory of the FixedQParamsFakeQuantize for outputs in ``[lo, hi]`` (QAT)."""
    return FixedQParamsFakeQuantize.with_args(observer=fixed_qparams_observer(lo, hi, qdtype))


default_fixed_qparams_range_0to1_observer = fixed_qparams_observer(0.0, 1.0)
default_fixed_qparams_range_neg1to1_observer = fixed_qparams_observer(-1.0, 1.0)
default_fixed_qparams_range_0to1_fake_quant = fixed_qparams_fake_quant(0.0, 1.0)
default_fixed_qparams_range_neg1to1_fake_quant = fixed_qparams_fake_quant(-1.0, 1.0)


def get_default_qconfig_mapping(backend: Optional[str] = None) -> QConfigMapping:
    """The default post-training mapping: :data:`default_qconfig` everywhere.

    ``backend`` is accepted for symmetry with the reference framework; both lucid_fx backends
    (cpu, cuda) use the same grids.
    """
    if backend not in (None, "cpu", "cuda", "x86", "onednn", "fbgemm"):
        raise ValueError(f"unknown backend {backend!r}; valid: cpu, cuda")
    return QConfigMapping().set_global(default_qconfig)


def get_default_qat_qconfig_mapping(backend: Optional[str] = None) -> QConfigMapping:
    """The default quantization-aware-training mapping: :data:`default_qat_qconfig` everywhere."""
    if backend not in (None, "cpu", "cuda", "x86", "onednn", "fbgemm"):
        raise ValueError(f"unknown backend {backend!r}; valid: cpu, cuda")
    return QConfigMapping().set_global(default_qat_qconfig)
