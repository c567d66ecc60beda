"""int8 inference benchmark: fp32 eager vs torch.ao FX int8 (x86 and onednn engines) vs lucid_fx.

    python benchmarks/int8_inference.py [--rounds 7] [--models mlp_b64,resnet_1x,...] [--quick]

Every figure is a same-run median of ``--rounds`` timed rounds (each round runs each model
enough times to take ~0.2 s, the variants taking turns within the round) after a warm-up.
Speedups are ratios to fp32 eager measured in the same run. SQNR is against the fp32 output on a held-out batch. Size is the serialized
``state_dict``. torch.ao is deprecated but still runs on torch 2.13; it is a peer here, never a
dependency of lucid_fx.
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    noise = (ref - out).float().pow(2).mean().clamp_min(1e-20)
    return float(10 * torch.log10(ref.float().pow(2).mean() / noise))


def size_mb(model: torch.nn.Module) -> float:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 2**20


def timed(fns: dict, x, rounds: int) -> dict:
    """Median seconds per call of each ``fns[name](x)``. The variants take turns within every
    round, so a slow spell of this shared machine hits all of them instead of one."""
    with torch.no_grad():
        per_round = {}
        for name, fn in fns.items():
            fn(x)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2 or n < 2:
                fn(x)
                n += 1
            per_round[name] = n
        samples = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(per_round[name]):
                    fn(x)
                samples[name].append((time.perf_counter() - start) / per_round[name])
    return {name: statistics.median(values) for name, values in samples.items()}


def _engine_set(variant: str, model):
    """``model``, called with torch.ao's quantized engine set to the variant's (x86 or onednn)."""
    if not variant.startswith("torch.ao"):
        return model
    engine = variant.split()[-1]

    def run(x):
        torch.backends.quantized.engine = engine
        return model(x)

    return run


def torch_ao_int8(model, example, batches, engine: str):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = engine
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(engine), (example,))
        with torch.no_grad():
            for b in batches:
                prepared(b)
        return convert_fx(prepared)


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calib", type=int, default=8, help="calibration batches")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} rounds; "
          f"VNNI: {torch.cpu._is_vnni_supported()}")
    header = f"{'model':<10} {'variant':<16} {'ms':>9} {'speedup':>8} {'SQNR dB':>8} {'MB':>7}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.models.split(","):
        model, example, make_batch = MODELS[name]()
        batches = [make_batch(s) for s in range(args.calib)]
        held_out = make_batch(1000)
        with torch.no_grad():
            reference = model(held_out)
        variants = {"fp32 eager": model}
        for engine in ("x86", "onednn"):
            try:
                variants[f"torch.ao {engine}"] = torch_ao_int8(model, example, batches, engine)
            except Exception as exc:  # noqa: BLE001 - a peer failing is a result, reported as such
                print(f"{name:<10} torch.ao {engine:<7} failed: {type(exc).__name__}: {str(exc)[:80]}")
        variants["lucid_fx int8"] = lucid_fx.quantize(model, (example,), batches)
        seconds = timed({variant: _engine_set(variant, m) for variant, m in variants.items()}, example, args.rounds)
        base = seconds["fp32 eager"]
        for variant, m in variants.items():
            with torch.no_grad():
                out = _engine_set(variant, m)(held_out)
            row = (name, variant, seconds[variant] * 1e3, base / seconds[variant],
                   sqnr(reference, out) if m is not model else float("inf"), size_mb(m))
            rows.append(row)
            print(f"{row[0]:<10} {row[1]:<16} {row[2]:>9.2f} {row[3]:>7.2f}x {row[4]:>8.1f} {row[5]:>7.1f}")
    return rows


if __name__ == "__main__":
    main()
