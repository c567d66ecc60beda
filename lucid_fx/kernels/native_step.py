"""Planned native calls as data: what a program's step checks, allocates and passes to one C kernel.

A planned call (passes/plan_program_calls.py) was a Python closure per kernel: compare the operands' strides and
dtypes with the planned ones, allocate the result, read each tensor's ``data_ptr()``, call the bound C function
through ctypes. Between two kernels, with the interpreter's caches cold, each of those steps costs several times its
warm time. :func:`native_step` describes the same call as data (the operands' strides and dtypes, the buffers to
allocate, the pointers in the C function's order) and returns a ``NativeStep`` of ``bound_ops.cpp`` that does all
of it in C++ with the GIL released, or, where the bound calls are not built, a Python closure doing the same.

A step takes its tensors and returns the first buffer, or None for tensors it was not planned for (the caller's
checked path serves them) and where a kernel with a status (``returns``) reports one (quantize's non-finite count:
the checked path raises, naming the node). While :func:`lucid_fx.kernels.native.record_in_profiler` is on, each
call is a ``native::<kernel>`` profiler event, as a ctypes call is.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple, Union

import torch

from lucid_fx.kernels import bound_ops

__all__ = ["native_step", "native_chain", "returns_step", "IN", "BUFFER"]

_DTYPES = {torch.uint8: "uint8", torch.int8: "int8", torch.int32: "int32", torch.float32: "float32"}
IN, BUFFER = "in", "buffer"
# A pointer argument: (IN, i) the i-th tensor's data, (BUFFER, j) the j-th buffer's, or an address (a constant's
# data_ptr, held alive by whoever planned the step; None for NULL).
Pointer = Union[Tuple[str, int], int, None]


def returns_step(*operands: str, step: str = "plan") -> Callable[[Callable], Callable]:
    """Mark a planned kernel function whose result is its ``step`` parameter called on its ``operands`` parameters,
    ``step(*operands)``, wherever that gives a tensor, and the same values its own way where it gives None. A program
    running from C++ (:mod:`lucid_fx.passes.run_program_natively`) then calls the step itself, and the function only
    where the step refuses. Sets ``fn.returns_step = (step, operands)``."""
    def mark(fn: Callable) -> Callable:
        fn.returns_step = (step, operands)
        return fn

    return mark


def native_step(call: Callable, inputs: Sequence[Tuple[Sequence[int], Sequence[int], torch.dtype]],
                buffers: Sequence[Tuple[Sequence[int], Sequence[int], torch.dtype]],
                pointers: Sequence[Pointer], keep: Any = None) -> Optional[Callable]:
    """The step calling ``call`` (:func:`lucid_fx.kernels.native.bind`'s) with ``pointers``, for CPU tensors of
    ``inputs``' (shape, strides, dtype); ``buffers`` (shape, strides, dtype) are allocated per call, the first returned.
    ``keep``: what the constant addresses point into, held by the step. None where a dtype is not one a native
    kernel takes."""
    return native_chain([(call, pointers)], inputs, buffers, 0, keep)


def native_chain(calls: Sequence[Tuple[Callable, Sequence[Pointer]]], inputs, buffers, result: int = 0,
                 keep: Any = None) -> Optional[Callable]:
    """:func:`native_step` of several calls, one after another, in one step: ``calls`` (bound call, its pointers),
    where a buffer one call writes is another's operand; the step returns buffer ``result``. No Python runs between
    the calls (in C++; the Python closure where the bound calls are not built)."""
    if any(i[2] not in _DTYPES for i in inputs) or any(b[2] not in _DTYPES for b in buffers):
        return None
    inputs = [(tuple(shape), tuple(strides), dtype) for shape, strides, dtype in inputs]
    buffers = [(tuple(shape), tuple(strides), dtype) for shape, strides, dtype in buffers]
    module = bound_ops.module()
    natives = [getattr(call, "native", None) for call, _ in calls]
    if module is not None and all(n is not None and len(p) + bool(n[1]) <= 8 for n, (_, p) in zip(natives, calls)):
        coded = [(fn, scalars, returns, [(0 if p[0] == IN else 1, p[1]) if isinstance(p, tuple) else (2, p or 0)
                                         for p in pointers])
                 for (fn, scalars, returns, _), (_, pointers) in zip(natives, calls)]
        step = module.NativeStep("native::" + "+".join(n[3] for n in natives), coded,
                                 [(list(shape), list(s), _DTYPES[d]) for shape, s, d in inputs],
                                 [(list(shape), list(s), _DTYPES[d]) for shape, s, d in buffers], result)
    else:
        step = _python_step(calls, inputs, buffers, result)
    step.calls, step.keep = [call for call, _ in calls], keep  # the scalars' structs and constants it reads: alive
    return step


def _python_step(calls, inputs, buffers, result: int) -> Callable:
    count = len(inputs)
    orders = [(call, [p if isinstance(p, tuple) else (None, p) for p in pointers]) for call, pointers in calls]

    def step(*tensors: torch.Tensor) -> Optional[torch.Tensor]:
        if len(tensors) != count:
            raise TypeError(f"a native step takes {count} tensors, got {len(tensors)}")
        for t, (shape, strides, dtype) in zip(tensors, inputs):
            if t.dtype != dtype or t.shape != shape or t.stride() != strides or not t.is_cpu:
                return None
        made = [torch.empty_strided(shape, strides, dtype=dtype) for shape, strides, dtype in buffers]
        for call, order in orders:
            if call(*(tensors[i].data_ptr() if kind == IN else made[i].data_ptr() if kind == BUFFER else i
                      for kind, i in order)):
                return None
        return made[result]

    return step
