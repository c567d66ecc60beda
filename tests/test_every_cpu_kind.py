"""The suite again as on each other kind of CPU, so a green run on one machine means green on all
(all of it but ``NO_CPU_KIND`` and the tests marked ``same_on_every_cpu``: what no kind changes).

Each run forces the kind (``LUCID_FX_CPU_ISA``: weight grids and kernel choices) and, where the
kind is below this CPU, caps oneDNN at it (``ONEDNN_MAX_CPU_ISA``), so oneDNN really runs that
kind's kernels: on an AVX512-VNNI machine the AVX2 run meets oneDNN's saturating int16 pair sums
for real. A kind above this CPU (AMX on a VNNI machine) forces the choices only; kernels that the
machine lacks are never called.

The first of these runs (the poorest kind but this one) also turns the native kernels and the bound
operator calls off (``LUCID_FX_NATIVE=0``, ``LUCID_FX_BOUND_OPS=0``), as on a machine without a C or C++
compiler, so the torch kernels and ``torch.ops`` calls they replace pass the whole suite too, on every machine.

The runs go side by side, one torch thread each (the first test starts them all, each waits for
its own): this process only waits meanwhile, so on CI's two cores the reruns take the time of one,
and they cover the one-thread decisions (``linear_row.small_gemm``) the main run at its default
threads does not.
"""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lucid_fx.kernels.cpu_features import CPU_KINDS, detected_cpu_features

ROOT = Path(__file__).resolve().parents[1]
ONEDNN_CAP = {"avx2": "AVX2", "avx512_vnni": "AVX512_CORE_VNNI"}
ORDER = list(CPU_KINDS)  # poorest first
OTHER_KINDS = [kind for kind in CPU_KINDS if kind != detected_cpu_features().name]


# What no CPU kind changes, run once, by the main run (CI's budget): whole files here, drawing (the
# viewer, graph layout, the progress bar), packaging, a fresh install, observers synced across
# processes, the CUDA backend's Triton kernels in Triton's interpreter (~30 s), and this file
# (~120 s of CPU a rerun); single tests marked ``same_on_every_cpu`` (the installed CLI's entry
# points, ~17 s).
NO_CPU_KIND = ("tests/viewer", "tests/test_layout.py", "tests/test_progress.py", "tests/test_packaging.py",
               "tests/test_fresh_install.py", "tests/test_distributed.py", "tests/kernels/test_cuda_fused.py",
               "tests/test_every_cpu_kind.py")

_RUNS: dict = {}  # kind -> (process, its stdout file, its stderr file)


def _start(kind: str):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    env["LUCID_FX_CPU_ISA"] = kind
    if ORDER.index(kind) < ORDER.index(detected_cpu_features().name):
        env["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP[kind]
    if kind == OTHER_KINDS[0]:
        env["LUCID_FX_NATIVE"] = env["LUCID_FX_BOUND_OPS"] = "0"  # no C or C++ compiler: torch's kernels, torch.ops calls
    # One thread each: side by side, torch's default threads oversubscribe the cores (tests/kernels,
    # measured on 2 cores: two runs 100 s at default threads, 46 s at one each, against 44 s for one).
    env["OMP_NUM_THREADS"] = "1"
    ignored = [f"--ignore={path}" for path in NO_CPU_KIND]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ignored, "-m", "not same_on_every_cpu", "tests"]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # files, not pipes: none fills up
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err, text=True), out, err


@pytest.fixture(scope="module")
def reruns(request):
    """Start the reruns of every kind this session selected, at once; kill any left running at the end."""
    for item in request.session.items:
        kind = getattr(item, "callspec", None) and item.callspec.params.get("kind")
        if item.originalname == "test_suite_passes_as_on_another_cpu" and kind not in _RUNS:
            _RUNS[kind] = _start(kind)
    yield _RUNS
    for process, *files in _RUNS.values():
        if process.poll() is None:
            process.kill()
            process.wait()
        for file in files:
            file.close()  # (left open: a ResourceWarning at exit)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_suite_passes_as_on_another_cpu(kind, reruns):
    process, out, err = reruns[kind]
    try:
        returncode = process.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    tail = "\n".join(stdout.splitlines()[-40:])
    summary = stdout.strip().splitlines()[-1] if stdout.strip() else stderr[-2000:]
    assert returncode == 0, f"the suite as on a {kind} CPU: {summary}\n{tail}"
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # "2 xfailed" is an expected failure, not a failed test
    assert passed > 1000 and not re.search(r"\d+ (failed|errors?)\b", summary), summary
