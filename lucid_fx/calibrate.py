"""calibrate: run data through a prepared model so its observers see real activations."""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional, TextIO

import torch
from torch import nn

from lucid_fx._progress import Progress
from lucid_fx._validate import require_prepared

__all__ = ["calibrate"]


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


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
                _call(prepared, batch)
                bar.step()
    finally:
        bar.close()
        prepared.train(was_training)
    if bar.count == 0:
        raise ValueError("calibrate: the calibration data was empty; pass at least one batch")
    return bar.count
