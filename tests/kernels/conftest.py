"""Fixtures of the kernel tests: the native kernels (lucid_fx/kernels/native.py) on or off for one
test, whatever LUCID_FX_NATIVE the run was started with. Without a C compiler the tests that need
them skip, saying why, except under LUCID_FX_REQUIRE_TOOLS=1 (.ci/run), where that fails."""

import os

import pytest

from lucid_fx.kernels import native


# One load per configuration in a test session (some hundred tests ask; a build not in the cache
# takes seconds, lucid_fx/kernels/native_build.py).
_BUILDS = {}


@pytest.fixture
def native_env(monkeypatch):
    """Set LUCID_FX_* variables and load the native kernels as a process started with them would
    (what ``native._library`` returns), leaving the process's own load as it was afterwards."""
    library = native._library  # the process's own, whatever a first load in this test patches in

    def load(**env):
        monkeypatch.delenv("LUCID_FX_NATIVE", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        names = ("LUCID_FX_NATIVE", "LUCID_FX_CC", "CC", "LUCID_FX_NATIVE_CACHE", "LUCID_FX_CACHE_DIR")
        key = tuple(os.environ.get(name) for name in names) + (native.FLAGS,)
        if key not in _BUILDS:
            _BUILDS[key] = library.__wrapped__()  # the load itself, past its once-per-process cache
        monkeypatch.setattr(native, "_library", lambda: _BUILDS[key])
    yield load


def _require_native() -> None:
    if not native.available():
        if os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1":
            pytest.fail(f"LUCID_FX_REQUIRE_TOOLS=1 but the native kernels did not build: {native.status()}")
        pytest.skip(f"native kernels: {native.status()}")


@pytest.fixture
def native_on(native_env):
    """The native kernels compiled here."""
    native_env()
    _require_native()


@pytest.fixture
def amx(native_on):
    """lucid_fx's AMX tiles on for the test (linear_native.use_amx), as they were afterwards; skips where this build
    has none."""
    from lucid_fx.kernels import linear_native
    from lucid_fx.kernels.cpu_features import detected_cpu_features

    was = linear_native.amx()
    if not linear_native.use_amx(True):
        pytest.skip(f"needs a CPU with AMX-INT8 and the tiles granted by Linux (this one: {detected_cpu_features().name})")
    yield
    linear_native.use_amx(was)


@pytest.fixture(params=["native", "torch"])
def native_or_torch(request, native_env):
    """Run the test twice: with the native kernels, and with the torch kernels they replace."""
    native_env(LUCID_FX_NATIVE="1" if request.param == "native" else "0")
    if request.param == "native":
        _require_native()
    return request.param


@pytest.fixture
def native_build(native_env, monkeypatch):
    """Load the native kernels as one build: "this CPU" (-march=native: the vector paths this CPU has),
    "no VNNI" (the same without VNNI's instructions: the AVX2 steps a CPU without VNNI runs, on any
    CPU that has AVX2), "no AVX-512" (the same without any AVX-512 instruction: an AVX2 CPU's paths)
    or "portable" (no -march: the plain C loops alone, as on a CPU without them); "no OpenMP" (this CPU's
    build without -fopenmp: the GEMM's columns on one thread)."""
    def load(build: str) -> None:
        if build == "portable":
            monkeypatch.setattr(native, "FLAGS", native.FLAGS[1:])
        elif build == "no OpenMP":  # a compiler without it: the GEMM on one thread
            monkeypatch.setattr(native, "FLAGS", tuple(tuple(f for f in s if f != "-fopenmp") for s in native.FLAGS))
        elif build in ("no VNNI", "no AVX-512"):
            off = ("-mno-avx512vnni", "-mno-avxvnni") if build == "no VNNI" else ("-mno-avx512f", "-mno-avxvnni")
            monkeypatch.setattr(native, "FLAGS", (native.FLAGS[0] + off, *native.FLAGS[1:]))
        native_env()
        _require_native()
    return load


@pytest.fixture
def forbid_route(monkeypatch):
    """``forbid_route(module, name)``: a call of ``module.name`` fails the test, so what passes ran the
    native kernel that replaces that torch route."""
    def forbid(module, name: str) -> None:
        def route(*args, **kwargs):
            raise AssertionError(f"the torch route {name} ran")
        monkeypatch.setattr(module, name, route)
    return forbid

