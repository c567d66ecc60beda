"""Prepare-time benchmark: lucid_fx.prepare vs torch.ao's prepare_fx (the oracle, deprecated but
still working), same process, same models, same example inputs.

    python benchmarks/prepare_time.py [--rounds 5]

Models: a 200-layer MLP (nn.Sequential of 100 x (Linear(64, 64), ReLU)) and a ResNet-18-like CNN
in plain torch (BasicBlock conv-bn-relu-conv-bn + residual add + relu, [2, 2, 2, 2] stages,
64..512 channels, input 1x3x64x64). torch.ao uses its default x86 mapping (HistogramObserver on
activations, per-channel weights); lucid_fx its default mapping (also HistogramObserver).

Each measurement is the median of ``--rounds`` timed calls after one warm-up call. The model is
deep-copied outside the timer for both sides (lucid_fx is called with ``inplace=True``), so the
copy is not part of either number. A second table checks that lucid_fx's prepare time grows
linearly with the number of nodes (MLPs of 50..400 layers). Runs single-threaded for stable numbers.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import fx, nn

import lucid_fx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import ResNetLike  # noqa: E402  (the same model the inference benchmark uses)


def mlp(layers: int) -> nn.Module:
    """``layers`` modules: layers/2 x (Linear(64, 64), ReLU)."""
    blocks = []
    for _ in range(layers // 2):
        blocks += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*blocks).eval()


def _torch_ao():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import prepare_fx
    return get_default_qconfig_mapping, prepare_fx


def time_ms(fn, model: nn.Module, rounds: int) -> float:
    """Median wall time of ``fn(copy)`` in milliseconds, after one warm-up call."""
    fn(copy.deepcopy(model))
    times = []
    for _ in range(rounds):
        work = copy.deepcopy(model)
        start = time.perf_counter()
        fn(work)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    get_default_qconfig_mapping, prepare_fx = _torch_ao()

    def lucid(example_inputs):
        return lambda m: lucid_fx.prepare(m, example_inputs=example_inputs, inplace=True)

    def torch_ao(example_inputs):
        def run(m):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return prepare_fx(m, get_default_qconfig_mapping("x86"), example_inputs)

        return run

    models = [
        ("MLP 200 layers", mlp(200), (torch.randn(8, 64),)),
        ("ResNet-18-like 64x64", ResNetLike(num_classes=10).eval(), (torch.randn(1, 3, 64, 64),)),
    ]
    print(f"prepare time, median of {args.rounds} rounds after a warm-up (torch {torch.__version__}, 1 thread)\n")
    header = f"{'model':<22} {'nodes':>6} {'lucid_fx ms':>12} {'torch.ao ms':>12} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    for name, model, example_inputs in models:
        nodes = len(fx.symbolic_trace(copy.deepcopy(model)).graph.nodes)
        ours = time_ms(lucid(example_inputs), model, args.rounds)
        theirs = time_ms(torch_ao(example_inputs), model, args.rounds)
        print(f"{name:<22} {nodes:>6} {ours:>12.1f} {theirs:>12.1f} {ours / theirs:>7.2f}")
    print("\nratio = lucid_fx / torch.ao (below 1: lucid_fx is faster)\n")

    header = f"{'lucid_fx MLP layers':<20} {'nodes':>6} {'ms':>9} {'ms/node':>9}"
    print(header)
    print("-" * len(header))
    per_node = []
    for layers in (50, 100, 200, 400):
        model = mlp(layers)
        nodes = len(fx.symbolic_trace(copy.deepcopy(model)).graph.nodes)
        ms = time_ms(lucid((torch.randn(8, 64),)), model, args.rounds)
        per_node.append(ms / nodes)
        print(f"{layers:<20} {nodes:>6} {ms:>9.1f} {ms / nodes:>9.3f}")
    print(f"\nms/node at 400 layers / at 50 layers: {per_node[-1] / per_node[0]:.2f} (about 1 means linear)")


if __name__ == "__main__":
    main()
