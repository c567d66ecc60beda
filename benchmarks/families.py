"""int8 inference on the family models of tests/models (issue 14's goal: faster than fp32 and than
torch.ao): fp32 eager vs torch.ao FX int8 (x86 and onednn engines, where it can trace the model)
vs lucid_fx, at each family's own example inputs.

    python benchmarks/families.py [--rounds 7] [--threads 1] [--families llama,vit,efficientnet,...]

``hf:<name>`` names a real transformers class of tests/models/hf_check.py (small config, random
weights): ``--families hf:mixtral,hf:llama`` (torch.ao cannot trace them: its columns say so).

Timing as in int8_inference.py (same-run medians of ``--rounds`` rounds, the variants taking
turns); speedups are over fp32 eager in the same run, the last timing column is lucid_fx's time
over the faster torch.ao engine's (> 1: lucid_fx is faster). The int8 FLOP share is the convert
report's; SQNR is against fp32 on ``--held-out`` batches that calibration did not see (lucid_fx /
the torch.ao x86 engine). Eight by default: on the MobileNetV2-like model one batch's SQNR ranges
from 4.3 to 8.8 dB by itself (torch.ao) and 4.9 to 9.2 (lucid_fx), so two batches cannot order them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from int8_inference import cpu_line, timed  # noqa: E402
from tests.models.families import FAMILIES, as_batch  # noqa: E402
from tests.models.measure import outputs, positional, sqnr, torch_ao_model  # noqa: E402

import lucid_fx  # noqa: E402

DEFAULT = "llama,vit,efficientnet,convnext,densenet,shufflenet,mobilenet_v2,unet,cyclegan"


def _held_out_sqnr(model, quantized, held_out) -> float:
    with torch.no_grad():
        reference = torch.cat([outputs(model(*a, **k)) for a, k in held_out])
        test = torch.cat([outputs(quantized(*a, **k)) for a, k in held_out])
    return sqnr(reference, test)


def _family(name: str):
    if name.startswith("hf:"):
        from tests.models.hf_check import hf_families

        return hf_families()[name[3:]]
    return FAMILIES[name]


def bench(name: str, rounds: int, calib: int, held: int = 8) -> dict:
    family = _family(name)
    model, (args, kwargs) = family.make_model(), family.example_inputs()
    batches = family.calibration_batches(calib + held)
    batches, held_out = batches[:calib], batches[calib:]
    variants = {"fp32": model}
    for engine in ("x86", "onednn"):
        try:
            variants[f"torch.ao {engine}"] = torch_ao_model(family, engine, batches)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result
            print(f"  {name}: torch.ao {engine} fails: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
    prepared = lucid_fx.prepare(model, example_inputs=positional(model, (args, kwargs)))
    lucid_fx.calibrate(prepared, [as_batch(b) for b in batches], progress=False)
    variants["lucid_fx"] = lucid_fx.convert(prepared)

    def caller(variant, m):
        engine = variant.split()[-1] if variant.startswith("torch.ao") else None

        def run(_):
            if engine:
                torch.backends.quantized.engine = engine
            return m(*args, **kwargs)
        return run

    seconds = timed({v: caller(v, m) for v, m in variants.items()}, torch.zeros(1), rounds)
    ao = [t for v, t in seconds.items() if v.startswith("torch.ao")]
    report = variants["lucid_fx"].lucid_fx_convert_report
    torch.backends.quantized.engine = "x86"
    return {
        "name": name, "fp32_ms": seconds["fp32"] * 1e3,
        "speedup": {v: seconds["fp32"] / t for v, t in seconds.items() if v != "fp32"},
        "vs_ao": min(ao) / seconds["lucid_fx"] if ao else None,
        "share": report.int8_flop_share,
        "sqnr": _held_out_sqnr(model, variants["lucid_fx"], held_out),
        "sqnr_ao": _held_out_sqnr(model, variants["torch.ao x86"], held_out) if "torch.ao x86" in variants else None,
    }


def row(r: dict) -> str:
    speed = r["speedup"]
    cell = lambda v: f"{speed[v]:.2f}x" if v in speed else "fails"  # noqa: E731
    vs = f"{r['vs_ao']:.2f}" if r["vs_ao"] is not None else "-"
    ao_sqnr = f"{r['sqnr_ao']:.1f}" if r["sqnr_ao"] is not None else "-"
    return (f"| {r['name']} | {r['fp32_ms']:.2f} | {cell('torch.ao x86')} | {cell('torch.ao onednn')} | {cell('lucid_fx')} "
            f"| {vs} | {100 * r['share']:.1f}% | {r['sqnr']:.1f} / {ao_sqnr} |")


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calib", type=int, default=8, help="calibration batches")
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches SQNR is measured on")
    parser.add_argument("--families", default=DEFAULT)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    print(cpu_line())
    print(f"torch {torch.__version__}, {options.threads} thread(s), medians of {options.rounds} rounds")
    results = [bench(name, options.rounds, options.calib, options.held_out) for name in options.families.split(",")]
    print("| family | fp32 ms | torch.ao x86 | torch.ao onednn | lucid_fx | lucid_fx / faster torch.ao | int8 FLOPs | SQNR dB lucid_fx / torch.ao |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r))
    return results


if __name__ == "__main__":
    main()
