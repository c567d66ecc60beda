#!/usr/bin/env bash
# The GPU check, in one run, for a machine with a CUDA device and torch already installed (it
# needs no network): the cuda-marked tests, then benchmarks/cuda_inference.py, on this checkout.
# Logs go to $OUT (default /tmp/lucid_fx_cuda).
#     bash benchmarks/cuda_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/lucid_fx_cuda}"
mkdir -p "$out"
# Without an install (that machine may reach no index), lucid_fx.passes is ../passes, as an install lays it out.
if ! python3 -c "import lucid_fx.passes" 2>/dev/null; then
    ln -s ../passes lucid_fx/passes
    trap 'rm -f lucid_fx/passes' EXIT
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # (a script's own folder leads sys.path)
nvidia-smi -L
python3 -c "import torch, lucid_fx; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.is_available(), lucid_fx.__file__)"
timeout 150 python3 -m pytest -m cuda -q -rs --tb=short --continue-on-collection-errors tests 2>&1 | tee "$out/cuda_tests.txt" | tail -60
timeout 180 python3 benchmarks/cuda_inference.py --rounds 5 2>&1 | tee "$out/cuda_bench.txt"
timeout 60 python3 benchmarks/cuda_profile.py --model mlp_b1 2>&1 | tee "$out/cuda_profile.txt"
