"""The placement vocabulary: where a prepared node's value is computed after convert, and why
(:class:`Placement`), and what convert reports (:class:`ConvertReport`). Core types: lowering
rules, passes and every report read them. The reader :func:`lucid_fx.placement.placements` is a
verb; it lives in ``lucid_fx/placement.py``, which re-exports these names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Tuple

__all__ = ["Runs", "Placement", "INT8_RUNS", "ConvertReport"]


class Runs(enum.Enum):
    """Where a prepared node's value is computed after convert."""

    KERNEL = "int8 kernel"  # an int8 kernel on codes: lucid_fx.linear, conv2d, add, softmax, ...
    TABLE = "table lookup"  # a 256-entry table from the input's codes to the output's (lucid_fx.lut)
    SHARED = "shared codes"  # the input's codes as they are (reshape, max_pool), or on a rescaled grid (x / 2)
    FLOAT = "float"  # a float op, between dequantize and quantize where its neighbours are int8
    NOT_TENSOR = "not a float tensor"  # shapes, integers, masks: nothing to quantize


#: The kinds whose output is integer codes.
INT8_RUNS = frozenset({Runs.KERNEL, Runs.TABLE, Runs.SHARED})


@dataclass(frozen=True)
class Placement:
    """Where a prepared node runs and why: the lowering rule key (``"conv2d+relu"``) for int8 kinds,
    the reason it stayed float otherwise. ``members`` are the prepared nodes computed together (a
    fused group, with any batch norm folded into it), the last one the node whose value comes out."""

    runs: Runs
    why: str
    members: Tuple[str, ...]

    @property
    def value(self) -> str:
        return self.members[-1]

    def __str__(self) -> str:
        return f"{self.runs.value} ({self.why})"


@dataclass
class ConvertReport:
    """What convert did: where each prepared node runs and why (:class:`lucid_fx.placement.Placement`),
    and, read from that, which nodes became int8 (a fused group by its last node) and which ran in float."""

    backend: str
    placements: Dict[str, Placement] = field(default_factory=dict)  # prepared node -> where it runs, why

    def _groups(self) -> Dict[str, Placement]:
        return {p.value: p for p in self.placements.values()}

    @property
    def lowered(self) -> Dict[str, str]:
        """Node (a group's last) -> the lowering rule key, for every int8 kernel, table or shared op."""
        return {name: p.why for name, p in self._groups().items() if p.runs in INT8_RUNS}

    @property
    def float_ops(self) -> Dict[str, str]:
        """Node (a group's last) -> why it runs in float: no rule, a rule that declined, or the QConfig."""
        return {name: p.why for name, p in self._groups().items() if p.runs is Runs.FLOAT}

    def __str__(self) -> str:
        kernels, floats = len(self.lowered), self.float_ops
        lines = [f"backend {self.backend}: {_count(kernels, 'int8 kernel')}, {_count(len(floats), 'op')} in float"]
        lines += [f"  float: {name} ({why})" for name, why in floats.items()]
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
