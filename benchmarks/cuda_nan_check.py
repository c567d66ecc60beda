"""A NaN entering the int8 grid on a GPU: the quantize kernel refuses it without a host sync, as a
device-side assert whose message names the value (it ends the process's CUDA context, so this runs
alone, not in the test suite).

    python benchmarks/cuda_nan_check.py
"""

import torch

import lucid_fx.kernels  # noqa: F401  (registers the ops)
from lucid_fx.kernels import cuda_fused


def main() -> None:
    x = torch.randn(1000, device="cuda")
    x[7] = float("nan")
    print("fused Triton quantize:", cuda_fused.available(x, "quantize"))
    try:
        torch.ops.lucid_fx.quantize_per_tensor(x, 0.1, 128, 0, 255, torch.uint8)
        torch.cuda.synchronize()
        print("NaN NOT REFUSED")
    except RuntimeError as exc:
        print("NaN refused:", str(exc)[:300])


if __name__ == "__main__":
    main()
