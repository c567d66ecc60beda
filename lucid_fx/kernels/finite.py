"""NaN and ±inf at the float-to-int8 boundary: refused, naming the value and the node, never rounded to codes.

No int8 code represents NaN or ±inf (they would come back as finite numbers), so every float value
entering the grid is checked. The CPU's native quantize counts them in its own pass and calls
:func:`refuse_nonfinite` only when the count is not 0; the torch path and ``quantize_per_channel`` use
:func:`require_finite` (one ``aminmax``: the min and max are finite iff every element is); CUDA's fused
quantize clears a flag in its pass, asserted by :func:`assert_finite_flag`. On CUDA the tests are
``torch._assert_async``: no host sync, the error surfaces as a device-side assert with a shorter message
(built once per line of the graph's code). docs/policies.md has what each costs.
"""

from __future__ import annotations

import math
import sys
from typing import Dict, Tuple

import torch

from lucid_fx import _meta
from lucid_fx.kernels import checks

__all__ = ["require_finite", "assert_finite_flag", "refuse_nonfinite", "ASYNC_MESSAGE_BYTES"]


def _value_and_node(x: torch.Tensor) -> Tuple[str, str]:
    node = checks.calling_node()
    source = node.meta.get(_meta.SOURCE) if node is not None else None
    value = f"the value of node {source!r}" if source else "the tensor"
    return value, (f" (quantized by node {node.name!r} of the converted model)" if node is not None else "")


def _nonfinite_message(op: str, x: torch.Tensor, count: int) -> str:
    value, at = _value_and_node(x)
    return (
        f"lucid_fx.{op}: {value}{at} cannot enter the int8 grid: it holds NaN or ±inf in {count} of its {x.numel()} "
        "elements, which no int8 code represents (they would come back as finite numbers). Clean the input (e.g. "
        "torch.nan_to_num(x)), or keep the part of the model that produces it in float "
        "(QConfigMapping().set_module_name(name, None))"
    )


# (op, generated code, line) -> the message of the asynchronous check, which must exist before the
# check runs: finding the node costs ~9 us (measured, ResNet-like graph), a lookup here well under 1.
_ASYNC_MESSAGES: Dict[tuple, str] = {}
# CUDA's _assert_async copies its message into a fixed 256-byte buffer (and refuses a longer one).
ASYNC_MESSAGE_BYTES = 250


def _short_nonfinite_message(op: str, x: torch.Tensor) -> str:
    value, at = _value_and_node(x)
    text = f"lucid_fx.{op}: NaN or ±inf in {value}{at}; clean it (torch.nan_to_num) or keep that part float"
    return text.encode()[:ASYNC_MESSAGE_BYTES].decode(errors="ignore")


def _async_message(op: str, x: torch.Tensor) -> str:
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith("<eval_with_key>"):
        frame = frame.f_back
    if frame is None:
        return _short_nonfinite_message(op, x)
    key = (op, frame.f_code, frame.f_lineno)
    if key not in _ASYNC_MESSAGES:
        if len(_ASYNC_MESSAGES) >= 1024:
            _ASYNC_MESSAGES.clear()
        _ASYNC_MESSAGES[key] = _short_nonfinite_message(op, x)
    return _ASYNC_MESSAGES[key]


def require_finite(op: str, x: torch.Tensor) -> None:
    """Raise unless every element of float ``x`` is finite: one ``aminmax`` pass (min and max are
    both finite iff all elements are). On CUDA the test is ``torch._assert_async``: no host sync,
    the error surfaces as a device-side assert, with a shorter message and no count."""
    if not x.is_floating_point() or x.numel() == 0:
        return
    lo, hi = torch.aminmax(x)
    if checks.is_async(x):
        torch._assert_async(torch.isfinite(lo) & torch.isfinite(hi), _async_message(op, x))
    elif not (math.isfinite(lo.item()) and math.isfinite(hi.item())):
        refuse_nonfinite(op, x)


def assert_finite_flag(op: str, x: torch.Tensor, ok: torch.Tensor) -> None:
    """Raise unless ``ok``, a kernel's own finiteness test of ``x`` (one element, zero where it met NaN or
    ±inf), is nonzero; on CUDA through ``torch._assert_async``, as :func:`require_finite`."""
    if checks.is_async(x):
        torch._assert_async(ok, _async_message(op, x))
    elif not ok.item():
        refuse_nonfinite(op, x)


def refuse_nonfinite(op: str, x: torch.Tensor) -> None:
    """Raise, counting them, if ``x`` holds NaN or ±inf (a second pass, taken only when a cheaper
    test has already seen something non-finite)."""
    count = int(x.numel() - torch.isfinite(x).sum())
    if count:
        raise checks.KernelInputError(_nonfinite_message(op, x, count))
