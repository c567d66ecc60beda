"""quantize: prepare, calibrate and convert in one call; or, with a target SQNR, the fewest float
nodes that reach it (lucid_fx/sqnr_target.py); or, with ``precision="measured"``, float where it
measures faster at equal or better accuracy (lucid_fx/measured_precision.py). Above the three
verbs it runs, so none of them imports it.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional

from torch import nn

from lucid_fx._validate import require_float_model, require_module
from lucid_fx.calibrate import calibrate
from lucid_fx.convert import convert
from lucid_fx.measured_precision import quantize_measured
from lucid_fx.prepare import prepare
from lucid_fx.quantization.qconfig import QConfigMapping
from lucid_fx.registry import Registry
from lucid_fx.sqnr_target import quantize_to_target

__all__ = ["quantize"]


def quantize(
    model: nn.Module,
    example_inputs: Any,
    calibration_data: Iterable,
    qconfig_mapping: Optional[QConfigMapping] = None,
    *,
    backend: Optional[str] = None,
    reference: bool = False,
    progress: Optional[bool] = None,
    registry: Optional[Registry] = None,
    target_sqnr_db: Optional[float] = None,
    held_out_data: Optional[Iterable] = None,
    max_rounds: int = 6,
    precision: str = "int8",
    precision_tie: float = 0.03,
    **prepare_options: Any,
) -> nn.Module:
    """prepare -> calibrate -> convert in one call; ``model`` itself is left unchanged.

    With ``target_sqnr_db``, the fewest nodes are kept float until the output SQNR on
    ``held_out_data`` (default: the last quarter of ``calibration_data``, then not calibrated on)
    meets it, in at most ``max_rounds`` rounds of prepare/calibrate/convert/compare
    (``lucid_fx.sqnr_target``); the result carries a ``TargetReport`` as ``lucid_fx_target``.
    ``progress`` is calibrate's (the bar on a terminal, nothing in a log by default).

    ``precision="measured"`` times each region of attention-core and elementwise ops
    (``MEASURED_OPS``) int8 and float on this machine, on the held-out data, and keeps float those
    more accurate and at most ``precision_tie`` slower, or as accurate and more than that faster
    (``lucid_fx.measured_precision``), one round per group of like regions within ``max_rounds``;
    the result carries a ``PrecisionReport`` as ``lucid_fx_precision``. The default, ``"int8"``,
    runs every op with a rule in int8 (norms aside), the same on every run and machine."""
    require_module("quantize", model)
    require_float_model("quantize", model)
    if isinstance(example_inputs, QConfigMapping):
        warnings.warn(
            "quantize: took the arguments as prepare's torch.ao order, (model, qconfig_mapping, example_inputs, "
            "calibration_data); quantize's order is (model, example_inputs, calibration_data, qconfig_mapping=None): "
            "pass qconfig_mapping= by keyword to silence this",
            stacklevel=2,
        )
        example_inputs, calibration_data, qconfig_mapping = calibration_data, qconfig_mapping, example_inputs
    if precision not in ("int8", "measured"):
        raise ValueError(f"quantize: precision must be 'int8' or 'measured', got {precision!r}")
    if precision == "measured":
        if target_sqnr_db is not None or reference:
            raise ValueError("quantize: precision='measured' times int8 kernels against float, so it takes neither "
                             "target_sqnr_db nor reference=True; use one of them at a time")
        calibration, held_out = _split(list(calibration_data), held_out_data, "precision='measured'")
        return quantize_measured(
            model, example_inputs, calibration, held_out, qconfig_mapping, max_rounds=max_rounds, tie=precision_tie,
            backend=backend, registry=registry, prepare_options=prepare_options,
        )
    if target_sqnr_db is not None:
        calibration, held_out = _split(list(calibration_data), held_out_data)
        return quantize_to_target(
            model, example_inputs, calibration, held_out, target_sqnr_db, qconfig_mapping, max_rounds=max_rounds,
            convert_options=dict(backend=backend, reference=reference, registry=registry),
            prepare_options=dict(backend=backend, registry=registry, **prepare_options),
        )
    prepared = prepare(model, qconfig_mapping, example_inputs, backend=backend, registry=registry, **prepare_options)
    calibrate(prepared, calibration_data, progress=progress)
    return convert(prepared, backend=backend, reference=reference, inplace=True, registry=registry)


def _split(calibration: list, held_out_data: Optional[Iterable], what: str = "target_sqnr_db") -> tuple:
    """Calibration and held-out batches for a search; held-out batches as compare takes them (a
    tuple of positional inputs or a dict of keyword inputs each)."""
    if held_out_data is None:
        if len(calibration) < 2:
            raise ValueError(f"quantize: {what} needs held-out data: pass held_out_data, or at least 2 calibration batches")
        cut = len(calibration) - max(1, len(calibration) // 4)
        calibration, held_out_data = calibration[:cut], calibration[cut:]
    held_out = list(held_out_data)
    if not held_out:
        raise ValueError(f"quantize: held-out data for {what} is empty; pass at least one batch")
    return calibration, [b if isinstance(b, (tuple, dict)) else tuple(b) if isinstance(b, list) else (b,) for b in held_out]
