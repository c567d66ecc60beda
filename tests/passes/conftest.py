import os

import pytest

import lucid_fx


@pytest.fixture
def registry():
    """A private copy of the rule tables, so no test leaks registrations into another."""
    with lucid_fx.registry_scope() as reg:
        yield reg


@pytest.fixture
def native_here():
    """lucid_fx's native kernels built here (programs plan their calls); skips where they are off or missing, but
    under LUCID_FX_REQUIRE_TOOLS=1."""
    from lucid_fx.kernels import native

    if os.environ.get("LUCID_FX_NATIVE") == "0":  # (test_every_cpu_kind's AVX2 rerun): nothing to plan
        pytest.skip("native kernels off (LUCID_FX_NATIVE=0); test_without_the_native_kernels_nothing_is_planned runs")
    if not native.available():
        if os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
            pytest.fail(f"LUCID_FX_REQUIRE_TOOLS=1 but the native kernels did not build: {native.status()}")
        pytest.skip(f"native kernels: {native.status()}")
