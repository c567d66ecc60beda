"""benchmarks/overhead.py's measure of time outside kernels: Python between kernels counts, the profiler does not."""

import time

import pytest
import torch

import overhead
from lucid_fx.kernels import native

SPIN_US = 40.0


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def test_python_between_kernels_is_outside_and_the_profilers_own_cost_is_not():
    if not native.available():
        pytest.skip("the native kernels are not built here (no C compiler): their profiler events are what is tested")
    a = torch.randn(128, 128)

    def kernels(x):  # two torch kernels and a native one
        return native.quantize_codes(torch.mm(torch.mm(x, a), a), 4.0, 0, -128, 127, torch.int8)

    def kernels_and_python(x):
        y = torch.mm(x, a)
        _spin(SPIN_US)
        return native.quantize_codes(torch.mm(y, a), 4.0, 0, -128, 127, torch.int8)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = overhead.measure({"kernels": kernels, "python": kernels_and_python}, a, rounds=5, profiled_calls=20)
    finally:
        torch.set_num_threads(threads)
    plain, spun = figures["kernels"], figures["python"]
    assert plain["ops"] == spun["ops"] and plain["native_events"] == spun["native_events"] == 1
    # the spin is wall time outside any op: all of it is outside, and nothing else changed
    assert 0.8 * SPIN_US <= spun["outside_us"] - plain["outside_us"] <= SPIN_US + 20, figures
    # the profiler's cost is not over-subtracted (its size varies with the process: 13-24 us for these five ops
    # alone or after the rest of the suite; tests/kernels/test_native.py bounds what a native event holds)
    assert 0 <= plain["outside_us"] and plain["kernel_us"] <= plain["profiled_us"], figures


def test_the_profilers_costs_are_small_and_a_native_event_costs_something():
    costs = overhead.profiler_costs(calls=500)
    assert costs["op"] < 5 and 0 < costs["native"] < 5, costs  # (the measured costs are clamped at 0 from below)


def test_outside_takes_the_profilers_costs_off_per_event():
    split = {"profiled_us": 100.0, "kernel_us": 60.0, "events": 10.0, "native_events": 4.0}
    assert overhead.outside_us(split, {"op": 0.5, "native": 1.0}) == pytest.approx(100 - 60 - 5 - 4)
