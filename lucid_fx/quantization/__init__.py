"""lucid_fx.quantization: schemes, grids, observers, fake quantization and configs.

The numerics layer of lucid_fx, the lowest (docs/architecture.md). Names and numbers follow the reference framework, so code
written against it reads the same here:

>>> import torch
>>> import lucid_fx.quantization as Q
>>> obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
>>> scale, zero_point = obs.calculate_qparams()
>>> round(scale.item(), 6), int(zero_point.item())
(0.003906, 0)
"""

from lucid_fx.quantization.dtypes import (
    QDtype,
    QParams,
    QScheme,
    per_channel_affine,
    per_channel_symmetric,
    per_tensor_affine,
    per_tensor_symmetric,
    qint4,
    qint8,
    qint32,
    quint8,
    to_qdtype,
    to_qscheme,
)
from lucid_fx.quantization.fake_quantize import FakeQuantize, FixedQParamsFakeQuantize
from lucid_fx.quantization.functional import dequantize, fake_quantize, quantize
from lucid_fx.quantization.histogram import HistogramObserver
from lucid_fx.quantization.observers import (
    FixedQParamsObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    NoopObserver,
    ObserverBase,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)
from lucid_fx.quantization.qconfig import (
    QConfig,
    QConfigMapping,
    default_dynamic_qconfig,
    default_fixed_qparams_range_0to1_fake_quant,
    default_fixed_qparams_range_0to1_observer,
    default_fixed_qparams_range_neg1to1_fake_quant,
    default_fixed_qparams_range_neg1to1_observer,
    default_qat_qconfig,
    default_qconfig,
    fixed_qparams_fake_quant,
    fixed_qparams_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig_mapping,
    minmax_qconfig,
)
from lucid_fx.quantization.qparams import calculate_qparams, fixed_qparams_for_interval
from lucid_fx.quantization.fuse import ConvReLU1d, ConvReLU2d, ConvReLU3d, LinearReLU, fuse_modules

__all__ = [
    # schemes and grids
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
    "to_qdtype",
    "to_qscheme",
    # functions
    "calculate_qparams",
    "fixed_qparams_for_interval",
    "quantize",
    "dequantize",
    "fake_quantize",
    # observers
    "ObserverBase",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "HistogramObserver",
    "FixedQParamsObserver",
    "PlaceholderObserver",
    "NoopObserver",
    # fake quantization
    "FakeQuantize",
    "FixedQParamsFakeQuantize",
    # configs
    "QConfig",
    "QConfigMapping",
    "default_qconfig",
    "minmax_qconfig",
    "default_qat_qconfig",
    "default_dynamic_qconfig",
    "get_default_qconfig_mapping",
    "get_default_qat_qconfig_mapping",
    "fixed_qparams_observer",
    "fixed_qparams_fake_quant",
    "default_fixed_qparams_range_0to1_observer",
    "default_fixed_qparams_range_neg1to1_observer",
    "default_fixed_qparams_range_0to1_fake_quant",
    "default_fixed_qparams_range_neg1to1_fake_quant",
    # workflow (the FX passes under the reference framework's names)
    "prepare_fx",
    "prepare_qat_fx",
    "convert_fx",
    # eager-mode workflow: fusion by module names, dynamic quantization
    "fuse_modules",
    "ConvReLU1d",
    "ConvReLU2d",
    "ConvReLU3d",
    "LinearReLU",
    "quantize_dynamic",
    "DynamicQuantizedLinear",
    "DynamicQuantizedLSTM",
    "DynamicQuantizedGRU",
    "DynamicQuantizedRNN",
    "DynamicQuantizedLSTMCell",
    "DynamicQuantizedGRUCell",
    "DynamicQuantizedRNNCell",
]


# The spec's facade (docs/api.md, section 1): the reference framework's workflow names live under
# lucid_fx.quantization, but prepare_fx / prepare_qat_fx / convert_fx are the verbs and
# quantize_dynamic runs the int8 kernels, all above this layer (lucid_fx/workflow.py,
# lucid_fx/dynamic.py). They are imported on first use, so importing the numerics imports nothing
# above them; tests/test_layers.py allows these two upward imports, and no other.
_FACADE = {
    "prepare_fx": "workflow",
    "prepare_qat_fx": "workflow",
    "convert_fx": "workflow",
    "quantize_dynamic": "dynamic",
    "DynamicQuantizedLinear": "dynamic",
    "DynamicQuantizedLSTM": "dynamic",
    "DynamicQuantizedGRU": "dynamic",
    "DynamicQuantizedRNN": "dynamic",
    "DynamicQuantizedLSTMCell": "dynamic",
    "DynamicQuantizedGRUCell": "dynamic",
    "DynamicQuantizedRNNCell": "dynamic",
}


def __getattr__(name: str):
    if _FACADE.get(name) == "workflow":
        from lucid_fx import workflow as home
    elif _FACADE.get(name) == "dynamic":
        from lucid_fx import dynamic as home
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(home, name)
    return value


def __dir__():
    return sorted(set(globals()) | set(_FACADE))
