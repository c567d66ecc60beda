"""Merge rules: how each observer class combines its statistics across processes.

A rule is ``merge(observer, comm)``; ``comm`` offers ``min``, ``max`` and ``sum``, each taking a
tensor and returning the element-wise reduction over every process (the input is left as it
is). The rule writes the merged statistics back into the observer's buffers, so after
``sync_observers`` every process holds the same observers. The table maps an observer class to
its rule; a subclass uses the rule of its nearest listed base.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.histogram import HistogramObserver, _rebin
from lucid_fx.quantization.observers import (
    FixedQParamsObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
    PlaceholderObserver,
)

__all__ = ["MERGE_RULES", "MergeRule"]

MergeRule = Callable[..., None]


def merge_nothing(observer, comm) -> None:  # fixed qparams, placeholders: no statistics to merge
    return None


def merge_min_max(observer, comm) -> None:  # min of mins, max of maxes; +inf/-inf sentinels are neutral
    observer.min_val.copy_(comm.min(observer.min_val))
    observer.max_val.copy_(comm.max(observer.max_val))
    observer.nonfinite_count.copy_(comm.sum(observer.nonfinite_count))


def _channels(observer, comm) -> int:
    """The channel count every process agrees on (0: nobody saw data); a process that saw no data
    takes it from the others."""
    mine = observer.min_val.numel()
    device = observer.min_val.device
    most = int(comm.max(torch.tensor([mine], device=device)))
    fewest = int(comm.min(torch.tensor([mine if mine else most], device=device)))
    if most != fewest:
        raise ValueError(
            f"{observer.observer_name}: processes saw different channel counts ({fewest} and {most}) on "
            f"axis {observer.ch_axis}; every process must calibrate the same model on data of the same layout"
        )
    if mine == 0 and most:
        observer.min_val.resize_(most).fill_(float("inf"))
        observer.max_val.resize_(most).fill_(float("-inf"))
    return most


def merge_per_channel(observer, comm) -> None:  # per channel: min of mins, max of maxes
    if _channels(observer, comm):
        merge_min_max(observer, comm)
    else:
        observer.nonfinite_count.copy_(comm.sum(observer.nonfinite_count))


def _mean_over_seen(observer, comm, seen: bool) -> None:
    """Mean of the processes' moving averages, over the processes that saw data. Taken as
    ``ref + mean(v - ref)`` with ``ref`` the smallest of them, so equal inputs (weights, which
    every process shares) come back bit for bit."""
    device = observer.min_val.device
    count = comm.sum(torch.tensor(1.0 if seen else 0.0, device=device))
    if float(count) > 0:
        for name in ("min_val", "max_val"):
            value = getattr(observer, name)
            ref = comm.min(value if seen else torch.full_like(value, float("inf")))
            diff = (value - ref) if seen else torch.zeros_like(value)
            diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
            value.copy_(ref + comm.sum(diff) / count)
    observer.nonfinite_count.copy_(comm.sum(observer.nonfinite_count))


def merge_moving_average(observer, comm) -> None:  # mean of the ranks' moving averages (see docs)
    _mean_over_seen(observer, comm, observer.has_data)


def merge_moving_average_per_channel(observer, comm) -> None:  # per channel, as above
    seen = observer.has_data
    if _channels(observer, comm):
        _mean_over_seen(observer, comm, seen)
    else:
        observer.nonfinite_count.copy_(comm.sum(observer.nonfinite_count))


def merge_histogram(observer, comm) -> None:  # common range = global [min, max]; rebin; sum
    seen = observer.has_data
    lo = float(comm.min(observer.min_val.double()))
    hi = float(comm.max(observer.max_val.double()))
    hist = observer.histogram
    if not seen:
        local = torch.zeros_like(hist)
    elif lo == hi:
        local = hist.clone()  # one point everywhere: every process already holds it in bin 0
    else:
        local = _rebin(hist.cpu(), observer.min_val.item(), observer.max_val.item(), lo, hi).to(hist)
    hist.copy_(comm.sum(local))
    if lo <= hi:  # someone saw data
        observer.min_val.fill_(lo)
        observer.max_val.fill_(hi)
    observer.nonfinite_count.copy_(comm.sum(observer.nonfinite_count))


def merge_fake_quantize(module, comm) -> None:  # merge its observer, then refresh the stored qparams
    observer = module.activation_post_process
    rule_for(type(observer))(observer, comm)
    if getattr(observer, "has_data", True):
        module._store_qparams(*observer.calculate_qparams())


# observer class -> merge rule (a later registration replaces an entry)
MERGE_RULES: Dict[type, MergeRule] = {
    MinMaxObserver: merge_min_max,  # exact
    PerChannelMinMaxObserver: merge_per_channel,  # exact
    HistogramObserver: merge_histogram,  # within rebinning error
    MovingAverageMinMaxObserver: merge_moving_average,  # mean of moving averages
    MovingAveragePerChannelMinMaxObserver: merge_moving_average_per_channel,  # mean, per channel
    FixedQParamsObserver: merge_nothing,  # constants
    PlaceholderObserver: merge_nothing,  # and NoopObserver: no statistics
    FakeQuantize: merge_fake_quantize,  # QAT: through its observer
}


def rule_for(cls: type, table: Dict[type, MergeRule] = MERGE_RULES) -> MergeRule:
    """The rule of ``cls`` or of its nearest base in ``table``; ``KeyError`` if none."""
    for base in cls.__mro__:
        if base in table:
            return table[base]
    raise KeyError(cls)
