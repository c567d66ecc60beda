"""Converted models run a program built for this machine; their graph stays the portable one.

:func:`install_programs` gives a converted GraphModule a class that, when called on CPU tensors,
runs the program :func:`~lucid_fx.passes.lower_to_program.lower_to_program` built for that input
signature (shapes, strides, dtypes) and this CPU's kind (the :class:`~lucid_fx.kernels.target.Target`): prepacked
oneDNN weights, decisions taken once, no dispatcher between kernels. The first call with a new
signature runs the portable graph (so bad input meets the kernels' checks and their messages) and
builds the program for the next calls; the program's own first call plans its native calls as it runs
(:mod:`lucid_fx.passes.plan_program_calls`), the later ones run the planned steps.

Everything else sees the portable graph: ``model.graph``, ``print(model.code)``, ``state_dict``,
``lucid_fx.save``, compare, explain and the viewer. Programs hold packed weights that cannot be
copied or pickled, so they are never state: a deep copy, ``.to()``/``.half()``, ``load_state_dict``
and ``recompile`` drop them, and the next call builds again. Keyword arguments are bound to the
graph's placeholders (``model(input_ids=..., attention_mask=...)`` runs the same program as the
positional call, defaults filled in). Calls on CUDA tensors replay a CUDA graph captured per
signature (:mod:`lucid_fx.cuda_graph`). Calls with hooks on the model, or on other devices, run the
portable graph. A weight changed in place after
convert is not seen by a program already built: call ``model.recompile()`` after such an edit.

>>> import torch, lucid_fx
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
>>> q = lucid_fx.quantize(model, (torch.randn(4, 8),), [torch.randn(4, 8)])
>>> first, again = q(torch.ones(4, 8)), q(torch.ones(4, 8))  # the portable graph, then the program
>>> torch.equal(first, again), len(programs_of(q))
(True, 1)
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import fx

from lucid_fx._pytree_spec import export_call, restore_signature
from lucid_fx.cuda_graph import capture, replayable
from lucid_fx.kernels.library import op_name
from lucid_fx.kernels import bound_ops
from lucid_fx.kernels.target import cpu_kind, kind_inputs
from lucid_fx.passes.lower_to_program import lower_to_program, record_values

__all__ = ["install_programs", "programs_of", "runs_int8_kernels", "MAX_SIGNATURES", "RUNTIME_ATTRIBUTES"]

# Input signatures a model keeps a program for; later signatures run the portable graph.
MAX_SIGNATURES = 8
_PROGRAMS = "_lucid_programs"
#: Attributes of a converted model that are run-time caches, never state (save skips them).
RUNTIME_ATTRIBUTES = frozenset({_PROGRAMS})


_UNSET = object()


class _Programs(dict):
    """Programs by input signature; a copy or a pickle starts empty (packed weights cannot travel).
    ``parameters``: the forward's (name, default) pairs that keyword calls bind to, read once."""

    parameters: Any = _UNSET
    full_warned = False  # the first signature past MAX_SIGNATURES warns, once

    def __deepcopy__(self, memo: dict) -> "_Programs":
        return _Programs()

    def __reduce__(self):
        return (_Programs, ())


def _signature(args: Tuple[Any, ...]) -> Optional[tuple]:
    """The program key of a call: the CPU kind (forced kinds get programs of their own), each
    argument's shape, stride and dtype or value, and last, for CUDA tensors, their device. Every call
    computes it, so it reads the kind, not the Target, and no ``tensor.device`` for CPU tensors (after a
    large kernel, with the interpreter's caches cold, resolve_target's lookups took 10 us of a call)."""
    key: list = [cpu_kind()]
    cpu, device = False, None
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return None
            if a.is_cpu:
                cpu = True
            elif a.is_cuda and device in (None, a.device):
                device = a.device
            else:
                return None
            key.append((a.shape, a.stride(), a.dtype))
        elif isinstance(a, (int, float, bool, str, type(None))):
            key.append(a)
        else:
            return None
    if device is not None:
        if cpu:
            return None  # CPU and CUDA tensors in one call: the portable graph (and its message)
        key.append(device)
    return tuple(key)


def _on_cuda(key: Optional[tuple]) -> bool:
    return key is not None and isinstance(key[-1], torch.device)


def _parameters(forward) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """``forward``'s (name, default) pairs in order; None where it takes ``*args``, ``**kwargs`` or
    keyword-only arguments (such calls run the portable graph)."""
    parameters = inspect.signature(forward).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        return None
    return tuple((p.name, p.default) for p in parameters)


def _bind(parameters, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """``args`` and ``kwargs`` as positional arguments of a forward with ``parameters`` (defaults
    filled in); None where they do not bind (the portable call raises Python's own message).
    Not ``inspect.signature(...).bind``: a keyword call measured 36 us of binding that way, 7 us this way."""
    if parameters is None or len(args) > len(parameters):
        return None
    rest = parameters[len(args):]
    if not kwargs.keys() <= {name for name, _ in rest}:
        return None
    bound = args + tuple(kwargs.get(name, default) for name, default in rest)
    return None if any(v is inspect.Parameter.empty for v in bound) else bound


def _eager_call(model: "ProgramRunner", *args: Any, **kwargs: Any) -> Any:
    """A converted model's call from code torch.compile traces: a graph break, then the programs as without it
    (docs/convert.md measured compiling a converted model slower, and does not offer it). Wrapped by
    torch.compiler.disable when first needed, not at import: that imports torch._dynamo, 1 s of ``import lucid_fx``."""
    global _EAGER
    if _EAGER is None:
        _EAGER = torch.compiler.disable(lambda m, *a, **k: ProgramRunner.__call__(m, *a, **k))
    return _EAGER(model, *args, **kwargs)


_EAGER: Optional[Callable[..., Any]] = None


def _fits(programs: Any, model: fx.GraphModule, args: Tuple[Any, ...]) -> bool:
    """Whether ``args`` bind to ``model``'s forward (checked once a signature: the key holds their count)."""
    if programs.parameters is _UNSET:
        programs.parameters = _parameters(model.forward)
    return programs.parameters is None or _bind(programs.parameters, args, {}) is not None


_is_compiling = torch.compiler.is_compiling  # (torch.compile knows the function, not the name it is called by)


class ProgramRunner:
    """Mixed into a converted GraphModule's class: calls run the program for their input signature."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():  # torch.compile traced into the programs' ctypes calls, on fake tensors:
            return _eager_call(self, *args, **kwargs)  # a segmentation fault. The model runs eagerly there instead
        programs = self.__dict__.get(_PROGRAMS)
        # The common call first, in as few Python steps as it takes (each costs 3-5x its warm time here, the
        # interpreter's caches cold after the last call's kernels): positional CPU tensors of a signature seen.
        if programs and not kwargs and not (self._forward_hooks or self._forward_pre_hooks):
            key = _signature(args)
            program = programs.get(key)
            if program is not None and not isinstance(key[-1], torch.device):
                return program.forward(*args)  # a program has no hooks: skip Module.__call__'s own checks
        return self._call_otherwise(programs, args, kwargs)

    def _call_otherwise(self, programs: Optional[Dict[tuple, Any]], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if programs is None:
            programs = self.__dict__[_PROGRAMS] = _Programs()
        if self._forward_hooks or self._forward_pre_hooks:
            return torch.nn.Module.__call__(self, *args, **kwargs)
        if kwargs:
            if programs.parameters is _UNSET:
                programs.parameters = _parameters(self.forward)
            bound = _bind(programs.parameters, args, kwargs)
            if bound is None:
                return torch.nn.Module.__call__(self, *args, **kwargs)
            args, kwargs = bound, {}
        key = _signature(args)
        if key is not None and key not in programs and not _fits(programs, self, args):
            return torch.nn.Module.__call__(self, *args)  # Python's own TypeError: a recording run ignored extra inputs
        if _on_cuda(key) and not replayable(self):
            key = None  # replays off, or autograd or a caller's capture records this call: the portable graph
        program = programs.get(key) if key is not None else None
        if program is not None:
            return program.forward(*args)  # a program has no hooks: skip Module.__call__'s own checks
        if key is not None and key not in programs and len(programs) >= MAX_SIGNATURES and not programs.full_warned:
            programs.full_warned = True
            warnings.warn(f"lucid_fx: this model has met more than {MAX_SIGNATURES} input signatures (shapes, strides, "
                          f"dtypes); it keeps a program for the first {MAX_SIGNATURES}, and the others run the portable "
                          "graph (correct, but measured 1.75x slower on the BERT-like model): pad or bucket inputs to a "
                          "few shapes, or raise lucid_fx.program.MAX_SIGNATURES", RuntimeWarning, stacklevel=3)
        if key is None or key in programs or len(programs) >= MAX_SIGNATURES:
            # The portable graph. Not super().__call__: fx's call wrapper looks itself up on the
            # instance's class, which would come back here.
            return torch.nn.Module.__call__(self, *args, **kwargs)
        # A new signature: the portable graph runs (its kernels check the input and name the node),
        # recording each value's shape and layout, and the program is built for the next calls.
        if _on_cuda(key):
            out = torch.nn.Module.__call__(self, *args)
            programs[key] = capture(self, args, lambda *inputs: torch.nn.Module.__call__(self, *inputs))
            return out
        try:
            out, values = record_values(self, args)
        except Exception:  # noqa: BLE001 - the plain call raises the same error, without the recorder's notes
            return torch.nn.Module.__call__(self, *args, **kwargs)
        programs[key] = _build(self, values)
        if programs[key] is not None:
            _use_native_call()
        return out

    _python_call = __call__  # what the call in C++ (_use_native_call) hands every other call to

    def __reduce__(self):
        # pickle / torch.save: the portable model's own reduction, with programs installed again on
        # load; a forward with the model's signature is pickled as torch.export's call, and restored.
        with export_call(self) as params:
            rebuild, args = super().__reduce__()[:2]
        return (_reinstall, (rebuild, args, params))

    def _apply(self, fn, recurse=True):
        self.__dict__.pop(_PROGRAMS, None)
        return super()._apply(fn, recurse)

    def load_state_dict(self, *args: Any, **kwargs: Any):
        self.__dict__.pop(_PROGRAMS, None)
        return super().load_state_dict(*args, **kwargs)

    def recompile(self):
        self.__dict__.pop(_PROGRAMS, None)
        # GraphModule.recompile sets its call wrapper on the model's class, in front of ProgramRunner.__call__: on
        # the class install_programs made, a deep copy's class of its own then called it back without end (pickling
        # recompiles: torch.save of the model, then copy.deepcopy, raised RecursionError). Taken off again there.
        cls = type(self)
        had = {name for name in ("__call__", "_wrapped_call") if name in vars(cls)}
        code = super().recompile()
        if ProgramRunner in cls.__bases__:
            for name in {"__call__", "_wrapped_call"} - had:
                delattr(cls, name)
        return code


_NATIVE_CALL: list = []  # tried: the C++ call in place, or not built


def _use_native_call() -> None:
    """Once a program is built: converted models' calls in C++ where bound_ops is built (``runner_method``: the
    common call of :meth:`ProgramRunner.__call__`, positional CPU tensors of a signature with a program, the same key;
    every other call goes to the Python method, which took 10-24 us from a call to its program's forward, the
    interpreter's caches cold after the previous call's kernels: benchmarks/overhead.py's models, AMX Xeon)."""
    module = None if _NATIVE_CALL else bound_ops.module()
    _NATIVE_CALL[:] = [True]
    if module is not None:
        ProgramRunner.__call__ = module.runner_method(ProgramRunner, ProgramRunner._python_call, *kind_inputs(), _PROGRAMS)


def _build(model: fx.GraphModule, values: Dict[str, Any]) -> Optional[fx.GraphModule]:
    try:
        with torch.no_grad():
            return lower_to_program(model, values, "cpu")
    except Exception as exc:  # noqa: BLE001 - the portable graph keeps serving; say why once
        warnings.warn(f"lucid_fx: no program for this input signature ({type(exc).__name__}: {exc}); the portable "
                      "graph runs instead (correct, slower)", RuntimeWarning, stacklevel=4)
        return None


def _reinstall(rebuild, args, params=None) -> fx.GraphModule:
    model = rebuild(*args)
    if params is not None:
        restore_signature(model, params)
    return install_programs(model)


def install_programs(model: fx.GraphModule) -> fx.GraphModule:
    """Give converted ``model`` (in place) the class that runs programs; returns it."""
    cls = type(model)
    if not issubclass(cls, ProgramRunner):
        model.__class__ = type(cls.__name__, (ProgramRunner, cls), {})
    return model


_BOUNDARY_OPS = frozenset({"quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel"})


def runs_int8_kernels(model: fx.GraphModule) -> bool:
    """Whether ``model``'s graph calls an int8 kernel (not only the quantize/dequantize pairs of
    reference mode, whose simulation runs as written)."""
    for node in model.graph.nodes:
        name = op_name(node)
        if name is not None and name not in _BOUNDARY_OPS:
            return True
    return False


def programs_of(model: fx.GraphModule) -> Dict[tuple, Any]:
    """The programs ``model`` holds now, by input signature: a program GraphModule for CPU inputs, a
    :class:`~lucid_fx.cuda_graph.CudaGraphProgram` for CUDA ones, None where building or capture
    failed (the portable graph runs)."""
    return dict(model.__dict__.get(_PROGRAMS, {}))
