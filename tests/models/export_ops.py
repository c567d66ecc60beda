"""torch.export on the family models: which aten ops the captured graphs hold, and what today's
lucid_fx.prepare makes of ``ep.module()``. Run from the repository root:

    python -m tests.models.export_ops [family ...] [--ops]

For each family: ``torch.export.export(model, args, kwargs, strict=False)``; the ops of
``ep.module()``'s graph and of ``ep.run_decompositions().module()``'s (op and count); then
prepare -> calibrate -> convert of ``ep.module()`` with the convert report summed up.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings
from typing import Any, Counter, Dict, List, Optional

import torch
from torch import fx, nn

import lucid_fx

from .families import BASELINES, FAMILIES, Family
from .measure import _data, _error, _sqnr_on


def aten_ops(gm: fx.GraphModule) -> Counter:
    """call_function targets by name (``aten.linear.default``) and count."""
    names = (str(n.target) if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", str(n.target))
             for n in gm.graph.nodes if n.op == "call_function")
    return collections.Counter(names)


def exported(family: Family):
    model = family.make_model()
    args, kwargs = family.example_inputs()
    return model, torch.export.export(model, tuple(args), dict(kwargs), strict=False)


def _eval_mode(gm: nn.Module) -> nn.Module:
    # ep.module() says training=True and refuses .eval() ("Calling eval() is not supported yet");
    # the exported graph already holds the eval-mode ops (dropout(train=False), batch norm
    # without training), so only the flag is wrong.
    for module in gm.modules():
        module.training = False
    return gm


def quantize_exported(family: Family, model: nn.Module, ep) -> Dict[str, Any]:
    """Today's lucid_fx on ``ep.module()``: what it accepts, and what runs in int8."""
    gm = ep.module()
    args, kwargs = family.example_inputs()
    flat = tuple(args) + tuple(kwargs.values())  # ep.module()'s placeholders: args, then kwargs in call order
    result: Dict[str, Any] = {}
    try:
        lucid_fx.prepare(gm, example_inputs=flat)
    except Exception as exc:  # noqa: BLE001
        result["as_is"] = _error(exc)
    stage = "prepare"
    try:
        prepared = lucid_fx.prepare(_eval_mode(gm), example_inputs=flat)
        stage = "calibrate"
        batches, held_out = _data(family)
        lucid_fx.calibrate(prepared, [tuple(a) + tuple(k.values()) for a, k in batches], progress=False)
        stage = "convert"
        qmodel = lucid_fx.convert(prepared)
        stage = "run"
        result["sqnr"] = _sqnr_on(model, qmodel, held_out)
    except Exception as exc:  # noqa: BLE001
        result["failed"] = f"{stage}: {_error(exc)}"
        return result
    report = qmodel.lucid_fx_convert_report
    result["kernels"] = len(report.lowered)
    result["float_reasons"] = collections.Counter(report.float_ops.values())
    return result


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="default: all families and baselines")
    parser.add_argument("--ops", action="store_true", help="list every op of both graphs, with counts")
    options = parser.parse_args(argv)
    every = {**FAMILIES, **BASELINES}
    warnings.simplefilter("ignore", FutureWarning)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    total_pre: Counter = collections.Counter()
    total_core: Counter = collections.Counter()
    for name in options.families or list(every):
        start = time.perf_counter()
        try:
            model, ep = exported(every[name])
        except Exception as exc:  # noqa: BLE001
            print(f"## {name}: torch.export failed: {_error(exc)}")
            continue
        seconds = time.perf_counter() - start
        pre, core = aten_ops(ep.module()), aten_ops(ep.run_decompositions().module())
        total_pre.update({op: 1 for op in pre})
        total_core.update({op: 1 for op in core})
        q = quantize_exported(every[name], model, ep)
        print(f"## {name}: exported in {seconds:.1f}s, {sum(pre.values())} ops in ep.module(), {sum(core.values())} after run_decompositions()")
        if "as_is" in q:
            print(f"- lucid_fx.prepare(ep.module()) as it is: {q['as_is']}")
        if "failed" in q:
            print(f"- with the training flags cleared: FAILED {q['failed']}")
        else:
            print(f"- with the training flags cleared: {q['kernels']} int8 kernels, SQNR {q['sqnr']:.1f} dB; float: "
                  + "; ".join(f"{why} x{n}" for why, n in q["float_reasons"].most_common()))
        if options.ops:
            print("- ep.module(): " + ", ".join(f"{op} {n}" for op, n in sorted(pre.items())))
            print("- run_decompositions(): " + ", ".join(f"{op} {n}" for op, n in sorted(core.items())))
    print("\n## ops by number of families using them (ep.module() | run_decompositions())")
    for op in sorted(set(total_pre) | set(total_core)):
        print(f"{op}: {total_pre.get(op, 0)} | {total_core.get(op, 0)}")


if __name__ == "__main__":
    main()
