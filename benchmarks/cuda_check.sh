#!/usr/bin/env bash
# The GPU check, in one run, for a machine with a CUDA device and torch already installed (it
# needs no network): the cuda-marked tests and the fused Triton kernels' tests (compiled there, where
# a CPU runs them interpreted), a NaN into the fused quantize (a device-side assert naming the node),
# then benchmarks/cuda_inference.py and a profile of one call with and without the fused kernels.
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
python3 -c "import torch, triton, lucid_fx; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
torch.cuda.is_available(), 'triton', triton.__version__, lucid_fx.__file__)"
timeout 120 python3 -m pytest -q -rs --tb=short --continue-on-collection-errors -m cuda tests 2>&1 \
    | tee "$out/cuda_tests.txt" | tail -60
timeout 60 python3 -m pytest -q -rs --tb=short tests/kernels/test_cuda_fused.py 2>&1 \
    | tee "$out/cuda_fused_tests.txt" | tail -30
timeout 40 python3 benchmarks/cuda_nan_check.py 2>&1 | tee "$out/cuda_nan.txt" | tail -8
timeout 200 python3 benchmarks/cuda_inference.py --rounds 3 2>&1 | tee "$out/cuda_bench.txt"
# Which fused kernel costs EfficientNet-like its time (slower with the operand and global average kernels, 2026-12-04)
for off in operand global_average; do
    timeout 60 python3 benchmarks/cuda_inference.py --rounds 3 --models efficientnet,mobilenet_v3 --off $off 2>&1 \
        | tee "$out/cuda_bench_off_$off.txt" | grep -E "off:|lucid_fx int8"
done
timeout 35 python3 benchmarks/cuda_profile.py --model efficientnet --top 20 2>&1 \
    | tee "$out/cuda_profile_efficientnet.txt"
timeout 35 python3 benchmarks/cuda_profile.py --model mlp_b1 2>&1 | tee "$out/cuda_profile.txt"
timeout 35 python3 benchmarks/cuda_profile.py --model mlp_b1 --torch-ops 2>&1 \
    | tee "$out/cuda_profile_torch_ops.txt"
