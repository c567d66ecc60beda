"""Native CPU kernels: ``native.c`` compiled by the machine's C compiler on first use, called by ctypes.

The float-to-int8 boundary is one pass in C: codes and the NaN/±inf count of the input together, so
the finite check (``docs/policies.md``) costs no second read. Measured on an AVX512-VNNI EPYC, 1 thread,
against :func:`lucid_fx.kernels.program_ops.quantize_codes` (four torch ops plus its ``aminmax``
check): 4.1 against 11.8 us for 1x1024 values, 13.4 against 40.2 us for 64x1024, 25.8 against 78.0
us for 1x3x224x224; the codes are the same bit for bit.

Choices:

- **Compiled per process, never cached on disk.** ``cc -O3 -march=native`` takes ~0.2 s, once, at
  the first convert or load. A cached binary would have to be keyed by every CPU feature that
  ``-march=native`` used (a home directory shared by two machines would otherwise run illegal
  instructions) and would be one more file that could be swapped under the user; the ``.so`` is
  built in a private temporary directory, loaded, and the directory removed.
- **Optional.** Without a compiler (or with ``LUCID_FX_NATIVE=0``) every caller keeps its torch
  path, which gives the same codes; :func:`status` says which one runs and why. ``LUCID_FX_CC``
  (else ``CC``, else ``cc``) names the compiler.
- **Float input on the CPU:** a dense float32 input (contiguous, channels-last, ...) is read in
  place and its codes keep its layout; other float inputs are converted first, as the torch
  kernels convert them.

>>> x = torch.tensor([-1.0, 0.0, 0.5, 0.25, 9.0])
>>> quantize_codes(x, 1 / 0.1, 3, 0, 255, torch.uint8)
tensor([ 0,  3,  8,  5, 93], dtype=torch.uint8)
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from lucid_fx.kernels import checks, program_ops

__all__ = ["available", "status", "quantize_codes", "SOURCE"]

SOURCE = Path(__file__).with_name("native.c")
# -march=native: the vector width this CPU has (AVX-512 here); the second set for compilers that lack it.
FLAGS = (("-O3", "-march=native", "-fno-math-errno"), ("-O3", "-fno-math-errno"))
# Counting NaN/±inf in the quantize pass; benchmarks/nonfinite_check.py turns it off to measure it.
check_finite = True

_QUANTIZE_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32,
                  ctypes.c_int32, ctypes.c_int32, ctypes.c_int32)
_QUANTIZE = {torch.uint8: "lucid_quantize_uint8", torch.int8: "lucid_quantize_int8"}


def _compiler() -> Optional[str]:
    name = os.environ.get("LUCID_FX_CC") or os.environ.get("CC") or "cc"
    words = shlex.split(name)
    return name if words and shutil.which(words[0]) else None


@functools.lru_cache(maxsize=1)
def _library() -> Tuple[Optional[Dict[torch.dtype, Callable]], str]:
    """The quantize functions by code dtype and how they were built, or None and why not (once per
    process)."""
    if os.environ.get("LUCID_FX_NATIVE", "1") == "0":
        return None, "off (LUCID_FX_NATIVE=0): the torch kernels run"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set LUCID_FX_CC or CC): the torch kernels run"
    errors = []
    with tempfile.TemporaryDirectory(prefix="lucid_fx_native_") as tmp:
        so = Path(tmp) / "lucid_fx_native.so"
        for flags in FLAGS:
            command = [*shlex.split(cc), *flags, "-shared", "-fPIC", "-o", str(so), str(SOURCE)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as error:
                return None, f"{cc} could not run ({error}): the torch kernels run"
            if done.returncode == 0:
                lib = ctypes.CDLL(str(so))  # stays mapped after the directory is removed
                quantize = {dtype: getattr(lib, name) for dtype, name in _QUANTIZE.items()}
                for fn in quantize.values():
                    fn.argtypes, fn.restype = _QUANTIZE_ARGS, ctypes.c_int64
                return quantize, f"compiled with {' '.join(command[:len(shlex.split(cc)) + len(flags)])}"
            errors.append(done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"])
    return None, f"{cc} failed ({errors[-1][0]}): the torch kernels run"


def available() -> bool:
    """Whether the native kernels are loaded in this process (compiling them on the first call)."""
    return _library()[0] is not None


def status() -> str:
    """One line: how the native kernels were built, or why the torch kernels run instead."""
    return _library()[1]


def takes(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the native quantize takes ``x`` (a float tensor on the CPU; one not float32 and
    contiguous is copied first, as the torch kernels convert it) and writes ``dtype`` (uint8 or int8)."""
    return dtype in _QUANTIZE and x.device.type == "cpu" and x.is_floating_point()


def quantize_codes(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(round(x * inv_scale) + zp, qmin, qmax)`` as ``dtype`` in one pass; NaN and ±inf are
    refused (:class:`lucid_fx.kernels.checks.KernelInputError`, naming the node). ``inv_scale`` is
    rounded to float32 as the torch kernels round it. Without the native kernels, the codes of
    :func:`lucid_fx.kernels.program_ops.quantize_codes` (float32 ``x``)."""
    fn = (_library()[0] or {}).get(dtype)
    if fn is None or not takes(x, dtype):
        return program_ops.quantize_codes(x, inv_scale, zp, qmin, qmax, dtype)
    out = torch.empty_like(x, dtype=dtype)  # the layout the op's fake promises: a dense x's strides
    x32 = x.to(torch.float32)  # x itself when it is float32
    dense = x32.stride() == out.stride()  # then element i of one storage is element i of the other
    codes = out if dense else torch.empty(x.shape, dtype=dtype)
    if not dense:
        x32 = x32.contiguous()
    if fn(x32.data_ptr(), codes.data_ptr(), x32.numel(), inv_scale, zp, qmin, qmax, check_finite):
        checks.refuse_nonfinite("quantize_per_tensor", x)  # raises unless a finite x overflowed float32
    return out if dense else out.copy_(codes)
