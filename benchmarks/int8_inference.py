"""int8 inference benchmark: fp32 eager vs torch.ao FX int8 (x86 and onednn engines) vs PT2E +
inductor vs lucid_fx, plain (``precision="int8"``) and measured (``precision="measured"``: float
where it measured no slower and as accurate; its row appears when it chose a float region, and
its choices are printed above the table rows).

    python benchmarks/int8_inference.py [--rounds 7] [--models mlp_b64,resnet_1x,...] [--no-pt2e] [--no-measured]
                                        [--one-process]

Every figure is a same-run median of ``--rounds`` timed rounds (each round runs each model
enough times to take ~0.2 s, the variants taking turns within the round) after a warm-up. Each model
runs in a process of its own (its variants in the same one), as a user's model would; ``--one-process``
runs them all in this one, where the models measured later ran a few percent slower (the MobileNetV3-like
row first and last: fp32 5.77 and 6.44 ms, PT2E 3.12 and 3.40, lucid_fx 1.84 and 1.91, docs/benchmarks.md).
Speedups are ratios to fp32 eager measured in the same run; the last column is lucid_fx's time
over the fastest peer's (for both lucid_fx rows) (> 1: lucid_fx is faster). SQNR is against the fp32 output on a held-out
batch. Size is the serialized ``state_dict``. The CPU's int8 features head the table.

Peers, never dependencies of lucid_fx: torch.ao (deprecated, still runs on torch 2.13), and PT2E
through torchao's X86InductorQuantizer plus ``torch.compile`` with freezing, which needs
``pip install --no-deps torchao==0.18.0`` in the benchmark's environment (skipped, saying so,
without it).
"""

from __future__ import annotations

import argparse
import copy
import io
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.detach().float(), out.detach().float()
    noise = (ref - out).pow(2).mean().clamp_min(1e-20)
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def size_mb(model: torch.nn.Module) -> float:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 2**20


def timed(fns: dict, x, rounds: int) -> dict:
    """Median seconds per call of each ``fns[name](x)``. The variants take turns within every
    round, so a slow spell of this shared machine hits all of them instead of one."""
    # Each variant gets its own copy of the input: the PT2E + inductor module writes into its input
    # (measured: torch 2.13, torchao 0.18, freezing on), which must not reach the next variant.
    inputs = {name: x.clone() for name in fns}
    with torch.no_grad():
        per_round = {}
        for name, fn in fns.items():
            x = inputs[name]
            fn(x)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.2 or n < 2:
                fn(x)
                n += 1
            per_round[name] = n
        samples = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                x = inputs[name]
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


def pt2e_inductor_int8(model, example, batches):
    """PT2E: torch.export, torchao's X86InductorQuantizer, then inductor with freezing."""
    import torch._inductor.config as inductor_config
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer = xiq.X86InductorQuantizer()
        quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(torch.export.export(copy.deepcopy(model), (example,)).module(), quantizer)
        with torch.no_grad():
            for b in batches:
                prepared(b)
        converted = convert_pt2e(prepared)
        inductor_config.freezing = True
        compiled = torch.compile(converted)
        with torch.no_grad():
            compiled(example)  # compiles here, not in the timed rounds
        return compiled


def cpu_line() -> str:
    """The CPU and its int8 features, printed with every table."""
    from lucid_fx.kernels import cpu_features

    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    from lucid_fx.kernels import bound_ops, native

    flags = cpu_features()
    bound = "on" if bound_ops.available() else bound_ops.status()
    return (f"{name}: int8 kind {flags.name} (VNNI {flags.vnni}, AMX {flags.amx}), "
            f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; native kernels: {native.status()}; "
            f"bound calls (kernels/bound_ops.cpp): {bound}")


def _peers(model, example, batches, pt2e: bool) -> dict:
    peers = {}
    for engine in ("x86", "onednn"):
        try:
            peers[f"torch.ao {engine}"] = torch_ao_int8(model, example, batches, engine)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result, reported as such
            print(f"  torch.ao {engine} failed: {type(exc).__name__}: {str(exc)[:80]}")
    if pt2e:
        try:
            peers["PT2E+inductor"] = pt2e_inductor_int8(model, example, batches)
        except ImportError:
            print("  PT2E+inductor skipped: pip install --no-deps torchao==0.18.0 to measure it")
        except Exception as exc:  # noqa: BLE001
            print(f"  PT2E+inductor failed: {type(exc).__name__}: {str(exc)[:80]}")
    return peers


def print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def model_arguments(doc: str) -> argparse.ArgumentParser:
    """A parser for a benchmark over MODELS: ``--rounds``, ``--models``, ``--calib``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calib", type=int, default=8, help="calibration batches")
    return parser


def main(argv=None) -> list:
    parser = model_arguments(__doc__)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-pt2e", action="store_true", help="leave out PT2E + inductor (compiling is slow)")
    parser.add_argument("--no-measured", action="store_true",
                        help="leave out lucid_fx with precision='measured' (one more quantize per candidate group)")
    parser.add_argument("--one-process", action="store_true", help="every model in this process, one after another")
    parser.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)  # a model's own process
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.no_header:
        print(cpu_line())
        print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} rounds"
              + ("" if args.one_process else ", each model in a process of its own"))
        print_header(f"{'model':<12} {'variant':<16} {'ms':>9} {'speedup':>8} {'SQNR dB':>8} {'MB':>7} {'vs best':>8}")
    names = args.models.split(",")
    if len(names) > 1 and not args.one_process:  # each model in a process of its own, printing its rows
        given = list(argv if argv is not None else sys.argv[1:])
        own = [a for i, a in enumerate(given) if not a.startswith("--models") and (i == 0 or given[i - 1] != "--models")]
        for name in names:
            sys.stdout.flush()
            subprocess.run([sys.executable, __file__, *own, "--models", name, "--no-header"], check=True)
        return []
    rows = []
    for name in names:
        model, example, make_batch = MODELS[name]()
        batches = [make_batch(s) for s in range(args.calib)]
        held_out = make_batch(1000)
        with torch.no_grad():
            reference = model(held_out)
        variants = {"fp32 eager": model, **_peers(model, example, batches, not args.no_pt2e)}
        variants["lucid_fx int8"] = lucid_fx.quantize(model, (example,), batches)
        if not args.no_measured:
            measured = lucid_fx.quantize(model, (example,), batches, precision="measured",
                                         held_out_data=[make_batch(s) for s in (500, 501)])
            print("\n".join("  " + line for line in str(measured.lucid_fx_precision).splitlines()))
            if measured.lucid_fx_precision.float_nodes:  # else the same model as "lucid_fx int8"
                variants["lucid_fx measured"] = measured
        seconds = timed({variant: _engine_set(variant, m) for variant, m in variants.items()}, example, args.rounds)
        base = seconds["fp32 eager"]
        best_peer = min((t for v, t in seconds.items() if v != "fp32 eager" and not v.startswith("lucid_fx")), default=None)
        for variant, m in variants.items():
            with torch.no_grad():
                out = _engine_set(variant, m)(held_out.clone())  # (see timed: PT2E writes into its input)
            versus = best_peer / seconds[variant] if best_peer and variant.startswith("lucid_fx") else None
            row = (name, variant, seconds[variant] * 1e3, base / seconds[variant],
                   sqnr(reference, out) if m is not model else float("inf"), size_mb(m), versus)
            rows.append(row)
            print(f"{row[0]:<12} {row[1]:<16} {row[2]:>9.2f} {row[3]:>7.2f}x {row[4]:>8.1f} {row[5]:>7.1f}"
                  + (f" {versus:>7.2f}x" if versus else ""))
    return rows


if __name__ == "__main__":
    main()
