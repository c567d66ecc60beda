"""Int8 kernel benchmark: lucid_fx::linear (its route here, and the torch._int_mm fallback) against oneDNN's own
qlinear_pointwise on the same weight and fp32.

    python benchmarks/int8_kernels.py [--rounds 5] [--threads 2]

Shapes: linear with K = N = 1024 at M = 1024 and M = 64, a 3x3 convolution of 64 channels
on 1x64x56x56 (ResNet-18's first stage), and the float-to-uint8 boundary (a program's quantize) of
64x1024 and 8x64x56x56 floats against torch's quantize_per_tensor (values per second). Weights are int8 on ``weight_quant_range("cpu")``,
activations uint8 with a zero point of 128, output uint8. The route lucid_fx's linear took is in its label: oneDNN,
or lucid_fx's AMX GEMM (kernels/native_amx.c) where it ran. Each number is the median of
``--rounds`` timed calls (21) after one warm-up call; the linears, medians of rounds of at least 0.2 s of
calls each, every variant in turn within a round (a third as many rounds, at least 5) (which also packs the weight, so packing is
not timed). GOPS counts 2 operations per multiply-accumulate.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

import lucid_fx.kernels as K
from int8_inference import cpu_line, timed
from lucid_fx.kernels import linear_native

ops = torch.ops.lucid_fx


def median_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _int8_weight(shape, qrange) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(qrange[0], qrange[1] + 1, shape, dtype=torch.int8), torch.rand(shape[0]) * 0.01 + 1e-3


def linear_rows(m: int, k: int, n: int, rounds: int) -> List[Tuple[str, float]]:
    qx = torch.randint(0, 256, (m, k), dtype=torch.uint8)
    qw, ws = _int8_weight((n, k), K.weight_quant_range("cpu"))
    bias, x, w = torch.randn(n), torch.randn(m, k), torch.randn(n, k)

    def int8() -> torch.Tensor:
        return ops.linear(qx, 0.02, 128, qw, ws, bias, 0.05, 128, "none", None)

    def fallback() -> torch.Tensor:
        with K.use_onednn(False):
            return int8()

    calls = linear_native.amx_calls()
    int8()
    route = "AMX GEMM" if linear_native.amx_calls() > calls else "oneDNN"
    fns = {f"lucid_fx.linear ({route})": int8, "lucid_fx.linear (_int_mm fallback)": fallback}
    if K.onednn_available():  # the peer: oneDNN's own call on the weight prepacked, the same arguments
        packed, zeros = torch.ops.onednn.qlinear_prepack(qw, [m, k]), torch.zeros(n, dtype=torch.long)
        fns["onednn.qlinear_pointwise"] = lambda: torch.ops.onednn.qlinear_pointwise(
            qx, 0.02, 128, packed, ws, zeros, bias, 0.05, 128, None, "none", [], "")
    fns["fp32 F.linear"] = lambda: F.linear(x, w, bias)
    # in turns within every round (int8_inference.timed): a slow spell of this shared machine hits them all
    seconds = timed({label: (lambda _, fn=fn: fn()) for label, fn in fns.items()}, torch.empty(0), max(rounds // 3, 5))
    return list(seconds.items())


def conv_rows(rounds: int) -> List[Tuple[str, float]]:
    qx = torch.randint(0, 256, (1, 64, 56, 56), dtype=torch.uint8)
    qw, ws = _int8_weight((64, 64, 3, 3), K.weight_quant_range("cpu"))
    x, w = torch.randn(1, 64, 56, 56), torch.randn(64, 64, 3, 3)
    qx_cl, x_cl = (t.contiguous(memory_format=torch.channels_last) for t in (qx, x))

    def int8(q) -> Callable[[], torch.Tensor]:
        return lambda: ops.conv2d(q, 0.02, 128, qw, ws, None, [1, 1], [1, 1], [1, 1], 1, 0.05, 128, "relu", None)

    rows = []
    cases = [
        ("lucid_fx.conv2d (oneDNN, NCHW)", True, qx),
        ("lucid_fx.conv2d (oneDNN, NHWC)", True, qx_cl),
        ("lucid_fx.conv2d (_int_mm fallback)", False, qx),
    ]
    for label, onednn, q in cases:
        with K.use_onednn(onednn):
            rows.append((label, median_seconds(int8(q), rounds)))
    rows.append(("fp32 F.conv2d (NCHW)", median_seconds(lambda: F.conv2d(x, w, None, 1, 1), rounds)))
    rows.append(("fp32 F.conv2d (NHWC)", median_seconds(lambda: F.conv2d(x_cl, w, None, 1, 1), rounds)))
    return rows


def quantize_rows(shape: Tuple[int, ...], rounds: int) -> List[Tuple[str, float]]:
    from lucid_fx.kernels import native

    x = torch.randn(shape)
    with warnings.catch_warnings():  # torch's quint8 tensors are deprecated: the peer's kernel, timed only
        warnings.simplefilter("ignore")
        return [("lucid_fx native quantize", median_seconds(lambda: native.quantize_codes(x, 20.0, 128, 0, 255, torch.uint8), rounds)),
                ("torch.quantize_per_tensor", median_seconds(lambda: torch.quantize_per_tensor(x, 0.05, 128, torch.quint8), rounds))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"torch {torch.__version__}, {args.threads} threads, oneDNN: {K.onednn_available()}, "
          f"weight range {K.weight_quant_range('cpu')}, median of {args.rounds}")
    print(f"{'shape':<22} {'kernel':<36} {'ms':>9} {'GOPS':>8}")
    for m in (1024, 64):
        for label, seconds in linear_rows(m, 1024, 1024, args.rounds):
            gops = 2 * m * 1024 * 1024 / seconds / 1e9
            print(f"{f'linear {m}x1024x1024':<22} {label:<36} {seconds * 1e3:>9.2f} {gops:>8.1f}")
    macs = 56 * 56 * 64 * 64 * 9
    for label, seconds in conv_rows(args.rounds):
        print(f"{'conv 64->64 3x3 56x56':<22} {label:<36} {seconds * 1e3:>9.2f} {2 * macs / seconds / 1e9:>8.1f}")
    for shape in ((64, 1024), (8, 64, 56, 56)):
        values = torch.Size(shape).numel()
        for label, seconds in quantize_rows(shape, args.rounds):
            name = "quantize " + "x".join(map(str, shape))
            print(f"{name:<22} {label:<36} {seconds * 1e3:>9.3f} {values / seconds / 1e9:>8.2f} Gvalues/s")


if __name__ == "__main__":
    main()
