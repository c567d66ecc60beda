"""Paired timing of two models on one batch, for the searches that choose between converted
models by speed (``precision="measured"``, ``target_sqnr_db``'s report)."""

from __future__ import annotations

import statistics
import time
from typing import Any, List, Tuple

import torch
from torch import nn

from lucid_fx.calibrate import call_batch

__all__ = ["paired_ms"]


def paired_ms(first: nn.Module, second: nn.Module, batch: Any, rounds: int = 9) -> Tuple[float, float]:
    """Median ms a call of each model on ``batch`` (a tensor, a tuple of positional inputs or a dict
    of keyword inputs), the two taking turns after two warm-up calls each (the second runs what the
    first one built); each sample lasts about 5 ms or more."""
    with torch.no_grad():
        for model in (first, second):
            call_batch(model, batch), call_batch(model, batch)
        start = time.perf_counter()
        call_batch(first, batch)
        calls = max(1, int(0.005 / max(time.perf_counter() - start, 1e-6)))
        samples: Tuple[List[float], List[float]] = ([], [])
        for _ in range(rounds):
            for model, out in zip((first, second), samples):
                start = time.perf_counter()
                for _ in range(calls):
                    call_batch(model, batch)
                out.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(samples[0]), statistics.median(samples[1])
