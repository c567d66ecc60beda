"""lucid_fx: post-training int8 quantization for PyTorch as torch.fx graph passes.

Two layers: :mod:`lucid_fx.quantization` holds the observers, grids and configs; this module
holds the verbs (``prepare``, ``prepare_qat``, ``calibrate``, ``convert``, ``quantize``, ``explain``) and the registry
that users extend (``register_bounded_op``, ``register_fusion``, ...). The passes themselves
live in :mod:`lucid_fx.passes`.
"""

from lucid_fx import quantization
from lucid_fx.calibrate import calibrate
from lucid_fx.compare import Comparison, NodeError, compare
from lucid_fx.convert import ConvertReport, convert
from lucid_fx.one_call import quantize
from lucid_fx.distributed import register_observer_merge, sync_observers
from lucid_fx.explain import Explanation, explain
from lucid_fx.graph_model import to_networkx
from lucid_fx.visualize import visualize
from lucid_fx.prepare import PrepareReport, prepare, prepare_qat
from lucid_fx.save_load import load, save
from lucid_fx.measured_precision import PrecisionReport
from lucid_fx.sqnr_target import TargetReport
from lucid_fx.transforms import TransformReport, correct_bias, equalize, smooth_quant
from lucid_fx.registry import (
    Registry,
    current_registry,
    register_bounded_op,
    register_float_op,
    register_fusion,
    register_lowering,
    register_observer_rule,
    register_op,
    registry_scope,
)

__version__ = "0.1.0"

__all__ = [
    "quantization",
    "prepare",
    "prepare_qat",
    "calibrate",
    "convert",
    "quantize",
    "ConvertReport",
    "explain",
    "Explanation",
    "to_networkx",
    "visualize",
    "compare",
    "Comparison",
    "NodeError",
    "PrepareReport",
    "Registry",
    "current_registry",
    "registry_scope",
    "register_op",
    "register_bounded_op",
    "register_fusion",
    "register_observer_rule",
    "register_float_op",
    "register_lowering",
    "save",
    "load",
    "sync_observers",
    "register_observer_merge",
    "equalize",
    "correct_bias",
    "smooth_quant",
    "TransformReport",
    "TargetReport",
    "PrecisionReport",
    "__version__",
]
