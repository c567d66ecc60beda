"""What the NaN/±inf check at the float-to-int8 boundaries costs a converted model.

    python benchmarks/nonfinite_check.py [--rounds 41] [--models mlp_b64,mlp_b1,resnet_1x] [--threads N]

Each model is converted once and called with and without the check in the same process (the
check turned off by replacing ``lucid_fx.kernels.quantize.codes_need_clamp`` with "always
clamp", which is the unchecked kernel). Each
round runs blocks of ~50 ms of calls in the order on, off, control, control, off, on ("control" is
a second "off": its difference from "off" is what noise alone gives), so a slow spell of this
shared machine hits every variant alike and none always runs first. Times are medians over
``--rounds`` rounds of the per-call time, the differences medians over rounds of each round's
ratio. The check alone, timed on the model's input, is the figure noise moves least.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402
from lucid_fx.kernels import quantize  # noqa: E402


def _calls_per_block(fn, x) -> int:
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05 or n < 2:
        fn(x)
        n += 1
    return n


def _block(qmodel, x, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        qmodel(x)
    return (time.perf_counter() - start) / n


def measure(qmodel, x, rounds: int) -> dict:
    """Median seconds per call with the check ("on") and without it ("off"); "control" is a second
    "off" (the same function), whose difference from "off" shows what noise alone does."""
    real = quantize.codes_need_clamp
    unchecked = lambda codes, quant_min, quant_max, value: True  # noqa: E731
    variants = {"on": real, "off": unchecked, "control": unchecked}
    samples = {name: [] for name in variants}
    with torch.no_grad():
        n = _calls_per_block(qmodel, x)
        for _ in range(rounds):
            times = dict.fromkeys(variants, 0.0)
            for variant in ("on", "off", "control", "control", "off", "on"):  # same positions on average
                quantize.codes_need_clamp = variants[variant]
                times[variant] += _block(qmodel, x, n) / 2
            for variant, seconds in times.items():
                samples[variant].append(seconds)
    quantize.codes_need_clamp = real
    codes = (x * 50).round_()  # codes of the model's input, as the kernel sees them
    alone = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(100):
            real(codes, 0, 255, x)
        alone.append((time.perf_counter() - start) / 100)

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y - 1 for x, y in zip(samples[a], samples[b]))

    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {**medians, "alone": statistics.median(alone), "paired": paired("on", "off"), "noise": paired("control", "off")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--models", default="mlp_b64,mlp_b1,resnet_1x")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # one thread is steadier on a shared machine (no spinning barriers)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print("| model | with check (ms) | without (ms) | with / without | control / without | check alone (us) | check / model time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        model, example, make_batch = MODELS[name]()
        qmodel = lucid_fx.quantize(model, (example,), [make_batch(s) for s in range(4)])
        t = measure(qmodel, make_batch(100), args.rounds)
        alone = t["alone"] / t["off"] * 100
        print(f"| {name} | {t['on'] * 1e3:.3f} | {t['off'] * 1e3:.3f} | {t['paired'] * 100:+.2f}% | {t['noise'] * 100:+.2f}% "
              f"| {t['alone'] * 1e6:.1f} | {alone:.2f}% |")


if __name__ == "__main__":
    main()
