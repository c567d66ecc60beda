"""Native CPU kernels: ``native.c`` compiled by the machine's C compiler on first use, called by ctypes.

Programs (:mod:`lucid_fx.rules.program_cpu`) call these where torch 2.13 needs several ops for one step, each the
torch kernels' values bit for bit. The float-to-int8 boundary is one pass: codes and the input's NaN/±inf count
together, so the finite check (``docs/policies.md``) costs no second read (4.1 against 11.8 us for 1x1024 values, 25.8
against 78.0 us for 1x3x224x224, AVX512-VNNI EPYC, 1 thread). Squeeze-excite's gate multiply and global pool
(:mod:`~lucid_fx.kernels.native_squeeze_excite`), table lookups (:mod:`~lucid_fx.kernels.native_lut`), a one-row
linear's float steps (linear_native.row_epilogue) and requantizations are one pass each too; docs/benchmarks.md has
each measurement. :func:`bind` fixes a call's scalar arguments once (:mod:`~lucid_fx.kernels.native_bound`), what a
program's planned steps (:mod:`~lucid_fx.kernels.native_step`) call.

Choices:

- **Compiled once per machine** (:mod:`lucid_fx.kernels.native_build`) into a private cache keyed by the sources,
  compiler, flags and CPU features (``LUCID_FX_NATIVE_CACHE=0``: per process).
- **Optional.** Without a compiler (or with ``LUCID_FX_NATIVE=0``) the torch path runs, with the
  same codes; :func:`status` says which and why. ``LUCID_FX_CC`` (else ``CC``, else ``cc``) names it.
- **Float input on the CPU:** a dense float32 input is read in place and its codes keep its layout; other float
  inputs are converted first, as the torch kernels convert them.

>>> x = torch.tensor([-1.0, 0.0, 0.5, 0.25, 9.0])
>>> quantize_codes(x, 1 / 0.1, 3, 0, 255, torch.uint8)
tensor([ 0,  3,  8,  5, 93], dtype=torch.uint8)
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from lucid_fx.kernels import bound_ops, finite, native_bound, native_build, program_ops
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.native_step import returns_step

__all__ = ["available", "status", "bind", "split_threads", "takes", "record_in_profiler", "quantize_codes", "quantize_call", "quantize_plan", "post_op_codes", "post_op_plan",
           "requantize_scaled", "matmul_codes", "SOURCE"]

SOURCE = Path(__file__).with_name("native.c")
SOURCES = (SOURCE, *(SOURCE.with_name(f"native_{n}.c") for n in ("gemm", "gemm_entry", "amx", "conv", "matmul", "softmax", "rotary", "norm", "pool", "rnn")))
HEADERS = tuple(sorted(SOURCE.parent.glob("native*.h")))  # what the sources include: part of the library's name
# -march=native: this CPU's vector width (a second set for compilers without it); -ffp-contract=off: no FMAs,
# which round once where the torch kernels round twice; -fopenmp: the GEMM's threads (each set also without).
FLAGS = tuple((*march, "-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp") for march in (("-march=native",), ()))
check_finite = True  # count NaN/±inf in the quantize pass (benchmarks/nonfinite_check.py turns it off to measure it)

_P, _I64, _I32, _F, _D, _CODES = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_double, (torch.uint8, torch.int8)
# The C functions, {kernel: (argument types, result type, the dtypes it writes)}: lucid_<kernel>_<dtype>.
SIGNATURES = {
    "quantize": ((_P, _P, _I64, _F, _I32, _I32, _I32, _I32), _I64, _CODES),  # x, out, n, inv, zp, qmin, qmax, check
    "quantize_cl": ((_P, _P, _I64, _I64, _I64, _F, _I32, _I32, _I32, _I32), _I64, _CODES),  # x, out, n, c, hw, inv, ...
    "gate_mul": ((_P, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _F, _I32, _I32, _I32), None, _CODES),
    "global_avg_pool": ((_P, _P, _P, _I64, _I64, _I64, _I32, _F, _F, _I32, _I32, _I32), None, _CODES),
    "row_epilogue": ((_P, _P, _P, _P, _P, _I64, _I64, _F, _F, _I32, _F, _F), None, (*_CODES, torch.float32)),
    "lut": ((_P, _P, _P, _I64, _I32), None, (*_CODES, torch.float32)),  # codes, table, out, n, flip
    "requantize": ((_P, _P, _I64, _F, _I32, _I32, _I32), None, _CODES),  # y, out, n, mult, zp, low, high
    "lut_mul": ((_P, _P, _I32, _P, _P, _I32, _P, _I64, _I32, _I32, _F, _I32, _I32, _I32), None, _CODES),
    "dequantize": ((_P, _P, _I64, _I32, _F), None, _CODES),  # codes, out, n, zp, scale
    "mul_strided": ((_P, _P, _P, _P, _I32, _I32, _F, _I32, _I32, _I32), None, _CODES),  # a, b, out, geometry, ...
    "add_strided": ((_P, _P, _P, _P, _I32, _F, _I32, _F, _I32, _I32, _I32), None, _CODES),
    "matmul": ((_P, _P, _P, _P, _I32, _I32, _F, _P, _I32, _I32, _I32), _I32, _CODES),  # native_matmul.c
    "softmax": ((_P, _P, _P, _P, _I64, _I64, _I64, _F, _I32, _I32, _I32), _I32, _CODES),  # native_softmax.c
    "softmax_exp": ((_P, _P, _P, _P, _P, _I64, _I64, _D, _I32), _I32, _CODES),  # native_softmax.c: softmax_matmul's
    "softmax_exp_float": ((_P, _P, _P, _I64, _I64, _D, _I32), _I32, _CODES),  # the same from float scores
    "softmax_exp_bias": ((_P, _P, _P, _P, _P, _F, _I32, _D, _I32), _I32, _CODES),  # from codes and a bias
    "rotary": ((_P, _P, _P, _P, _P, _P, _P, _P, _P), None, _CODES),  # native_rotary.c: x, c, s, tables, out, geometry, ints, floats
    "channel_lut": ((_P, _P, _P, _I64, _I64, _I64, _I32), None, (*_CODES, torch.float32)),  # q, tables, out, outer, c, inner, flip
    "channel_lut_cat": ((_P, _P, _I32, _P, _P, _I64, _I64, _I32), None, (*_CODES, torch.float32)),  # srcs, widths, n, tables, ...
    "gemm": ((_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _F, _F, _I32, _F, _F, _I32), None, (*_CODES, torch.float32)),  # native_gemm.c
    "gemm_sum": ((_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _F, _F, _I32, _F, _F, _P, _F, _I32), None, (torch.uint8,)),
    "gemm_add": ((_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, _F, _F, _I32, _F, _F, _P), None, (torch.float32,)),
    "conv": ((_P, _P, _P, _P, _I32, _I32, _P, _P, _P, _F, _F, _I32, _F, _F, _I32), None, (*_CODES, torch.float32)),  # native_conv.c
    "norm": ((_P, _P, _I64, _I64, _I32, _I32, _F, _P, _P, _F, _I32, _I32, _I32), None, _CODES),  # native_norm.c
    "group_norm": ((_P, _P, _I64, _I64, _I64, _I32, _I32, _I32, _F, _P, _P, _F, _I32, _I32, _I32, _P), _I32, (*_CODES, torch.float32)),
    "pool": ((_P, _P, _P, _F), _I32, _CODES),  # native_pool.c: q, out, geometry, ratio; nonzero: no scratch
    "rnn": ((_P,) * 11 + (_F, _F) + (_P,) * 4, None, (torch.float32,)),  # native_rnn.c: a layer, a cell, a dynamic linear
    "cell": ((_P,) * 13, _I32, (torch.float32,)), "linear_dynamic": ((_P,) * 8, _I32, (torch.float32,)),
}
CODE_DTYPES = {torch.uint8: "uint8", torch.int8: "int8", torch.float32: "float32"}
GENERATED = ((native_bound.NAME, native_bound.source(SIGNATURES, CODE_DTYPES)),)  # the bound entry points (bind)


def _compiler() -> Optional[str]:
    return native_build.compiler(("LUCID_FX_CC", "CC"), "cc")


@functools.lru_cache(maxsize=1)
def _library() -> Tuple[Optional[Dict[Tuple[str, Any], Any]], str]:
    """The C functions by (kernel, code dtype) and how they were built, or None and why not (once
    per process)."""
    if os.environ.get("LUCID_FX_NATIVE", "1") == "0":
        return None, "off (LUCID_FX_NATIVE=0): the torch kernels run"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set LUCID_FX_CC or CC): the torch kernels run"
    with native_build.built(cc, native_build.with_fallbacks(native_build.capped(FLAGS)), SOURCES, HEADERS, GENERATED) as (so, how):
        if so is None:
            return None, how
        try:
            return _bind(ctypes.CDLL(str(so))), how  # stays mapped after a temporary file goes
        except OSError as error:  # a kept library that does not load (cut short): the next process builds it again
            if so.parent == native_build.cache_dir():
                so.unlink(missing_ok=True)
            return None, f"{so} did not load ({error}): the torch kernels run"


def _bind(lib: ctypes.CDLL) -> Dict[Tuple[str, Any], Any]:
    functions = {}
    for kernel, (argtypes, restype, dtypes) in SIGNATURES.items():
        for dtype in dtypes:
            fn = getattr(lib, f"lucid_{kernel}_{CODE_DTYPES[dtype]}")
            fn.argtypes, fn.restype = argtypes, restype
            functions[kernel, dtype] = fn
            if native_bound.has_scalars(argtypes):
                fn = getattr(lib, f"lucid_{kernel}_{CODE_DTYPES[dtype]}_bound")
                fn.argtypes, fn.restype = (_P,) * (native_bound.pointer_count(argtypes) + 1), restype
                functions[kernel, dtype, "bound"] = fn
    facts = (("lut", "vectorized"), ("gemm", "vectorized"), ("gemm", "full_grid"), ("gemm", "threaded"), ("matmul", "vectorized"))
    for kernel, fact in facts:  # facts of this build, kept with its functions
        query = getattr(lib, f"lucid_{kernel}_{fact}")
        query.argtypes, query.restype = (), ctypes.c_int32
        functions[kernel, fact] = bool(query())
    functions["amx", "use"] = amx = lib.lucid_amx_use  # linear_native.use_amx
    amx.argtypes, amx.restype = (_I32,), _I32
    amx(os.environ.get("LUCID_FX_AMX", "1") != "0")  # on where built for AMX and Linux grants the tiles
    functions["amx", "calls"] = calls = lib.lucid_amx_calls
    calls.argtypes, calls.restype = (), _I64
    functions["split", "threads"] = split = lib.lucid_split_threads  # split_threads
    split.argtypes, split.restype = (_I64, _I64, _I64), _I32
    return functions


_recording = []  # non-empty: each call is a torch profiler event (record_in_profiler)


def _function(kernel: str, dtype: Any) -> Optional[Callable]:
    functions = _library()[0]
    fn = None if functions is None else functions.get((kernel, dtype))
    return functools.partial(_call, kernel, fn) if _recording and callable(fn) else fn


# A native call's profiler event: torch's C++ fast record, 0.6 us a call and 0.14 of it inside the event, where this
# torch has it (record_function: 5.9 us, 3.5 inside, which benchmarks/overhead.py would count as kernel time).
_event = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None) or torch.profiler.record_function


def bind(kernel: str, dtype: Any, *scalars: Any) -> Optional[Callable]:
    """``lucid_<kernel>_<dtype>`` with its scalar arguments (those :data:`SIGNATURES` does not type as pointers,
    in order) fixed now: a function of the pointer arguments alone, what a program calls (native_bound: 0.35
    against 2.1 us a call for gate_mul's 3 pointers and 10 scalars). None without the native kernels."""
    functions = _library()[0]
    fn = None if functions is None else functions.get((kernel, dtype, "bound"))
    if fn is None:  # no native kernels, or a kernel of pointers only: its own function
        fn = None if functions is None else functions.get((kernel, dtype))
        if fn is None:
            return None
        call, address = functools.partial(_call, kernel, fn), 0
    else:
        fixed = native_bound.scalars(SIGNATURES[kernel][0], scalars)
        call, address = functools.partial(_call_bound, kernel, fn, ctypes.addressof(fixed)), ctypes.addressof(fixed)
        call.scalars = fixed  # (kept alive with the function that reads it)
    restype = SIGNATURES[kernel][1]  # what a native step calls (native_step.py): the function, its struct, status
    call.native = (ctypes.cast(fn, _P).value, address, 0 if restype is None else ctypes.sizeof(restype), kernel)
    return call


def _call_bound(kernel: str, fn: Callable, address: int, *pointers: int) -> Any:
    if _recording:
        with _event(f"native::{kernel}"):
            return fn(*pointers, address)
    return fn(*pointers, address)


def _call(kernel: str, fn: Callable, *args: Any) -> Any:
    if _recording:
        with _event(f"native::{kernel}"):
            return fn(*args)
    return fn(*args)


def record_in_profiler(on: bool) -> None:
    """Make every native kernel call a ``native::<kernel>`` event of torch's profiler (a ctypes call is no
    torch op: a profile would count it outside kernels); benchmarks/overhead.py turns it on. Off: free."""
    _recording[:] = [True] if on else []
    bound_ops.record_native(on)  # the native steps' calls too


def split_threads(work: int, parts: int, least: int = 0) -> int:
    """The threads a native pass splits ``work`` units in ``parts`` pieces among now (native_threads.h; ``least``: its
    threshold, 0 for a pass over elements): 1 below it, at one torch thread, without OpenMP or native kernels."""
    functions = _library()[0]
    return 1 if functions is None else int(functions["split", "threads"](work, least, parts))


def available() -> bool:
    """Whether the native kernels are loaded in this process (compiling them on the first call)."""
    return _library()[0] is not None


def status() -> str:
    """One line: how the native kernels were built, or why the torch kernels run instead."""
    return _library()[1]


def takes(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the native quantize takes ``x`` (a float tensor on the CPU; one not float32 and
    contiguous is copied first, as the torch kernels convert it) and writes ``dtype`` (uint8 or int8)."""
    return dtype in _CODES and x.is_cpu and x.is_floating_point()


@returns_step("x")
def quantize_codes(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype,
                   plan: Optional[Callable] = None) -> torch.Tensor:
    """``clamp(round(x * inv_scale) + zp, qmin, qmax)`` as ``dtype`` in one pass; NaN and ±inf are
    refused (:class:`lucid_fx.kernels.checks.KernelInputError`, naming the node). ``inv_scale`` is
    rounded to float32 as the torch kernels round it. Without the native kernels, the codes of
    :func:`lucid_fx.kernels.program_ops.quantize_codes` (float32 ``x``). ``plan``: :func:`quantize_plan`'s."""
    out = None if plan is None else plan(x)
    if out is not None:
        return out
    if not (_function("quantize", dtype) and takes(x, dtype)):
        return program_ops.quantize_codes(x, inv_scale, zp, qmin, qmax, dtype)
    x32 = x if x.dtype == torch.float32 else x.to(torch.float32)  # (a no-op .to costs 1.5 us a call)
    step = quantize_plan(x32, inv_scale, zp, qmin, qmax, dtype)  # a dense x: its strides
    if step is not None:
        return step(x32, x)
    dense = x32.contiguous()
    codes = quantize_plan(dense, inv_scale, zp, qmin, qmax, dtype)(dense, x)
    return torch.empty_like(x, dtype=dtype).copy_(codes)  # the layout the op's fake promises


def quantize_call(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype) -> Optional[Callable]:
    """The bound native quantize (``call(x_ptr, out_ptr)``: its count of non-finite values) of float32 ``x`` whose codes
    keep its dense layout, or None: what :func:`quantize_plan` and a program's native step call."""
    if dtype not in _CODES or x.dtype != torch.float32 or torch.empty_like(x, dtype=dtype).stride() != x.stride():
        return None
    return bind("quantize", dtype, x.numel(), inv_scale, zp, qmin, qmax, check_finite)


def quantize_plan(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype) -> Optional[Callable]:
    """:func:`quantize_codes`' native call for float32 tensors laid out as ``x``, its checks made once:
    ``step(x)``, codes in ``x``'s layout, or None for a tensor of other strides (``step(x32, x)``: ``x``
    converted, the non-finite check on ``x`` itself). None where the native kernels or their dense layout do
    not take ``x``."""
    shape, strides, call = tuple(x.shape), x.stride(), quantize_call(x, inv_scale, zp, qmin, qmax, dtype)
    if call is None:
        return None

    def quantize(x: torch.Tensor, source: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        if x.stride() != strides or x.dtype != torch.float32 or not x.is_cpu:
            return None
        out = torch.empty_strided(shape, strides, dtype=dtype)
        if call(x.data_ptr(), out.data_ptr()):
            finite.refuse_nonfinite("quantize_per_tensor", x if source is None else source)  # raises unless a finite
            # source overflowed float32
        return out

    return quantize


def post_op_codes(y: torch.Tensor, post_op: str, out_scale: float, zp: int, dtype: torch.dtype,
                  plan: Optional[Callable] = None) -> torch.Tensor:
    """The reference's ``post_op`` on float32 ``y`` (in place: :func:`lucid_fx.kernels.reference.finish`),
    then the codes ``quantize_per_tensor`` gives the result, in one pass (:func:`quantize_codes`; ``plan``:
    :func:`post_op_plan`'s)."""
    y = ref.finish(y, post_op, 1.0, 0, torch.float32)
    if dtype == torch.float32:
        return y
    info = torch.iinfo(dtype)
    return quantize_codes(y, ref.f32_reciprocal(out_scale), zp, info.min, info.max, dtype, plan)


def post_op_plan(y: torch.Tensor, post_op: str, out_scale: float, zp: int, dtype: torch.dtype) -> Optional[Callable]:
    """:func:`post_op_codes`' quantize call for float32 ``y`` laid out as this one (:func:`quantize_plan`)."""
    if dtype == torch.float32:
        return None
    info = torch.iinfo(dtype)
    return quantize_plan(y, ref.f32_reciprocal(out_scale), zp, info.min, info.max, dtype)


def requantize_scaled(y: torch.Tensor, mult: float, zp: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """``program_ops.requantize_codes(y.mul_(mult), zp, low, high, dtype)`` of float32 ``y`` in one pass
    (the torch kernels' four to six), in ``y``'s layout: the same codes, bit for bit."""
    fn = _function("requantize", dtype)
    out = None if fn is None or y.dtype != torch.float32 or not y.is_cpu else torch.empty_like(y, dtype=dtype)
    if out is None or out.stride() != y.stride():  # no native kernels, or y is not dense
        return program_ops.requantize_codes(y.mul_(program_ops.operand(mult)), zp, low, high, dtype)
    fn(y.data_ptr(), out.data_ptr(), y.numel(), mult, zp, low, high)
    return out


def matmul_codes(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype):
    """:func:`lucid_fx.kernels.program_ops.matmul_codes`, requantized in one pass."""
    return requantize_scaled(program_ops.matmul_float(qa, a_zp, qb, b_zp), mult, zp, low, high, dtype)
