"""Where one converted model's call spends its time on a GPU: host time and kernel launches per op.

    python benchmarks/cuda_profile.py [--model mlp_b1] [--top 12]

Prints the torch profiler's table (ops by host time, with their CUDA time and calls) for one
synchronized call after warm-up, with the kernels launched one at a time (``CUDA_GRAPHS`` off, so
each op shows), and the call's kernel launches in all: on a GPU, a model of small layers is bound
by launches and host time, not by the int8 GEMMs, which is why converted models replay CUDA graphs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402
import lucid_fx.cuda_graph as cuda_graph  # noqa: E402
from lucid_fx.kernels import cuda_fused  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp_b1")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--torch-ops", action="store_true", help="the fused Triton kernels off (cuda_fused.FUSED)")
    parser.add_argument("--off", default="",
                        help="fused kernels to run as torch ops, comma-separated (cuda_fused.KERNELS)")
    args = parser.parse_args(argv)
    cuda_graph.CUDA_GRAPHS = False
    cuda_fused.FUSED = not args.torch_ops
    cuda_fused.OFF = {name for name in args.off.split(",") if name}
    model, example, make_batch = MODELS[args.model]()
    model, example = model.cuda(), example.cuda()
    ours = lucid_fx.quantize(model, (example,), [make_batch(s).cuda() for s in range(4)], backend="cuda")
    with torch.no_grad():
        for _ in range(5):
            ours(example)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ours(example)
            torch.cuda.synchronize()
    events = prof.key_averages()
    # Triton launches show as cuLaunchKernelEx; torch's own kernels as cudaLaunchKernel, cuBLAS's as cuLaunchKernel
    launches = sum(e.count for e in events
                   if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    print(f"{args.model}: {launches} kernel launches in one call"
          + (" (torch ops, the fused Triton kernels off)" if args.torch_ops else " (the fused Triton kernels on)"))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
