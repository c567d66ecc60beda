"""The two pipelines as data: :data:`PREPARE_PASSES` and :data:`CONVERT_PASSES`.

Each is a list of passes with one signature, ``fn(gm, ctx) -> gm``, over one frozen context per
verb (:class:`PrepareContext`, :class:`ConvertContext`), run in order by :func:`run_passes`. The
entries adapt the passes of ``lucid_fx.passes`` (whose docstrings list the ``node.meta`` keys they
read and write) to that signature; adding a pass is adding an entry.

``LUCID_FX_PASSES`` (environment) makes the loop report on each pass, to stderr: ``time`` prints
the milliseconds each took, ``dump`` prints the graph after it, ``time,dump`` both
(:func:`run_passes` takes the same as ``trace_passes=``, which wins over the environment).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import fx

from lucid_fx import _meta
from lucid_fx._flops import graph_flops
from lucid_fx._activation_qparams import record_activation_qparams
from lucid_fx.program import install_programs
from lucid_fx._placement import ConvertReport
from lucid_fx.dynamic_rnn import RECURRENT_SWAPS
from lucid_fx.kernels.target import Target
from lucid_fx.passes.analyze_ranges import analyze_ranges
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.choose_observers import choose_observers
from lucid_fx.passes.decompose_attention import decompose_attention
from lucid_fx.passes.decompose_einsum import decompose_einsum
from lucid_fx.passes.decompose_glu import decompose_glu
from lucid_fx.passes.fold_batchnorm import fold_batchnorm
from lucid_fx.passes.fold_constants import fold_constants
from lucid_fx.passes.fold_dequantize import fold_dequantize
from lucid_fx.passes.functionalize_inplace import functionalize_inplace
from lucid_fx.passes.fuse_patterns import fuse_patterns
from lucid_fx.passes.insert_observers import insert_observers
from lucid_fx.passes.insert_qdq import insert_qdq, values_with_codes
from lucid_fx.passes.lower_recurrent import lower_recurrent
from lucid_fx.passes.lower_to_int8 import lower_to_int8, lowering_table
from lucid_fx.passes.narrow_fixed_grids import narrow_fixed_grids
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.remove_noops import remove_noops
from lucid_fx.passes.rewrite_patterns import rewrite_patterns
from lucid_fx.passes.rewrite_weight_products import rewrite_weight_products
from lucid_fx.passes.trace_model import TraceOptions
from lucid_fx.quantization.qconfig import QConfigMapping
from lucid_fx.registry import Registry

__all__ = ["PrepareContext", "ConvertContext", "PREPARE_PASSES", "CONVERT_PASSES", "run_passes", "ENV_VAR"]

ENV_VAR = "LUCID_FX_PASSES"
Pass = Callable[[fx.GraphModule, Any], fx.GraphModule]


@dataclass(frozen=True)
class PrepareContext:
    """What every prepare pass may read. One per prepare call; a nested graph (the traceable part
    of an untraceable module) gets a copy with its own ``path`` and ``example_inputs``."""

    registry: Registry
    qconfig_mapping: QConfigMapping
    target: Target  # QAT trains weights on the grid the target's int8 kernels compute exactly
    qat: bool
    example_inputs: Optional[tuple]  # this graph's inputs (a nested part: what it received in the root's run)
    trace: TraceOptions  # how this graph is traced (a nested part: concrete_args from its parent's call)
    strict: bool = False  # an untraceable module raises instead of staying float
    path: str = ""  # the graph's module path in the root model
    capture: str = "auto"  # "fx", "export", or "auto" (fx, then torch.export where fx fails): lucid_fx/_capture.py
    example_kwargs: Optional[Dict[str, Any]] = None  # keyword inputs of forward (torch.export takes them)
    dynamic_shapes: Any = None  # torch.export's, for the root's capture: None, "auto" or a dict by parameter name


@dataclass(frozen=True)
class ConvertContext:
    """What every convert pass may read. ``reports`` is where the lowering pass leaves each graph's
    ConvertReport, by ``path``, for the verb to attach to the converted model."""

    registry: Registry
    target: Target
    reference: bool  # the simulated model (quantize -> dequantize around float ops) instead of int8 kernels
    path: str = ""
    reports: Dict[str, ConvertReport] = field(default_factory=dict)


# -- prepare --------------------------------------------------------------------------------------
def _record_trace(gm, ctx: PrepareContext):
    gm.meta[_meta.TRACE] = ctx.trace  # a nested part's concrete_args are its parent call's (lucid_fx/_fallback.py)
    return gm  # compare traces the float model the same way


def _functionalize_inplace(gm, ctx: PrepareContext):
    return functionalize_inplace(gm, ctx.registry)


def _propagate_shapes(gm, ctx: PrepareContext):
    return gm if ctx.example_inputs is None else propagate_shapes(gm, ctx.example_inputs)


def _decompose_attention(gm, ctx: PrepareContext):
    return decompose_attention(gm, ctx.example_inputs)


def _decompose_einsum(gm, ctx: PrepareContext):
    return decompose_einsum(gm, ctx.example_inputs)


def _decompose_glu(gm, ctx: PrepareContext):
    return decompose_glu(gm, ctx.example_inputs)


def _rewrite_weight_products(gm, ctx: PrepareContext):
    return rewrite_weight_products(gm, ctx.example_inputs)


def _canonicalize_ops(gm, ctx: PrepareContext):
    return canonicalize_ops(gm, ctx.registry)


def _remove_noops(gm, ctx: PrepareContext):
    return remove_noops(gm)


def _fold_constants(gm, ctx: PrepareContext):
    flops = graph_flops(gm)  # the matrix FLOPs of what folding takes out, for the convert report
    gm = fold_constants(gm)
    alive = {node.name for node in gm.graph.nodes}
    gm.meta[_meta.FOLDED_FLOPS] = sum(f for name, f in flops.items() if name not in alive)
    return gm


def _rewrite_patterns(gm, ctx: PrepareContext):
    return rewrite_patterns(gm)


def _fuse_patterns(gm, ctx: PrepareContext):
    return fuse_patterns(gm, ctx.registry)


def _analyze_ranges(gm, ctx: PrepareContext):
    return analyze_ranges(gm, ctx.registry)


def _choose_observers(gm, ctx: PrepareContext):
    return choose_observers(gm, ctx.registry, ctx.qconfig_mapping, ctx.path)


def _insert_observers(gm, ctx: PrepareContext):
    return insert_observers(gm, qat=ctx.qat, target=ctx.target)


#: The prepare passes, in order, after tracing (lucid_fx.prepare traces, and descends into
#: untraceable modules, before running these on each graph).
PREPARE_PASSES: List[Pass] = [
    _record_trace, _functionalize_inplace, _propagate_shapes, _decompose_attention, _decompose_einsum, _decompose_glu,
    _rewrite_weight_products, _canonicalize_ops, _remove_noops,
    _fold_constants, _rewrite_patterns,
    _fuse_patterns, _analyze_ranges,
    _choose_observers, _insert_observers,
]


# -- convert --------------------------------------------------------------------------------------
def _narrow_fixed_grids(gm, ctx: ConvertContext):
    return narrow_fixed_grids(gm, ctx.registry)


def _fold_batchnorm(gm, ctx: ConvertContext):
    return fold_batchnorm(gm)


def _lower(gm, ctx: ConvertContext):
    if ctx.reference:
        ctx.reports[ctx.path] = ConvertReport("reference")
        codes = values_with_codes(gm, ctx.registry.lowerings, ctx.target)  # what the int8 model rounds, as it folds
        return insert_qdq(gm, ctx.target, set(lowering_table(ctx.registry.lowerings, ctx.target.backend)), codes)
    converted, ctx.reports[ctx.path] = lower_to_int8(gm, ctx.registry.lowerings, ctx.target)
    return converted


def _fold_dequantize(gm, ctx: ConvertContext):
    # Reference mode rounds what the int8 model rounds (insert_qdq's codes): nothing left to fold.
    return gm if ctx.reference else fold_dequantize(gm, ctx.reports.get(ctx.path))


def _lower_recurrent(gm, ctx: ConvertContext):
    # nn.LSTM, nn.GRU and their cells run as quantize_dynamic's int8 layers, on this convert's Target.
    return lower_recurrent(gm, ctx.reports.get(ctx.path),
                           lambda layer, qconfig: RECURRENT_SWAPS[type(layer)].from_float(layer, qconfig, ctx.target))


def _record_activation_qparams(gm, ctx: ConvertContext):
    return record_activation_qparams(gm)


def _install_programs(gm, ctx: ConvertContext):
    # int8 models run a program per input signature and CPU kind (lucid_fx/program.py); the graph stays portable.
    return gm if ctx.reference else install_programs(gm)


#: The convert passes, in order, on each calibrated graph (QAT parametrizations already removed).
CONVERT_PASSES: List[Pass] = [_narrow_fixed_grids, _fold_batchnorm, _lower, _fold_dequantize, _lower_recurrent, _record_activation_qparams,
                               _install_programs]


# -- the loop -------------------------------------------------------------------------------------
def _modes(trace_passes: Optional[str]) -> Tuple[str, ...]:
    value = os.environ.get(ENV_VAR, "") if trace_passes is None else trace_passes
    modes = tuple(m.strip() for m in value.split(",") if m.strip())
    unknown = [m for m in modes if m not in ("time", "dump")]
    if unknown:
        raise ValueError(f"{ENV_VAR} / trace_passes: unknown value(s) {', '.join(map(repr, unknown))}; valid: time, dump")
    return modes


def pass_name(fn: Pass) -> str:
    return fn.__name__.lstrip("_")


def run_passes(gm: fx.GraphModule, ctx: Any, passes: Sequence[Pass], trace_passes: Optional[str] = None) -> fx.GraphModule:
    """Run ``passes`` on ``gm`` in order; report each to stderr as ``trace_passes`` (or
    ``LUCID_FX_PASSES``) asks: ``time``, ``dump``, or both."""
    modes = _modes(trace_passes)
    where = f" [{ctx.path}]" if getattr(ctx, "path", "") else ""
    for fn in passes:
        start = time.perf_counter()
        gm = fn(gm, ctx)
        if "time" in modes:
            print(f"lucid_fx pass {pass_name(fn)}{where}: {(time.perf_counter() - start) * 1e3:.2f} ms", file=sys.stderr)
        if "dump" in modes:
            print(f"lucid_fx graph after {pass_name(fn)}{where}:\n{gm.graph}", file=sys.stderr)
    return gm
