"""The CPU's int8 features, detected once, and a way to force another CPU's in tests.

Which int8 kernel path is correct and fastest depends on the CPU: without VNNI, oneDNN's u8 x s8
kernels add pairs of products in int16 with saturation, so weights must stay on ``[-64, 63]``;
with AVX512-VNNI (or AVX-VNNI) the full ``[-128, 127]`` grid is exact; AMX adds tile kernels. Code
that picks a path asks :func:`cpu_features` (the forced features if any, else the detected ones);
code that guards correctness asks :func:`detected_cpu_features`, so forcing a richer CPU than the
machine has changes the grid and the path choice but never feeds oneDNN a weight it would
saturate on.

Forcing (``force_cpu_features("avx2")``, or ``LUCID_FX_CPU_ISA=avx2`` in the environment) is how
the suite runs every path on every machine.

>>> with force_cpu_features("avx2"):
...     cpu_features().name, cpu_features().vnni
('avx2', False)
>>> with force_cpu_features("amx"):
...     cpu_features().vnni, cpu_features().amx
(True, True)
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

__all__ = ["CpuFeatures", "CPU_KINDS", "cpu_features", "cpu_kind_name", "detected_cpu_features", "force_cpu_features"]

ENV_VAR = "LUCID_FX_CPU_ISA"


@dataclass(frozen=True)
class CpuFeatures:
    """The int8-relevant features of a CPU: VNNI (exact full-grid u8 x s8 products) and AMX tiles."""

    name: str
    vnni: bool
    amx: bool


#: The kinds of CPU whose int8 paths differ, by name.
CPU_KINDS = {
    "avx2": CpuFeatures("avx2", vnni=False, amx=False),
    "avx512_vnni": CpuFeatures("avx512_vnni", vnni=True, amx=False),
    "amx": CpuFeatures("amx", vnni=True, amx=True),
}
_forced: list = []


def _probe(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)  # private torch helpers; absent means "assume not"
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


def _onednn_isa_cap() -> CpuFeatures:
    """What oneDNN may use under ``ONEDNN_MAX_CPU_ISA`` (read by oneDNN at its first call): capped
    at ``AVX2`` on a VNNI machine, oneDNN really runs its saturating AVX2 kernels (measured: 255 x 127
    summed over 64 inputs gave 1048544 instead of 2072640), which is how a test runs that path here."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if not cap or cap in ("ALL", "DEFAULT") or "AMX" in cap:
        return CPU_KINDS["amx"]
    if "VNNI" in cap or "BF16" in cap or "FP16" in cap or "AVX10" in cap:
        return CPU_KINDS["avx512_vnni"]
    return CPU_KINDS["avx2"]


@functools.lru_cache(maxsize=None)
def detected_cpu_features() -> CpuFeatures:
    """What oneDNN really runs on here (asked once): the CPU's features within ``ONEDNN_MAX_CPU_ISA``."""
    cap = _onednn_isa_cap()
    vnni = _probe("_is_vnni_supported") and cap.vnni
    amx = vnni and _probe("_is_amx_tile_supported") and cap.amx
    return CPU_KINDS["amx" if amx else "avx512_vnni" if vnni else "avx2"]


def _kind(name: str) -> CpuFeatures:
    if name not in CPU_KINDS:
        raise ValueError(f"unknown CPU kind {name!r}; valid: {', '.join(CPU_KINDS)}")
    return CPU_KINDS[name]


@functools.lru_cache(maxsize=None)
def _from_environment(value: Optional[str]) -> Optional[CpuFeatures]:
    return _kind(value) if value else None


def cpu_features() -> CpuFeatures:
    """The features kernels choose their path by: forced (innermost :func:`force_cpu_features`, then
    ``LUCID_FX_CPU_ISA``) or else detected."""
    if _forced:
        return _forced[-1]
    return _from_environment(_environment_value()) or detected_cpu_features()


# os.environ's own store (what os.environ.get reads and setenv writes): .get on it raises nothing where the variable is
# unset; os.environ.get catches a KeyError then, 0.66 of cpu_features' 0.8 us warm, and every program call asks.
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON is not None else None


def cpu_kind_name() -> str:
    """``cpu_features().name`` in one Python call where nothing is forced (the program key reads it on every call of
    a converted model, after a kernel, with the interpreter's caches cold: each call in the chain costs there)."""
    if not _forced and (_ENVIRON.get(_ENV_KEY) if _ENVIRON is not None else os.environ.get(ENV_VAR)) is None:
        return detected_cpu_features().name
    return cpu_features().name


def _environment_value() -> Optional[str]:
    if _ENVIRON is None:
        return os.environ.get(ENV_VAR)
    raw = _ENVIRON.get(_ENV_KEY)
    return None if raw is None else os.environ.decodevalue(raw)


@contextlib.contextmanager
def force_cpu_features(name: str) -> Iterator[CpuFeatures]:
    """Choose weight grids and kernel paths as on a CPU of kind ``name`` (one of :data:`CPU_KINDS`)."""
    features = _kind(name)
    _forced.append(features)
    try:
        yield features
    finally:
        _forced.pop()
