import sys
from pathlib import Path

import pytest
import torch

# The benchmark models double as end-to-end test models.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _reruns(items):
    """The test module that reruns the suite as on other CPU kinds, if these items hold its tests."""
    return next((item.module for item in items if hasattr(getattr(item, "module", None), "start_reruns")), None)


def pytest_collection_modifyitems(session, config, items):
    """tests/test_every_cpu_kind.py's tests only wait for their reruns: they go last."""
    module = _reruns(items)
    if module is not None:
        items[:] = sorted(items, key=lambda item: getattr(item, "module", None) is module)  # stable: the rest keep their order


def pytest_collection_finish(session):
    """The reruns start as soon as the session knows it will wait for them, beside the main run."""
    module = _reruns(session.items)
    if module is not None and not session.config.option.collectonly:
        module.start_reruns(session.items)


def pytest_sessionfinish(session, exitstatus):
    module = _reruns(getattr(session, "items", []))
    if module is not None:
        module.stop_reruns()


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    reference, test = reference.detach().float(), test.detach().float()
    noise = (reference - test).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


@pytest.fixture
def sqnr_db():
    return sqnr

