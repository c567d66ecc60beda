"""sync_observers: merge observer statistics across the processes of a torch.distributed group.

Calibrate a prepared model on one shard of the data per process, then call
``sync_observers(prepared)`` on every process: afterwards each holds the statistics of all the
data, so converting on any of them gives one model. How each observer class merges is a rule
in :data:`lucid_fx.rules.merges.MERGE_RULES`:

- ``MinMaxObserver``, ``PerChannelMinMaxObserver``: min of mins, max of maxes. Exact: the result
  equals calibrating on all the data in one process. A process that saw no data holds the
  ``+inf``/``-inf`` sentinels (or an empty per-channel range), which the reduction ignores.
- ``HistogramObserver``: every process rebins its histogram onto the global ``[min, max]``, then
  the histograms are summed. Within rebinning error of one process: a single process also
  rebins, but at other moments (whenever its range grows), so bin counts differ slightly.
- ``MovingAverage*MinMaxObserver``: a moving average has no exact merge (it depends on the
  order of batches). The merged range is the mean of the processes' moving averages, over the
  processes that saw data: each one estimates the same typical per-batch range, and with equal
  shards (``DistributedSampler``) they are equally good estimates. Taking the min of mins and
  max of maxes instead would track the most extreme batch, which is what a moving average is
  chosen to avoid.
- ``FixedQParamsObserver``, ``PlaceholderObserver``, ``NoopObserver``: nothing to merge.
- ``FakeQuantize``: its observer is merged, then its stored qparams are refreshed.

Counters of skipped NaN/inf values are summed. Weight observers see the same weights on every
process, so merging them changes nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.observers import ObserverBase
from lucid_fx.rules.merges import MERGE_RULES, rule_for

__all__ = ["sync_observers", "register_observer_merge"]


def register_observer_merge(observer_cls: type, merge: Callable[..., None]) -> Callable[..., None]:
    """Say how ``observer_cls`` (and its subclasses) merge statistics in :func:`sync_observers`.

    ``merge(observer, comm)`` reads the observer's local statistics, combines them with
    ``comm.min(t)``, ``comm.max(t)`` or ``comm.sum(t)`` (each returns the element-wise reduction
    over all processes) and writes the result back. Returns ``merge``.

    >>> import torch, lucid_fx
    >>> class MaxAbsObserver(lucid_fx.quantization.MinMaxObserver):
    ...     pass
    >>> def merge_max_abs(observer, comm):
    ...     observer.max_val.copy_(comm.max(observer.max_val))
    ...     observer.min_val.copy_(comm.min(observer.min_val))
    >>> lucid_fx.register_observer_merge(MaxAbsObserver, merge_max_abs) is merge_max_abs
    True
    """
    if not isinstance(observer_cls, type) or not issubclass(observer_cls, (ObserverBase, FakeQuantize)):
        raise TypeError(f"register_observer_merge: expected an ObserverBase or FakeQuantize subclass, got {observer_cls!r}")
    if not callable(merge):
        raise TypeError(f"register_observer_merge: merge must be callable as merge(observer, comm), got {merge!r}")
    MERGE_RULES[observer_cls] = merge
    return merge


class _Collective:
    """All-reduce over a process group, on a copy (the caller's tensor is left as it is)."""

    def __init__(self, dist: Any, group: Any) -> None:
        self.dist, self.group = dist, group

    def _reduce(self, tensor: torch.Tensor, op: Any) -> torch.Tensor:
        out = tensor.detach().clone()
        self.dist.all_reduce(out, op=op, group=self.group)
        return out

    def min(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, self.dist.ReduceOp.MIN)

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, self.dist.ReduceOp.MAX)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, self.dist.ReduceOp.SUM)


def observers_of(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """Every observer (and FakeQuantize) in ``model``, in ``named_modules`` order; the observer
    inside a FakeQuantize is merged through it, so it is not listed on its own."""
    inside: set = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, FakeQuantize):
            inside.add(id(module.activation_post_process))
        if isinstance(module, (ObserverBase, FakeQuantize)):
            yield name, module


def merge_observers(model: nn.Module, comm: Any) -> int:
    """Merge every observer of ``model`` through ``comm`` (min/max/sum); returns how many."""
    found = list(observers_of(model))
    rules = []
    for name, observer in found:
        # A FakeQuantize merges through its inner observer: that one needs a rule too.
        inner = getattr(observer, "activation_post_process", None)
        for what in (observer, inner) if isinstance(inner, nn.Module) else (observer,):
            try:
                rule = rule_for(type(what))
            except KeyError:
                raise TypeError(
                    f"sync_observers: observer {name!r}" + (" wraps" if what is inner else " is") + f" a "
                    f"{type(what).__qualname__}, which has no merge rule; register one with "
                    "lucid_fx.register_observer_merge(cls, merge)"
                ) from None
            if what is observer:
                rules.append(rule)
    for rule, (_, observer) in zip(rules, found):
        with torch.no_grad():
            rule(observer, comm)
    return len(found)


def _check_same_observers(dist: Any, group: Any, model: nn.Module) -> None:
    mine = [f"{name} ({type(obs).__qualname__})" for name, obs in observers_of(model)]
    every: List[Optional[List[str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, theirs in enumerate(every):
        if theirs == every[0]:
            continue
        at = next((i for i, (a, b) in enumerate(zip(every[0], theirs)) if a != b), min(len(every[0]), len(theirs)))
        first = every[0][at] if at < len(every[0]) else "nothing"
        other = theirs[at] if at < len(theirs) else "nothing"
        raise ValueError(
            f"sync_observers: processes hold different observers: observer #{at} is {first} on rank 0 "
            f"but {other} on rank {rank} ({len(every[0])} vs {len(theirs)} observers); prepare the same "
            "model with the same QConfigMapping on every process"
        )


def sync_observers(prepared: nn.Module, group: Any = None) -> int:
    """Merge the statistics of every observer of ``prepared`` across the processes of ``group``
    (default: the whole world), in place; call it on every process after each has calibrated on
    its shard. Returns the number of observers merged.

    After it, every process holds the same observers, so ``lucid_fx.convert`` gives the same
    model on each; for MinMax observers (the default weights and ``minmax_qconfig``) it is the
    model calibrating on all the data in one process would give, exactly. See the module
    docstring for how each observer class merges.

    Args:
        prepared: a model returned by :func:`lucid_fx.prepare` (or ``prepare_qat``).
        group: a ``torch.distributed`` process group (default: the world group).

    Example (each process of ``torchrun``; not run here)::

        dist.init_process_group("gloo")
        prepared = lucid_fx.prepare(model, example_inputs=(x,))
        lucid_fx.calibrate(prepared, my_shard_of_batches)
        lucid_fx.sync_observers(prepared)
        quantized = lucid_fx.convert(prepared)   # the same on every rank

    Without a process group it says what to do:

    >>> import torch, lucid_fx
    >>> prepared = lucid_fx.prepare(torch.nn.Linear(2, 2).eval(), example_inputs=(torch.randn(1, 2),))
    >>> lucid_fx.sync_observers(prepared)
    Traceback (most recent call last):
    ...
    RuntimeError: sync_observers: torch.distributed is not initialized; call torch.distributed.init_process_group(...) on every process first, or pass group=
    """
    if not isinstance(prepared, nn.Module):
        raise TypeError(f"sync_observers expects a prepared nn.Module, got {type(prepared).__name__}")
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("sync_observers: this build of torch has no torch.distributed")
    if group is None and not dist.is_initialized():
        raise RuntimeError(
            "sync_observers: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group(...) on every process first, or pass group="
        )
    _check_same_observers(dist, group, prepared)
    return merge_observers(prepared, _Collective(dist, group))
