"""Measure today's lucid_fx on the family models: capture, float regions, int8 FLOP share, SQNR,
with torch.ao's FX quantization as an oracle. Run from the repository root:

    python -m tests.models.measure [family ...] [--details]

Each family is tried as a user would: ``lucid_fx.prepare(model, example_inputs)``, and again with
``concrete_args`` (every defaulted ``forward`` parameter the inputs leave out, at its default) where
the first try left part of the model float or failed. Both then calibrate and convert.
"""

from __future__ import annotations

import argparse
import collections
import copy
import inspect
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

import lucid_fx
from lucid_fx._flops import _CPU_KERNELS
from lucid_fx.passes.trace_model import trace_model

from ._common import Inputs, as_batch
from .families import BASELINES, FAMILIES, Family

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION_BATCHES, HELD_OUT_BATCHES = 8, 4


def positional(model: nn.Module, inputs: Inputs) -> tuple:
    """The inputs as positional arguments of ``forward`` (lucid_fx.prepare's example_inputs): keyword
    inputs moved to their slots, the slots between them filled with their defaults."""
    args, kwargs = inputs
    if not kwargs:
        return tuple(args)
    params = list(inspect.signature(model.forward).parameters.values())
    last = max(i for i, p in enumerate(params) if p.name in kwargs)
    return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in params[: last + 1])


def concrete_args(model: nn.Module, inputs: Inputs) -> Dict[str, Any]:
    """Every defaulted parameter of ``forward`` that ``inputs`` leave out, at its default (the usual
    torch.fx fix for optional arguments; transformers.utils.fx does the same)."""
    args, kwargs = inputs
    params = list(inspect.signature(model.forward).parameters.values())[len(args):]
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params if p.kind in plain and p.default is not inspect.Parameter.empty and p.name not in kwargs}


def outputs(value) -> torch.Tensor:
    leaves = [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.cat([t.detach().float().flatten() for t in leaves])


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (reference - test).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


def _data(family: Family):
    """Calibration batches and held-out batches (other seeds) to measure SQNR on."""
    batches = family.calibration_batches(CALIBRATION_BATCHES + HELD_OUT_BATCHES)
    return batches[:CALIBRATION_BATCHES], batches[CALIBRATION_BATCHES:]


def _sqnr_on(model: nn.Module, quantized: nn.Module, held_out) -> float:
    with torch.no_grad():
        reference = torch.cat([outputs(model(*args, **kwargs)) for args, kwargs in held_out])
        test = torch.cat([outputs(quantized(*args, **kwargs)) for args, kwargs in held_out])
    return sqnr(reference, test)


def _error(exc: BaseException) -> str:
    frame = next((f for f in reversed(traceback.extract_tb(exc.__traceback__)) if "/torch/" not in f.filename), None)
    where = f"{Path(frame.filename).relative_to(ROOT) if frame.filename.startswith(str(ROOT)) else frame.filename}:{frame.lineno}: " if frame else ""
    return f"{where}{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def model_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """Total matrix FLOPs of one float run, by torch's own counter (the report's total should agree)."""
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_KERNELS)
    # on a copy without gradients: the counter's module hooks fail on a parameter passed to a module call
    # (transformers' Mamba hands its conv1d weight to a hub kernel layer)
    with counter, torch.no_grad():
        copy.deepcopy(model).requires_grad_(False)(*args, **kwargs)
    return counter.get_total_flops()


def run_lucid(family: Family, use_concrete: bool) -> Dict[str, Any]:
    model, example = family.make_model(), family.example_inputs()
    batches, held_out = _data(family)
    result: Dict[str, Any] = {"concrete": use_concrete}
    options = {"concrete_args": concrete_args(model, example)} if use_concrete else {}
    start = time.perf_counter()
    stage = "prepare"
    try:
        prepared = lucid_fx.prepare(model, example_inputs=positional(model, example), **options)
        result["traced"] = isinstance(prepared, fx.GraphModule)
        result["float_modules"] = [u.describe() for u in prepared.lucid_fx_report.float_modules]
        result["captures"] = dict(prepared.lucid_fx_report.captures)
        stage = "calibrate"
        lucid_fx.calibrate(prepared, [as_batch(b) for b in batches], progress=False)
        stage = "convert"
        qmodel = lucid_fx.convert(prepared)
        result["seconds"] = time.perf_counter() - start
        stage = "run"
        result["sqnr"] = _sqnr_on(model, qmodel, held_out)
    except Exception as exc:  # noqa: BLE001 - the failure is the measurement
        result["failed"] = f"{stage}: {_error(exc)}"
        if stage == "prepare":  # what the fallback had kept float when it failed
            found = trace_model(family.make_model(), concrete_args=options.get("concrete_args")).untraceable
            result["float_modules"] = [u.describe() for u in found]
        return result
    report = qmodel.lucid_fx_convert_report
    kinds = collections.Counter()
    for region in report.float_regions:
        if region.kind != "module":  # modules are listed with their trace errors
            kinds[(region.kind, region.why)] += 1
    result.update(kernels=len(report.lowered), float_ops=kinds, flops=report.total_flops, int8_flops=report.int8_flops,
                  torch_flops=model_flops(model, *example), folded_flops=report.folded_flops, report=str(report))
    return result


def torch_ao_model(family: Family, engine: str, batches, use_concrete: bool = False) -> nn.Module:
    """torch.ao's FX int8 model of ``family`` (default QConfigs of ``engine``), calibrated on ``batches``;
    raises where torch.ao cannot trace or convert it."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    model, example = family.make_model(), family.example_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = engine
        target = copy.deepcopy(model)
        if use_concrete:  # torch.ao takes no concrete_args: trace first, then hand it the graph
            target = fx.symbolic_trace(target, concrete_args=concrete_args(model, example))
        prepared = prepare_fx(target, get_default_qconfig_mapping(engine), positional(model, example))
        with torch.no_grad():
            for args, kwargs in batches:
                prepared(*args, **kwargs)
        return convert_fx(prepared)


def run_torch_ao(family: Family, use_concrete: bool) -> Dict[str, Any]:
    batches, held_out = _data(family)
    try:
        qmodel = torch_ao_model(family, "x86", batches, use_concrete)
        return {"sqnr": _sqnr_on(family.make_model(), qmodel, held_out)}
    except Exception as exc:  # noqa: BLE001
        return {"failed": _error(exc)}


def measure(family: Family) -> Dict[str, Any]:
    plain = run_lucid(family, use_concrete=False)
    tries = [plain]
    if "failed" in plain or not plain.get("traced", False):
        tries.append(run_lucid(family, use_concrete=True))
    ao = run_torch_ao(family, use_concrete=False)
    if "failed" in ao:
        ao = {**run_torch_ao(family, use_concrete=True), "first": ao["failed"]}
    return {"lucid": tries, "ao": ao}


def _capture(r: Dict[str, Any]) -> str:
    how = "fx+concrete_args" if r["concrete"] else "fx"
    if "traced" not in r:
        return f"{how}: failed"
    exported = [p or "<root>" for p, by in r.get("captures", {}).items() if by == "export"]
    if exported:  # capture="auto": torch.export for what fx could not trace
        how += f" + export ({', '.join(exported)})"
    return how if r["traced"] else f"{how}: root float, {len(r['float_modules'])} modules float"


def row(name: str, m: Dict[str, Any]) -> str:
    best = next((r for r in reversed(m["lucid"]) if "failed" not in r), m["lucid"][-1])
    ao = m["ao"]
    ao_text = f"{ao['sqnr']:.1f}" if "sqnr" in ao else "fails"
    captures = " / ".join(_capture(r) for r in m["lucid"])
    if "failed" in best:
        return f"| {name} | {captures} | - | - | - | fails | {ao_text} |"
    share = 100.0 * best["int8_flops"] / best["flops"] if best["flops"] else float("nan")
    return (f"| {name} | {captures} | {best['kernels']} | {sum(best['float_ops'].values())} | {share:.1f}% "
            f"| {best['sqnr']:.1f} | {ao_text} |")


def details(name: str, m: Dict[str, Any]) -> List[str]:
    lines = [f"## {name}"]
    for r in m["lucid"]:
        lines.append(f"- lucid_fx {'with concrete_args' if r['concrete'] else 'plain'}:"
                     + (f" FAILED {r['failed']}" if "failed" in r else f" {r['seconds']:.1f}s"))
        lines += [f"    float module: {d}" for d in r.get("float_modules", [])]
        for (op, why), count in sorted(r.get("float_ops", {}).items(), key=lambda kv: -kv[1]):
            lines.append(f"    float x{count}: {op} ({why})")
        if "flops" in r and r["flops"] + r["folded_flops"] != r["torch_flops"]:
            lines.append(f"    FLOPs: report {r['flops']} (+{r['folded_flops']} folded), torch's counter {r['torch_flops']}")
    ao = m["ao"]
    if "first" in ao:
        lines.append(f"- torch.ao plain: FAILED {ao['first']}")
    lines.append(f"- torch.ao{' on the fx.symbolic_trace(concrete_args) graph' if 'first' in ao else ''}: "
                 + (f"FAILED {ao['failed']}" if "failed" in ao else f"SQNR {ao['sqnr']:.1f} dB"))
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="default: all families and baselines")
    parser.add_argument("--details", action="store_true", help="list every float module and float op")
    options = parser.parse_args(argv)
    every = {**FAMILIES, **BASELINES}
    names = options.families or list(every)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    results = {name: measure(every[name]) for name in names}
    print("| family | capture | int8 kernels | float regions | FLOPs in int8 | SQNR lucid_fx dB | SQNR torch.ao dB |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        print(row(name, results[name]))
    if options.details:
        for name in names:
            print("\n".join([""] + details(name, results[name])))


if __name__ == "__main__":
    main()
