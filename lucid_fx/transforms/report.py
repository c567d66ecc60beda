"""TransformReport: what a float-to-float transform changed, what it left alone and why, and how
far the transformed float model moved from the original."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["TransformReport", "output_sqnr_db", "attach", "require_eval"]

REPORTS_ATTR = "lucid_fx_transforms"


@dataclass
class TransformReport:
    """``transform`` (``"equalize"``, ``"correct_bias"``, ``"smooth_quant"``); ``changed``: one
    line per change; ``skipped``: candidates left alone, each with why; ``float_sqnr_db``: the
    transformed float model's output against the original's on the batch the transform recorded
    (``inf`` when equal; a bias correction moves the float model on purpose)."""

    transform: str
    changed: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    float_sqnr_db: Optional[float] = None

    def __str__(self) -> str:
        moved = "" if self.float_sqnr_db is None else f"; float output vs the original: {self.float_sqnr_db:.1f} dB SQNR"
        lines = [f"{self.transform}: {len(self.changed)} changed, {len(self.skipped)} skipped{moved}"]
        lines += [f"  changed: {line}" for line in self.changed]
        lines += [f"  skipped: {line}" for line in self.skipped]
        return "\n".join(lines)


def _flat(value) -> torch.Tensor:
    leaves = [t.detach().float().flatten() for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return torch.cat(leaves) if leaves else torch.zeros(0)


def output_sqnr_db(reference, test) -> float:
    """SQNR in dB of ``test`` against ``reference`` (any nesting of tensors); ``inf`` when equal."""
    ref, out = _flat(reference), _flat(test)
    noise = (ref - out).pow(2).mean()
    if noise == 0:
        return math.inf
    return float(10 * torch.log10(ref.pow(2).mean() / noise))


def attach(model: nn.Module, report: TransformReport) -> nn.Module:
    """Append ``report`` to ``model.lucid_fx_transforms`` (the reports of every transform applied)."""
    object.__setattr__(model, REPORTS_ATTR, list(getattr(model, REPORTS_ATTR, [])) + [report])
    return model


def require_eval(model: nn.Module, transform: str) -> None:
    """Raise ``ValueError`` naming the first module of ``model`` in training mode: the transforms
    read batch-norm statistics and fold them, which a training-mode batch norm does not use."""
    for name, module in model.named_modules():
        if module.training:
            where = f"module {name!r} ({type(module).__name__})" if name else f"the model ({type(module).__name__})"
            raise ValueError(f"{transform}: {where} is in training mode; call model.eval() first")
