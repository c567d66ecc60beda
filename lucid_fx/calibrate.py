"""calibrate: run data through a prepared model so its observers see real activations."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Iterable, Optional, TextIO

import torch
from torch import nn

from lucid_fx import _meta
from lucid_fx._progress import Progress
from lucid_fx._validate import require_prepared

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
    try:
        total = len(data)  # type: ignore[arg-type]
    except TypeError:
        total = None
    bar = Progress("calibrate", total, stream or sys.stderr, progress)
    was_training = prepared.training
    prepared.eval()
    try:
        with torch.no_grad():
            for batch in data:
                try:
                    call_batch(prepared, batch)
                except TypeError as exc:
                    if not str(exc).startswith(("forward()", "forward: ")):
                        raise
                    raise _unfit(prepared, bar.count, exc) from exc
                except ValueError as exc:
                    if not str(exc).startswith("forward: "):  # a torch.export capture's shape check
                        raise
                    raise ValueError(f"calibrate: batch {bar.count}: {exc}") from exc
                bar.step()
    finally:
        bar.close()
        prepared.train(was_training)
    if bar.count == 0:
        raise ValueError("calibrate: the calibration data was empty; pass at least one batch")
    return bar.count
