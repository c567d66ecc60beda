"""torch.compile (inductor, with and without freezing) over a lowered program of direct oneDNN calls (question 7).

    python benchmarks/prototypes/compile_lowered.py [--models mlp_b1,mlp_b64,resnet_1x]

Lowers today's lucid_fx model with ``lowering.lower`` and tries ``torch.compile`` on it: does it compile
(with oneDNN-packed mkldnn tensors as module attributes), are the outputs unchanged, is it faster?

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread): without freezing inductor fails
(``assert packed_weight.get_name() in V.graph.constants`` in its qlinear lowering); with freezing the MLPs
compile (2-4 s, identical output) and run slower than the uncompiled program (mlp_b1 252 vs 207 us,
mlp_b64 2578 vs 2133 us); ResNet-like fails (``auto_functionalized_v2`` has no kernel: the in-place sum
of qconv2d_pointwise.binary).
"""

import argparse
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import interleaved, table  # noqa: E402
from lowering import lower  # noqa: E402
from overhead import variants_for  # noqa: E402

warnings.simplefilter("ignore")


def try_compile(fn, x, freezing: bool):
    import torch._inductor.config as config

    config.freezing = freezing
    torch._dynamo.reset()
    start = time.perf_counter()
    try:
        compiled = torch.compile(fn)
        with torch.no_grad():
            out = compiled(x)
        return compiled, out, time.perf_counter() - start, None
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        last = traceback.format_exception_only(type(exc), exc)[-1]
        return None, None, time.perf_counter() - start, " ".join(last.split())[:200]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp_b1,mlp_b64,resnet_1x")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        variants, x, model, batches = variants_for(name, [], 4)
        today = variants["lucid_fx int8"]
        low = lower(today, x, fuse_dequantize=True)
        with torch.no_grad():
            want = low(x)
        fns = {"lucid_fx today": lambda: today(x), "lowered": lambda: low(x)}
        for freezing in (False, True):
            label = f"lowered + compile{' (freezing)' if freezing else ''}"
            with torch.no_grad():
                compiled, out, seconds, err = try_compile(low, x, freezing)
            if err:
                print(f"{name}: {label} FAILED after {seconds:.1f} s: {err}")
                continue
            print(f"{name}: {label} compiled in {seconds:.1f} s; output equal: {torch.equal(out, want)}, "
                  f"max diff {float((out - want).abs().max()):.3g}")
            fns[label] = lambda c=compiled: c(x)
        with torch.no_grad():
            print(table(interleaved(fns, rounds=9)))


if __name__ == "__main__":
    main()
