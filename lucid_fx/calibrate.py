"""calibrate: run data through a prepared model so its observers see real activations."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Iterable, List, Optional, TextIO

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._describe import describe_value, node_inputs
from lucid_fx._capture import graph_inputs
from lucid_fx._progress import Progress
from lucid_fx._validate import require_prepared
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.observer_base import ObserverBase

__all__ = ["calibrate"]


def call_batch(model: nn.Module, batch: Any) -> Any:
    """``model`` on one batch: a dict of keyword inputs, a tuple/list of positional ones, or a tensor."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _unfit(prepared: nn.Module, index: int, exc: TypeError) -> TypeError:
    """The error for a batch that does not bind to the prepared model's inputs (``forward() takes ...``)."""
    names = ", ".join(inspect.signature(prepared.forward).parameters)
    if str(exc).startswith("forward: "):  # a torch.export capture's input check says what to pass
        return TypeError(f"calibrate: batch {index} does not fit the prepared model's inputs ({names}): {exc}")
    how = getattr(getattr(prepared, "meta", {}).get(_meta.TRACE), "capture", "fx")
    hint = ("prepare captured this model with torch.export, which takes the inputs it was given, in the order "
            "and by the names it was given them: pass each batch as a dict of those names, or as a tuple in that "
            "order" if how == "export" else
            "pass each batch as the example inputs were passed to prepare")
    return TypeError(f"calibrate: batch {index} does not fit the prepared model's inputs ({names}): {exc}; {hint}")


#: The errors a failed batch is given again with its index, its inputs and the node that raised (same type).
_NAMED_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


def _observed_state(prepared: nn.Module) -> List[torch.Tensor]:
    """The buffers a batch changes: every observer's and fake-quantize module's."""
    return [b for m in prepared.modules() if isinstance(m, (ObserverBase, FakeQuantize)) for b in m.buffers(recurse=False)]


def _restore(buffers: List[torch.Tensor], saved: List[torch.Tensor]) -> None:
    for buffer, value in zip(buffers, saved):
        buffer.resize_(value.shape).copy_(value)


class _FindFailure(fx.Interpreter):
    """Runs a prepared graph to the node that raises, and says which it was and what it was given."""

    failed = ""

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            where = f"module {n.target!r}" if n.op == "call_module" else getattr(n.target, "__name__", str(n.target))
            self.failed = f" at node {n.name!r} ({where}) on ({node_inputs(self, n)})"
            raise


def _failure(prepared: nn.Module, index: int, batch: Any, exc: Exception) -> Exception:
    """``exc`` again (same type) naming the batch, the node that raised (where ``prepared`` is one graph) and
    what prepare's example inputs were."""
    node, example = "", ""
    if isinstance(prepared, fx.GraphModule):
        holders = [n for n in prepared.graph.nodes if n.op == "placeholder"]
        shapes = [n.meta.get(_meta.TENSOR_META) for n in holders]
        if shapes and all(getattr(m, "shape", None) is not None for m in shapes):
            example = "; prepare's example inputs were (" + ", ".join(
                f"Tensor{list(m.shape)} {str(m.dtype).removeprefix('torch.')}" for m in shapes) + ")"
        finder = _FindFailure(prepared)
        try:
            args = graph_inputs("calibrate", prepared, None, batch) if isinstance(batch, dict) else (
                tuple(batch) if isinstance(batch, (tuple, list)) else (batch,))
            finder.run(*args)
        except Exception:  # noqa: BLE001 - the run is only to find the node; its error is exc's
            node = finder.failed
    first = str(exc).splitlines()[0] if str(exc) else ""
    return type(exc)(f"calibrate: batch {index} ({describe_value(batch)}) raised {type(exc).__name__}{node}: {first}"
                     f"{example}. The observers are as they were before this batch: fix or drop it and calibrate again")


def calibrate(prepared: nn.Module, data: Iterable, *, progress: Optional[bool] = None, stream: Optional[TextIO] = None) -> int:
    """Run every batch of ``data`` through ``prepared`` (eval mode, no grad); returns the number
    of batches. A batch is a tensor, a tuple/list of positional inputs, or a dict of keyword inputs.

    ``progress``: ``None`` draws a bar on ``stream`` (default stderr) when it is a terminal and
    writes nothing otherwise; ``True`` also writes plain lines to a file or pipe (no ``\\r``
    frames); ``False`` writes nothing.

    >>> import torch, lucid_fx
    >>> prepared = lucid_fx.prepare(torch.nn.Linear(3, 3).eval(), example_inputs=(torch.randn(1, 3),))
    >>> lucid_fx.calibrate(prepared, [torch.randn(2, 3) for _ in range(4)], progress=False)
    4
    """
    require_prepared("calibrate", prepared)
    if isinstance(data, torch.Tensor):
        raise TypeError(f"calibrate: data is one tensor ({describe_value(data)}), which would run row by row; pass a list "
                        "of batches: [x] for one batch, or list(x.split(n)) for batches of n")
    try:
        total = len(data)  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar = Progress("calibrate", total, stream or sys.stderr, progress)
    was_training = prepared.training
    prepared.eval()
    state = _observed_state(prepared)
    observed = {id(b) for b in state}
    model_state = [b for b in prepared.buffers() if id(b) not in observed]
    before = [b.clone() for b in model_state]  # what the model's own forward writes (a counter, a running mean)
    try:
        with torch.no_grad():
            for batch in data:
                saved = [b.clone() for b in state]  # a batch that raises leaves the observers as they were
                try:
                    call_batch(prepared, batch)
                except Exception as exc:
                    _restore(state, saved)
                    if isinstance(exc, TypeError) and str(exc).startswith(("forward()", "forward: ")):
                        raise _unfit(prepared, bar.count, exc) from exc
                    if isinstance(exc, ValueError) and str(exc).startswith("forward: "):  # torch.export's shape check
                        raise ValueError(f"calibrate: batch {bar.count}: {exc}") from exc
                    if type(exc) not in _NAMED_ERRORS:
                        raise
                    failure = _failure(prepared, bar.count, batch, exc)
                    _restore(state, saved)  # the search for the node ran the batch again
                    raise failure from exc
                bar.step()
    finally:
        _restore(model_state, before)  # calibration observes: the model converts from the state prepare started from
        bar.close()
        prepared.train(was_training)
    if bar.count == 0:
        raise ValueError("calibrate: the calibration data was empty; pass at least one batch")
    return bar.count
