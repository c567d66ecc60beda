"""Where a converted model's time goes: inside kernels, or outside them (Python, dispatch, allocation).

    python benchmarks/overhead.py [--models mlp_b1,resnet_1x,...] [--rounds 7] [--threads 1] [--peers x86,onednn]

For each model of ``benchmarks/models.py`` and each variant (fp32 eager, torch.ao FX int8, lucid_fx int8,
and any extra variant a caller passes to :func:`main`), prints:

- ``wall us``: microseconds per call, unprofiled;
- ``kernel us``: time inside kernels per call, from ``torch.profiler``: the self time of every aten,
  oneDNN or quantized op that does work, i.e. not a metadata op (:data:`METADATA_OPS`: views, empty
  tensors, ...), not an op implemented in Python (:data:`PYTHON_NAMESPACES`: ``lucid_fx::*``, whose
  self time is its Python body), and not a wrapper whose self time is under half its total (``aten::to``
  around its copy, ``aten::linear`` around ``addmm``: their own time is dispatch);
- ``outside us``: time outside kernels per call, measured on the profiled calls themselves: their wall
  time, less their kernel time, less what the profiler itself adds (:func:`profiler_costs`, measured each
  round: about 0.4 us a recorded op, 0.5 a recorded native call). Wall and kernel time come from the same
  calls, so a kernel's run-to-run spread (hundreds of us on ResNet-like) cancels out;
- ``ops``: top-level op calls per forward (every dispatcher call the forward makes directly, the
  unit the issue's "overhead per op" counts), and ``kernels``, the ops counted as kernels;
- ``outside/op``: outside time over top-level ops, the figure issue 13 bounds at 5 us.

A oneDNN int8 op builds its primitive on every call, inside the op (measured with
``benchmarks/prototypes/call_cost.py``: 23 us of a 1-row 16x16 ``qlinear_pointwise`` call, 5 us with
``ONEDNN_CACHE_CONTEXT_UNSAFE=1``; 36 us for ``qconv2d_pointwise``): the profiler counts that as kernel
time, so ``outside us`` is the overhead a lowering can remove without touching the op.

Each figure is the median over ``--rounds`` rounds; in every round each variant is timed, then
profiled, the variants taking turns (:func:`measure`).

Until 2026-12-05 ``outside us`` was the unprofiled wall time less the profiled kernel time, two different runs
of the kernels: it moved by 2-3 us an op run to run and read negative on the MLPs, whose native calls were then
recorded by ``torch.profiler.record_function`` (3.5 us of Python inside each event, counted as kernel time).

Where it goes: Python between two kernels runs with its caches cold, the previous kernel having filled them
with its own data. On an AMX Xeon (2 MiB L2 a core) a program's key took 2.7 us timed alone and 7-10 us inside a
call (4.2 since it reads the kind alone); a oneDNN convolution's call spent 14 us between the call and the
op's start (the dispatcher's boxed call, cold: converting its 17 arguments took ~3 us warm) and 5 after it
(profiler timestamps around it) after a 512-channel 3x3 convolution, 3 and 1.3 after a small linear. So the same
code costs 3-5 times its warm time in a model, and cuts come from running less of it between kernels.

Measured here (AMX Xeon, 2 shared cores, torch 2.13.0, 1 thread, 7 rounds, 2026-12-05, this measure; outside us
per top-level op for fp32 eager / torch.ao x86 / lucid_fx): mlp_b1 9.7 / 14.9 / 1.7, mlp_b64 17.9 / 20.7 / 2.5,
resnet_1x 21.1 / 13.9 / 3.1, encoder 19.5 / 15.0 / 4.5, gated_mlp 16.1 / 12.1 / 4.0, mobilenet_v3 8.3 / 8.1 / 1.2,
efficientnet 12.9 / 11.1 / 1.5 (the thirty-fourth session: programs run from C++, passes/run_program_natively.py;
the session before, lucid_fx read 3.1-3.7, 4.2-4.6, 8.2-8.8, 8.7-9.6, 7.8-10.3, 3.0-3.1 and 4.2-4.5, and the one
before that 5.8, 7.4, 16.6, 14.5, 14.0, 5.5 and 9.1); an op's figure moves by up to 1.2 us between runs, the gated
MLP's by up to 2.5. Earlier figures (AMD EPYC, before programs: lucid_fx 24-214 us an op) were taken by the former measure.

Threads default to 1: on a shared 2-core machine, 2 OpenMP threads stall for tens of milliseconds
whenever another process holds a core (measured: batch-1 MLP p90 36 ms at 2 threads, 0.34 ms at 1),
so medians at 2 threads measure the neighbours. The figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_inference import _engine_set, cpu_line, torch_ao_int8  # noqa: E402
from models import MODELS  # noqa: E402

import lucid_fx  # noqa: E402
from lucid_fx.kernels import native  # noqa: E402

# Ops that move no data (their time is bookkeeping, counted outside kernels).
METADATA_OPS = {
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "as_strided", "reshape", "_reshape_alias",
    "expand", "permute", "t", "transpose", "unsqueeze", "squeeze", "detach", "alias", "select", "slice",
    "resolve_conj", "resolve_neg", "lift_fresh", "result_type", "size", "stride", "numel", "item",
    "_local_scalar_dense", "is_nonzero", "flatten", "view_as", "unflatten", "split", "chunk", "unbind",
    "contiguous", "resize_", "set_", "q_scale", "q_zero_point", "dequantize_per_tensor_wrapper",
}
# Op namespaces whose kernels are Python functions: their self time is interpreter time.
PYTHON_NAMESPACES = ("lucid_fx::",)
MODEL_ORDER = "mlp_b1,mlp_b64,resnet_1x,encoder,gated_mlp,mobilenet_v3,efficientnet"


def _is_kernel(event) -> bool:
    name = event.name
    if "::" not in name or name.startswith(PYTHON_NAMESPACES):
        return False
    if name.split("::", 1)[1] in METADATA_OPS:
        return False
    # A wrapper (aten::to around _to_copy and copy_, aten::linear around addmm) spends its own
    # time dispatching; a kernel with helper children (onednn::qlinear_pointwise allocating its
    # output) spends most of it computing.
    return not event.cpu_children or event.self_cpu_time_total >= 0.5 * event.cpu_time_total


@contextlib.contextmanager
def _quiet_stderr():
    """torch 2.13's profiler prints two "USDT: profiler_start/stop" lines to fd 2 per session."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_split(fn: Callable, x, calls: int) -> Dict[str, float]:
    """Per call: ``profiled_us`` (wall time of the profiled calls), ``kernel_us`` (self time of kernel ops),
    ``ops`` (top-level op calls), ``kernels``, and ``events``/``native_events`` (what the profiler recorded).
    lucid_fx's native C kernels are recorded as ``native::<kernel>`` events while profiling (a ctypes call is no
    torch op), so their work counts as kernel time and each call as an op."""
    native.record_in_profiler(True)
    try:
        with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(calls):
                fn(x)
            profiled_us = (time.perf_counter() - start) * 1e6
    finally:
        native.record_in_profiler(False)
    every = prof.events()
    events = [e for e in every if "::" in e.name]
    kernel_us = sum(e.self_cpu_time_total for e in events if _is_kernel(e))
    top = sum(1 for e in events if e.cpu_parent is None)
    natives = sum(1 for e in events if e.name.startswith("native::"))
    return {"profiled_us": profiled_us / calls, "kernel_us": kernel_us / calls, "ops": top / calls,
            "kernels": sum(map(_is_kernel, events)) / calls, "events": (len(every) - natives) / calls,
            "native_events": natives / calls}


_PROBE = torch.ones(8)


def _probe_op() -> None:
    torch.ops.aten.neg.default(_PROBE)


def _probe_native() -> None:
    with native._event("native::probe"):
        pass


def profiler_costs(calls: int = 2000) -> Dict[str, float]:
    """What the profiler adds to a profiled call's time outside kernels, in us: per recorded op (``op``: a cheap
    op's profiled less its unprofiled wall time) and per recorded native call (``native``: the event's wall time
    less its self time, which counts as kernel time; its unprofiled call has no event at all)."""
    def wall(fn: Callable) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) * 1e6 / calls

    plain = wall(_probe_op)
    with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        op, recorded = wall(_probe_op), wall(_probe_native)
    inside = sum(e.self_cpu_time_total for e in prof.events() if e.name == "native::probe") / calls
    return {"op": max(op - plain, 0.0), "native": max(recorded - inside, 0.0)}


def outside_us(split: Dict[str, float], costs: Dict[str, float]) -> float:
    """Microseconds a call spends outside kernels: profiled wall less kernel time less the profiler's own cost."""
    profiler = split["events"] * costs["op"] + split["native_events"] * costs["native"]
    return split["profiled_us"] - split["kernel_us"] - profiler


def measure(variants: Dict[str, Callable], x, rounds: int, profiled_calls: int) -> Dict[str, Dict[str, float]]:
    """Median over rounds of wall us per call (unprofiled) and of the profiled split, per variant.

    Every round measures the profiler's costs, then times each variant and profiles it, the variants taking
    turns, so a slow spell of the shared machine lands on all variants alike."""
    with torch.no_grad():
        calls = {}
        for name, fn in variants.items():
            fn(x)
            start, n = time.perf_counter(), 0
            while time.perf_counter() - start < 0.1 or n < 3:
                fn(x)
                n += 1
            calls[name] = n
        samples = {name: [] for name in variants}
        for _ in range(rounds):
            costs = profiler_costs()
            for name, fn in variants.items():
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fn(x)
                wall_us = (time.perf_counter() - start) / calls[name] * 1e6
                split = profile_split(fn, x, min(profiled_calls, calls[name]))
                samples[name].append({"wall_us": wall_us, **split, "outside_us": outside_us(split, costs)})
    return {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for name, runs in samples.items()}


def variants_for(name: str, peers, calib: int) -> tuple:
    """(variants, example): fp32 eager, torch.ao FX per engine in ``peers``, lucid_fx int8."""
    model, example, make_batch = MODELS[name]()
    batches = [make_batch(s) for s in range(calib)]
    variants: Dict[str, Callable] = {"fp32 eager": model}
    for engine in peers:
        try:
            variants[f"torch.ao {engine}"] = _engine_set(f"torch.ao {engine}",
                                                         torch_ao_int8(model, example, batches, engine))
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result, reported as such
            print(f"  torch.ao {engine} failed: {type(exc).__name__}: {str(exc)[:80]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants["lucid_fx int8"] = lucid_fx.quantize(model, (example,), batches)
    return variants, example, model, batches


def main(argv=None, extra: Optional[Callable] = None) -> list:
    """Print the table; ``extra(name, model, example, batches, variants)`` may add variants per model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODEL_ORDER)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calib", type=int, default=4, help="calibration batches")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--peers", default="x86", help="torch.ao engines to compare, comma-separated")
    parser.add_argument("--profiled-calls", type=int, default=10, help="profiled calls per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    costs = profiler_costs()
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.rounds} interleaved rounds; the "
          f"profiler's own cost, taken off each round: {costs['op']:.2f} us a recorded op, {costs['native']:.2f} a "
          "native call")
    header = (f"{'model':<13} {'variant':<22} {'wall us':>9} {'kernel us':>9} {'outside us':>10} {'ops':>5} "
              f"{'kernels':>7} {'outside/op':>10}")
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.models.split(","):
        variants, example, model, batches = variants_for(name, [p for p in args.peers.split(",") if p], args.calib)
        if extra is not None:
            extra(name, model, example, batches, variants)
        figures = measure(variants, example, args.rounds, args.profiled_calls)
        for variant, split in figures.items():
            wall_us, outside = split["wall_us"], split["outside_us"]
            row = (name, variant, wall_us, split["kernel_us"], outside, split["ops"], split["kernels"],
                   outside / max(split["ops"], 1))
            rows.append(row)
            print(f"{row[0]:<13} {row[1]:<22} {row[2]:>9.0f} {row[3]:>9.0f} {row[4]:>10.0f} {row[5]:>5.0f} "
                  f"{row[6]:>7.0f} {row[7]:>10.1f}")
        sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
