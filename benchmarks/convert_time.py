"""Convert-time benchmark: lucid_fx.convert vs torch.ao's convert_fx on a 200-layer MLP.

    python benchmarks/convert_time.py [--rounds 5]

Both sides prepare and calibrate the same model (100 x (Linear(64, 64), ReLU)) outside the
timer; the timer covers convert alone, on a fresh copy each round. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

import lucid_fx


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(100) for m in (nn.Linear(64, 64), nn.ReLU())]).eval()
    batches = [torch.randn(8, 64) for _ in range(4)]

    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    ours = []
    for _ in range(args.rounds + 1):
        work = copy.deepcopy(prepared)
        start = time.perf_counter()
        lucid_fx.convert(work, inplace=True)
        ours.append(time.perf_counter() - start)

    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
        with torch.no_grad():
            for b in batches:
                theirs_prepared(b)
        theirs = []
        for _ in range(args.rounds + 1):
            work = copy.deepcopy(theirs_prepared)
            start = time.perf_counter()
            convert_fx(work)
            theirs.append(time.perf_counter() - start)
    a, b = statistics.median(ours[1:]) * 1e3, statistics.median(theirs[1:]) * 1e3
    print(f"convert time, 200-layer MLP, median of {args.rounds} (1 thread)")
    print(f"{'lucid_fx ms':>12} {'torch.ao ms':>12} {'ratio':>7}")
    print(f"{a:>12.1f} {b:>12.1f} {a / b:>7.2f}")
    return {"lucid_fx_ms": a, "torch_ao_ms": b}


if __name__ == "__main__":
    main()
