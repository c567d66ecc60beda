import sys
from pathlib import Path

import pytest
import torch

# The benchmark models double as end-to-end test models.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    reference, test = reference.detach().float(), test.detach().float()
    noise = (reference - test).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


@pytest.fixture
def sqnr_db():
    return sqnr



@pytest.fixture
def bound_ops_on(monkeypatch):
    """lucid_fx's bound operator calls (lucid_fx/kernels/bound_ops.py) built and on for the test, whatever
    LUCID_FX_BOUND_OPS the run was started with (the no-compiler rerun of tests/test_every_cpu_kind.py turns them
    off); as the process had them afterwards. Skips without a C++ compiler, except under LUCID_FX_REQUIRE_TOOLS=1."""
    import os

    from lucid_fx.kernels import bound_ops

    monkeypatch.delenv("LUCID_FX_BOUND_OPS", raising=False)
    bound_ops._module.cache_clear()
    try:
        if not bound_ops.available():
            if os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
                pytest.fail(f"LUCID_FX_REQUIRE_TOOLS=1 but the bound calls did not build: {bound_ops.status()}")
            pytest.skip(f"bound calls: {bound_ops.status()}")
        yield bound_ops
    finally:
        monkeypatch.undo()
        bound_ops._module.cache_clear()
