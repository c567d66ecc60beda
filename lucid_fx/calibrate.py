"""calibrate: run data through a prepared model so its observers see real activations."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Optional, TextIO

import torch
from torch import nn

from lucid_fx._validate import require_prepared

__all__ = ["calibrate"]


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _Progress:
    """A one-line text progress bar (no dependency), redrawn in place on a terminal."""

    def __init__(self, total: Optional[int], stream: TextIO, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.start = time.perf_counter()
        self.count = 0

    def step(self) -> None:
        self.count += 1
        if self.enabled:
            self._draw(end="\r")

    def close(self) -> None:
        if self.enabled:
            self._draw(end="\n")

    def _draw(self, end: str) -> None:
        rate = self.count / max(time.perf_counter() - self.start, 1e-9)
        if self.total:
            done = int(24 * self.count / self.total)
            bar = f"[{'#' * done}{'.' * (24 - done)}] {self.count}/{self.total}"
        else:
            bar = f"{self.count} batches"
        self.stream.write(f"calibrate {bar} {rate:.1f} batch/s{end}")
        self.stream.flush()


def calibrate(prepared: nn.Module, data: Iterable, *, progress: bool = True, stream: Optional[TextIO] = None) -> int:
    """Run every batch of ``data`` through ``prepared`` (eval mode, no grad); returns the number
    of batches. A batch is a tensor, a tuple/list of positional inputs, or a dict of keyword inputs.

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
    bar = _Progress(total, stream or sys.stderr, progress)
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
