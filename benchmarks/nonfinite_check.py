"""What the NaN/±inf check at the float-to-int8 boundaries costs a converted model.

    python benchmarks/nonfinite_check.py [--rounds 41] [--models mlp_b64,mlp_b1,resnet_1x] [--threads N]
                                         [--input-checks]

``--input-checks`` measures the kernels' input checks (``lucid_fx.kernels.checks.CHECKS``: shapes,
dtypes, devices) the same way instead, turned off by emptying every entry of the table.

Each model is converted once and called with and without the check in the same process (the
check turned off: ``lucid_fx.kernels.native.check_finite = False`` for the native quantize pass,
and ``codes_need_clamp`` replaced by "always clamp" in the torch kernels, which run where no C
compiler is). Each round runs blocks of ~50 ms of calls in the order on, off, control, control, off, on ("control" is
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
from lucid_fx.kernels import checks, native, program_ops, quantize  # noqa: E402


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


def _finite_check(on: bool) -> None:
    # The portable kernel's check, and the lowered program's (a converted model runs the program).
    quantize.codes_need_clamp = _REAL_CHECK if on else (lambda codes, quant_min, quant_max, value: True)
    program_ops.codes_need_clamp = _REAL_PROGRAM_CHECK if on else (lambda t, low, high, x: True)
    native.check_finite = on  # the native pass counts NaN/±inf while it quantizes


def _input_checks(on: bool) -> None:
    checks.CHECKS.update(_REAL_CHECKS if on else {name: (lambda *args: None) for name in _REAL_CHECKS})


_REAL_CHECK, _REAL_CHECKS = quantize.codes_need_clamp, dict(checks.CHECKS)
_REAL_PROGRAM_CHECK = program_ops.codes_need_clamp


def measure(qmodel, x, rounds: int, switch=_finite_check) -> dict:
    """Median seconds per call with the check ("on") and without it ("off"); "control" is a second
    "off", whose difference from "off" shows what noise alone does."""
    samples = {name: [] for name in ("on", "off", "control")}
    with torch.no_grad():
        n = _calls_per_block(qmodel, x)
        for _ in range(rounds):
            times = dict.fromkeys(samples, 0.0)
            for variant in ("on", "off", "control", "control", "off", "on"):  # same positions on average
                switch(variant == "on")
                times[variant] += _block(qmodel, x, n) / 2
            for variant, seconds in times.items():
                samples[variant].append(seconds)
    switch(True)

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y - 1 for x, y in zip(samples[a], samples[b]))

    medians = {k: statistics.median(v) for k, v in samples.items()}
    return {**medians, "paired": paired("on", "off"), "noise": paired("control", "off")}


def finite_check_alone(x, rounds: int) -> float:
    """Median seconds the check adds to quantizing ``x`` by itself: the native pass with and without
    its count (interleaved), or the torch kernel's ``aminmax`` and two reads where no compiler is."""
    if not native.available():
        codes = (x * 50).round_()
        return _median_seconds(lambda: _REAL_CHECK(codes, 0, 255, x), rounds)
    x = x.contiguous()
    quantize = lambda: native.quantize_codes(x, 50.0, 128, 0, 255, torch.uint8)  # noqa: E731
    differences = []
    for _ in range(rounds):
        timed = {}
        for on in (True, False):
            _finite_check(on)
            timed[on] = _median_seconds(quantize, 1)
        differences.append(timed[True] - timed[False])
    _finite_check(True)
    return statistics.median(differences)


def _median_seconds(fn, rounds: int, calls: int = 200) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--models", default="mlp_b64,mlp_b1,resnet_1x")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--input-checks", action="store_true", help="measure the kernels' input checks instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # one thread is steadier on a shared machine (no spinning barriers)
    what = "the kernels' input checks" if args.input_checks else "the finite check"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds: {what}; "
          f"native kernels: {native.status()}")
    print("| model | with (ms) | without (ms) | with / without | control / without | check alone (us) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        model, example, make_batch = MODELS[name]()
        qmodel = lucid_fx.quantize(model, (example,), [make_batch(s) for s in range(4)])
        x = make_batch(100)
        t = measure(qmodel, x, args.rounds, _input_checks if args.input_checks else _finite_check)
        alone = "-" if args.input_checks else f"{finite_check_alone(x, args.rounds) * 1e6:.1f}"
        print(f"| {name} | {t['on'] * 1e3:.3f} | {t['off'] * 1e3:.3f} | {t['paired'] * 100:+.2f}% "
              f"| {t['noise'] * 100:+.2f}% | {alone} |")


if __name__ == "__main__":
    main()
