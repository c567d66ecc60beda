"""lucid_fx's C++ extension (``bound_ops.cpp``): what a program runs between its kernels, so no Python runs there.

- ``BoundOp`` (:func:`bind`): a torch operator's constant arguments converted once, its tensors passed per call.
- ``NativeStep`` (:mod:`lucid_fx.kernels.native_step`): planned calls of lucid_fx's C kernels, checked, allocated
  and called in C++.
- ``runner_method`` (:mod:`lucid_fx.program`): a converted model's common call in C++.
- ``NativeProgram`` (:mod:`lucid_fx.passes.run_program_natively`): a program's whole graph run from C++, in place
  of its generated Python forward.

A program calls oneDNN's int8 convolutions and linears as ``torch.ops.onednn.qconv2d_pointwise.default(x, 17
arguments)``. From Python that is the dispatcher's boxed call: ``OpOverload.__call__``, then each argument converted
to the operator's schema, on every call. Between two kernels, with the interpreter's caches cold, that took 14 us
from the call to the convolution's start and 5 after it (ResNet-like, AMX Xeon, profiler timestamps), where the
convolution's arguments but its input are the same on every call of a program. :class:`BoundOp` (C++,
``bound_ops.cpp``) converts those once, when the program is built, and a call passes only the tensors: the same
operator, through the same dispatcher call (so the profiler records it as before), with the GIL released as
``torch.ops`` releases it.

Built like the native kernels (:mod:`lucid_fx.kernels.native_build`): once per machine and torch build, by the
machine's C++ compiler (``LUCID_FX_CXX``, else ``CXX``, else ``c++``), against the torch being imported (its
version, build and header paths are part of the library's name), kept in the private cache. About 25 s the first
time on a 2-core machine. ``LUCID_FX_BOUND_OPS=0`` turns it off; without it (or without a compiler) programs call
``torch.ops``, native steps run as Python closures and calls stay in Python, with the same values. :func:`status`
says which and why.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import torch

from lucid_fx.kernels import native_build

__all__ = ["bind", "module", "available", "status", "record_native", "SOURCE"]

SOURCE = Path(__file__).with_name("bound_ops.cpp")
_NAME = "lucid_fx_bound_ops"  # the extension module's name: PyInit_<name> in the library


def _compiler() -> Optional[str]:
    return native_build.compiler(("LUCID_FX_CXX", "CXX"), "c++")


def _flags() -> Tuple[str, ...]:
    """What ``torch.utils.cpp_extension`` compiles an extension with, and the torch build as defines (so the
    library's name, which hashes its flags, changes with the torch it was built against)."""
    root = Path(torch.__file__).parent
    includes = (root / "include", root / "include" / "torch" / "csrc" / "api" / "include", sysconfig.get_paths()["include"])
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    version = f"{torch.__version__}+{getattr(torch.version, 'git_version', '')}"
    return ("-O2", "-std=c++17", "-w", f"-DTORCH_EXTENSION_NAME={_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DLUCID_FX_TORCH=\"{version}\"",
            *(f"-I{path}" for path in includes), "-Wl,--no-as-needed", f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}",
            "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python")


@functools.lru_cache(maxsize=1)
def _module() -> Tuple[Any, str]:
    """The extension module and how it was built, or None and why not (once per process)."""
    if os.environ.get("LUCID_FX_BOUND_OPS", "1") == "0":
        return None, "off (LUCID_FX_BOUND_OPS=0): programs call torch.ops"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set LUCID_FX_CXX or CXX): programs call torch.ops"
    with native_build.built(cxx, (_flags(),), (SOURCE,)) as (so, how):
        if so is None:
            return None, how.replace("the torch kernels run", "programs call torch.ops")
        try:
            spec = importlib.util.spec_from_file_location(_NAME, so)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)  # stays mapped after a temporary file goes
        except (ImportError, OSError) as error:
            return None, f"{so} did not load ({error}): programs call torch.ops"
    module.set_recording(bool(_recording))
    return module, how


_recording: list = []  # non-empty: native steps are profiler events (record_native)


def record_native(on: bool) -> None:
    """Native steps (:mod:`lucid_fx.kernels.native_step`) as ``native::<kernel>`` profiler events, or not; builds
    nothing (a library loaded later starts so)."""
    _recording[:] = [True] if on else []
    if _module.cache_info().currsize and _module()[0] is not None:
        _module()[0].set_recording(on)


def module() -> Any:
    """The extension module (``BoundOp``, ``NativeStep``, ``NativeProgram``, ``runner_method``), or None where it is
    not built."""
    return _module()[0]


def available() -> bool:
    return _module()[0] is not None


def status() -> str:
    """How the bound calls were built, or why programs call ``torch.ops`` instead."""
    return _module()[1]


def bind(op: torch._ops.OpOverload, values: Sequence[Any], slots: Sequence[int]) -> Optional[Any]:
    """``op`` with ``values`` (one per argument of its schema) converted now, but for the arguments at ``slots``: a
    callable taking those tensors, in order, and returning ``op``'s tensor. None where the bound calls are not
    built, or ``op`` or a value does not bind (an operator returning other than one tensor, a value its schema
    does not take): the caller keeps ``op``'s own call."""
    module = _module()[0]
    if module is None:
        return None
    try:
        return module.BoundOp(op._schema.name, op._schema.overload_name, list(values), list(slots))
    except (RuntimeError, TypeError, ValueError):
        return None
