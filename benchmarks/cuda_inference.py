"""CUDA int8 inference benchmark: fp32 and bf16 eager vs lucid_fx ``backend="cuda"`` on a GPU.

    python benchmarks/cuda_inference.py [--rounds 7] [--models mlp_b64,resnet_1x,...]

The models are int8_inference.py's (benchmarks/models.py). Each call is followed by
``torch.cuda.synchronize()``, so a figure is what a caller waits for, launches included; every
figure is a same-run median of ``--rounds`` rounds with the variants taking turns (int8_inference's
``timed``). "fp32 graph" replays the float model from one CUDA graph captured on the example (one
launch per call); "lucid_fx int8" is the converted model as it runs, replaying its own CUDA graph
per input signature (lucid_fx/cuda_graph.py), "lucid_fx launches" the same model with
``CUDA_GRAPHS`` off, its kernels launched one at a time, and "lucid_fx torch ops" a second
conversion replaying its CUDA graph with the fused Triton kernels off (``cuda_fused.FUSED``), each
GEMM's epilogue and each quantization as torch ops: what the fusion gains. Speedups are ratios to fp32 eager in the
same run; "vs float" is the fastest float variant's time over lucid_fx's (> 1: lucid_fx is
faster). SQNR is against the fp32 output on a held-out batch.

torch.ao's quantized engines have no CUDA int8 path, so the peers here are the float ones. The
CUDA kernels (lucid_fx/kernels/cuda.py) are ``torch._int_mm`` GEMMs, each with one fused Triton
epilogue (lucid_fx/kernels/cuda_fused.py) where Triton is installed; the other ops run as torch ops.
"""

from __future__ import annotations

import copy
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_inference import model_arguments, print_header, size_mb, sqnr, timed  # noqa: E402
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402
import lucid_fx.cuda_graph as cuda_graph  # noqa: E402
from lucid_fx.kernels import cuda_fused  # noqa: E402


def synchronized(fn, dtype=None):
    """``fn`` as a caller waits for it: the input cast to ``dtype`` if given, the GPU synchronized."""
    def call(x):
        out = fn(x if dtype is None else x.to(dtype))
        torch.cuda.synchronize()
        return out.float()
    return call


def graphed(model, example):
    """Float ``model`` replayed from one CUDA graph captured on ``example`` (one launch for the whole
    call), synchronized like the rest; None, with the reason printed, where capture fails."""
    static_x = example.clone()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for _ in range(3):  # warm-up off the default stream, as capture wants
                model(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_y = model(static_x)
    except Exception as exc:  # noqa: BLE001 (a kernel that synchronizes cannot be captured: say which)
        print(f"  CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None

    def call(x):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        return static_y.float()
    return call


def switched_off(model, module, flag: str):
    """``model`` with ``module.flag`` False during each call: ``(cuda_graph, "CUDA_GRAPHS")`` launches every
    kernel one at a time; ``(cuda_fused, "FUSED")`` runs the CUDA kernels' steps as torch ops instead of the
    fused Triton kernels (the model's CUDA graph is then captured that way on its first call)."""
    def call(x):
        setattr(module, flag, False)
        try:
            return model(x)
        finally:
            setattr(module, flag, True)
    return call


def gpu_line() -> str:
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, fused Triton kernels: "
            f"{cuda_fused.available(torch.empty(0, device='cuda'), 'epilogue')}")


def _model_rows(name: str, args) -> list:
    model, example, make_batch = MODELS[name]()
    model, example = model.cuda(), example.cuda()
    batches = [make_batch(s).cuda() for s in range(args.calib)]
    held_out = make_batch(1000).cuda()
    with torch.no_grad():
        reference = model(held_out)
    ours = lucid_fx.quantize(model, (example,), batches, backend="cuda")
    report = ours.lucid_fx_convert_report
    fns = {"fp32 eager": synchronized(model),
           "bf16 eager": synchronized(copy.deepcopy(model).to(torch.bfloat16), torch.bfloat16)}
    sizes = {"fp32 eager": size_mb(model), "bf16 eager": size_mb(model) / 2}
    fp32_graph = graphed(model, example)
    if fp32_graph is not None:
        fns["fp32 graph"], sizes["fp32 graph"] = fp32_graph, sizes["fp32 eager"]
    fns["lucid_fx int8"] = synchronized(ours)
    fns["lucid_fx launches"] = synchronized(switched_off(ours, cuda_graph, "CUDA_GRAPHS"))
    plain = lucid_fx.quantize(model, (example,), batches, backend="cuda")
    fns["lucid_fx torch ops"] = synchronized(switched_off(plain, cuda_fused, "FUSED"))
    sizes["lucid_fx int8"] = sizes["lucid_fx launches"] = sizes["lucid_fx torch ops"] = size_mb(ours)
    seconds = timed(fns, example, args.rounds)
    rows = []
    for variant, fn in fns.items():
        with torch.no_grad():
            out = fn(held_out)
        best_float = min(t for v, t in seconds.items() if not v.startswith("lucid_fx"))
        versus = best_float / seconds[variant] if variant.startswith("lucid_fx") else None
        share = f"  {report.int8_flop_share or 0:.1%} ({report.backend}: {len(report.float_ops)} float ops)" if versus else ""
        row = (name, variant, seconds[variant] * 1e3, seconds["fp32 eager"] / seconds[variant],
               sqnr(reference, out), sizes[variant], versus)
        rows.append(row)
        print(f"{row[0]:<12} {row[1]:<18} {row[2]:>8.3f} {row[3]:>7.2f}x {row[4]:>8.1f} {row[5]:>6.1f}"
              + (f" {versus:>7.2f}x" if versus else "") + share)
    return rows


def main(argv=None) -> list:
    parser = model_arguments(__doc__)
    parser.add_argument("--off", default="", help=f"fused kernels to run as torch ops, comma-separated: "
                                                    f"{', '.join(cuda_fused.KERNELS)} (to tell what each gains)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_inference.py needs a CUDA device (torch.cuda.is_available() is False)")
    cuda_fused.OFF = {name for name in args.off.split(",") if name}
    unknown = cuda_fused.OFF - set(cuda_fused.KERNELS)
    if unknown:
        raise SystemExit(f"--off: no fused kernel {sorted(unknown)}; they are {', '.join(cuda_fused.KERNELS)}")
    print(gpu_line() + (f"; off: {', '.join(sorted(cuda_fused.OFF))}" if cuda_fused.OFF else ""))
    print(f"medians of {args.rounds} rounds, each call synchronized")
    print_header(f"{'model':<12} {'variant':<18} {'ms':>8} {'speedup':>8} {'SQNR dB':>8} {'MB':>6} {'vs float':>8}  int8 share")
    rows = []
    for name in args.models.split(","):
        try:
            rows += _model_rows(name, args)
        except Exception:  # noqa: BLE001 (the table goes on; the failure is the row, its traceback on stderr)
            print(f"{name:<12} failed: {traceback.format_exc().strip().splitlines()[-1][:300]}")
            traceback.print_exc()
    return rows


if __name__ == "__main__":
    main()
