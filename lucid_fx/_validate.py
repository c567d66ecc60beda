"""Checks of what users pass to the verbs, each failing with a message that says what to do."""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Optional, Sequence

import torch
from torch import fx, nn

from lucid_fx._meta import OBSERVERS

__all__ = ["require_module", "unwrap_compiled", "looks_like_inputs", "require_prepared", "require_float_model", "is_converted",
           "require_float32", "model_device", "check_backend_device"]

HALF = (torch.float16, torch.bfloat16)


def require_module(verb: str, obj: Any) -> None:
    if not isinstance(obj, nn.Module):
        raise TypeError(
            f"{verb} expects an nn.Module (or fx.GraphModule), got {type(obj).__name__}; wrap a function in an "
            "nn.Module whose forward calls it"
        )


def unwrap_compiled(verb: str, model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) holds. Traced as it is, the
    wrapper's copy runs the compiled original, so observers inserted into it would see no data."""
    inner = getattr(model, "_orig_mod", None)
    if type(model).__name__ != "OptimizedModule" or not isinstance(inner, nn.Module):
        return model
    warnings.warn(
        f"{verb}: got a torch.compile'd module (OptimizedModule); quantizing the module it wraps "
        f"(model._orig_mod, a {type(inner).__name__}). Pass the module itself to silence this, and "
        "torch.compile the converted model if you want it compiled",
        stacklevel=3,  # the caller of prepare
    )
    return inner


def looks_like_inputs(value: Any) -> bool:
    """A tensor, or a tuple/list holding one: example inputs or a batch, never a QConfigMapping."""
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)


def is_prepared(model: nn.Module) -> bool:
    return any(isinstance(m, fx.GraphModule) and hasattr(m, OBSERVERS) for m in model.modules())


def is_converted(model: nn.Module) -> bool:
    """A model convert made (or load gave back): a graph that calls lucid_fx's int8 ops."""
    return any(isinstance(m, fx.GraphModule) and any(n.op == "call_function" and str(n.target).startswith("lucid_fx.")
                                                     for n in m.graph.nodes) for m in model.modules())


def require_float_model(verb: str, model: nn.Module) -> None:
    """Refuse a model lucid_fx already prepared or converted: preparing it again observed the observers."""
    if is_prepared(model):
        raise ValueError(f"{verb}: the model is already prepared (it holds lucid_fx's observers); calibrate it and "
                         f"convert it (lucid_fx.calibrate, lucid_fx.convert), or {verb} the float model")
    if is_converted(model):
        raise ValueError(f"{verb}: the model is already converted to int8 (its graph calls lucid_fx's kernels); "
                         f"{verb} the float model it came from")


def require_prepared(verb: str, obj: Any) -> None:
    if not isinstance(obj, nn.Module):
        raise TypeError(
            f"{verb} expects the model returned by lucid_fx.prepare, got {type(obj).__name__}; call "
            "prepared = lucid_fx.prepare(model, example_inputs=...) first"
        )
    report = getattr(obj, "lucid_fx_report", None)
    if not is_prepared(obj) and report is not None and getattr(report, "float_modules", None):
        # prepare ran, but no part of the model traced: say why instead of "call prepare".
        raise ValueError(f"{verb}: nothing was quantized: prepare could not trace any part of the model\n{report}")
    if not is_prepared(obj):
        raise ValueError(
            f"{verb} expects a model returned by lucid_fx.prepare (no observers found in {type(obj).__name__}); "
            "call prepared = lucid_fx.prepare(model, example_inputs=...) first"
        )


def require_float32(verb: str, model: nn.Module, example_inputs: Optional[Sequence] = None) -> None:
    """Half-precision models are refused rather than half-supported: float ops left between the
    int8 kernels read float32 dequantized values, which a float16 weight cannot multiply."""
    named = itertools.chain(
        (("parameter", n, t) for n, t in model.named_parameters()), (("buffer", n, t) for n, t in model.named_buffers())
    )
    for kind, name, tensor in named:
        if tensor.dtype in HALF:
            raise TypeError(
                f"{verb}: the model's {kind} {name!r} is {tensor.dtype}; lucid_fx quantizes float32 models. "
                "Call model.float() first and pass float32 example_inputs (the int8 model reads and returns float32)"
            )
    for i, value in enumerate(example_inputs or ()):
        if isinstance(value, torch.Tensor) and value.dtype in HALF:
            raise TypeError(
                f"{verb}: example_inputs[{i}] is {value.dtype}; lucid_fx quantizes float32 models. "
                f"Pass example_inputs[{i}].float() (and a float32 model: model.float())"
            )


def model_device(model: nn.Module) -> Optional[torch.device]:
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return None


def check_backend_device(verb: str, model: nn.Module, backend: str) -> None:
    """The int8 kernels run where the model's tensors are: the backend must agree with them."""
    if backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"{verb}: backend 'cuda' needs a CUDA device, and torch.cuda.is_available() is False; "
            "use backend='cpu' on this machine"
        )
    device = model_device(model)
    if device is None or (device.type == "cuda") == (backend == "cuda"):
        return
    move = "prepared.cuda()" if backend == "cuda" else "prepared.cpu()"
    other = "cuda" if device.type == "cuda" else "cpu"
    raise ValueError(
        f"{verb}: the model's tensors are on {device} but backend is {backend!r}; move the model with {move} "
        f"before {verb}, or pass backend={other!r}"
    )
