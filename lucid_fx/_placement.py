"""The placement vocabulary: where a prepared node's value is computed after convert, and why
(:class:`Placement`), and what convert reports (:class:`ConvertReport`). Core types: lowering
rules, passes and every report read them. The reader :func:`lucid_fx.placement.placements` is a
verb; it lives in ``lucid_fx/placement.py``, which re-exports these names.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Tuple

__all__ = ["Runs", "Placement", "INT8_RUNS", "ConvertReport", "FloatRegion"]


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


class FloatRegion(NamedTuple):
    """A part of a converted model that runs in float: ``kind`` is ``"module"`` (the untraceable-module
    fallback kept it float), ``"leaf module"`` or ``"function"`` (a call lucid_fx cannot see into: a
    leaf module, an autowrapped or leaf function), ``"op"`` (no rule quantizes or lowers it) or
    ``"kept"`` (kept float by the user's QConfig or registry, or by a policy: an in-place change the
    caller sees, an attention mask, an int32 accumulator that could overflow)."""

    kind: str
    name: str  # a node (qualified by its graph's module path) or a module path
    why: str
    flops: int  # the matrix FLOPs that run in float there


_LABELS = {"module": "float module", "leaf module": "float leaf module", "function": "float function", "op": "float op", "kept": "kept float"}
_NO_RULE = ("no lowering rule", "no observer rule", "no observer decision")
#: Float regions of one kind and reason this many or more are one line of the report, naming the first few.
GROUPED = 6


@dataclass
class ConvertReport:
    """What convert did: where each prepared node runs and why (:class:`lucid_fx.placement.Placement`),
    and, read from that, which nodes became int8 (a fused group by its last node), every region that
    runs in float with its reason (:attr:`float_regions`) and the share of matrix FLOPs that runs in
    int8 (:attr:`int8_flop_share`). Nodes of a model prepared in parts are qualified by module path."""

    backend: str
    placements: Dict[str, Placement] = field(default_factory=dict)  # prepared node -> where it runs, why
    flops: Dict[str, int] = field(default_factory=dict)  # prepared node -> matrix FLOPs, from prepare's shapes
    opaque: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # node -> ("function"/"leaf module", what it calls)
    float_modules: Dict[str, str] = field(default_factory=dict)  # module path -> why the fallback kept it float
    module_flops: Dict[str, int] = field(default_factory=dict)  # float module -> FLOPs of its own code, measured at prepare
    folded_flops: int = 0  # matrix FLOPs prepare computed once into constants (fold_constants): not run per call

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

    @property
    def float_regions(self) -> List[FloatRegion]:
        """Every region that runs in float, modules the fallback kept float first."""
        regions = [FloatRegion("module", path or "<root>", why, self.module_flops.get(path, 0)) for path, why in self.float_modules.items()]
        for name, p in self._groups().items():
            kind, called = self.opaque.get(name, ("", ""))
            if p.runs is Runs.NOT_TENSOR and name not in self.opaque and self.flops.get(name):  # torch.lstm's tuple
                regions.append(FloatRegion("op", name, f"{p.why}, a tuple of outputs: runs in float", self.flops[name]))
            if p.runs is not Runs.FLOAT or kind and called in self.float_modules:  # listed above, with its trace error
                continue
            kind = kind or ("op" if p.why.startswith(_NO_RULE) else "kept")
            regions.append(FloatRegion(kind, name, p.why, sum(self.flops.get(m, 0) for m in p.members)))
        for name, (kind, called) in self.opaque.items():  # a call whose outputs are a tuple (nn.LSTM's), no float tensor
            placed = self.placements.get(name)
            if (placed is None or placed.runs is Runs.NOT_TENSOR) and called not in self.float_modules:
                regions.append(FloatRegion(kind, name, f"no lowering rule for {called}", self.flops.get(name, 0)))
        return regions

    @property
    def total_flops(self) -> int:
        """Matrix FLOPs of one run on prepare's example inputs: graphs' ops and float modules' own code."""
        return sum(self.flops.values()) + sum(self.module_flops.values())

    @property
    def int8_flops(self) -> int:
        return sum(f for name, f in self.flops.items() if name in self.placements and self.placements[name].runs in INT8_RUNS)

    @property
    def int8_flop_share(self) -> Optional[float]:
        """int8 FLOPs / all matrix FLOPs, None when none were counted (prepare had no example inputs)."""
        total = self.total_flops
        return self.int8_flops / total if total else None

    def _share_line(self) -> str:
        share, total = self.int8_flop_share, self.total_flops
        if share is None:
            return "int8 FLOPs: none counted (no linear, conv, matmul or attention with shapes recorded at prepare)"
        floats = sorted((r for r in self.float_regions if r.flops), key=lambda r: -r.flops)
        where = ", ".join(f"{r.name} {100.0 * r.flops / total:.1f}%" for r in floats[:3]) + (", ..." if len(floats) > 3 else "")
        folded = f"; {_flops_text(self.folded_flops)} computed once at prepare, into constants" if self.folded_flops else ""
        return f"int8 FLOPs: {100.0 * share:.1f}% of {_flops_text(total)}" + (f" (float: {where})" if where else "") + folded

    def __str__(self) -> str:
        kernels, floats = len(self.lowered), self.float_ops
        lines = [f"backend {self.backend}: {_count(kernels, 'int8 kernel')}, {_count(len(floats), 'op')} in float"]
        if self.backend != "reference":  # the simulated model runs every op in float
            lines.append(self._share_line())
        total = self.total_flops
        regions = self.float_regions
        many = {key for key, n in Counter((r.kind, r.why) for r in regions if r.kind != "module").items() if n >= GROUPED}
        written = set()
        for r in regions:
            key = (r.kind, r.why)
            if key in many:  # one line for a policy's hundreds of nodes (an unrolled scan's)
                if key not in written:
                    written.add(key)
                    group = [g for g in regions if (g.kind, g.why) == key]
                    flops = sum(g.flops for g in group)
                    names = ", ".join(g.name for g in group[:GROUPED - 1]) + f", ... ({len(group)} nodes)"
                    share = f", {100.0 * flops / total:.1f}% of FLOPs" if flops and total else ""
                    lines.append(f"  {_LABELS[r.kind]}: {names} ({r.why}{share})")
                continue
            share = f"{100.0 * r.flops / total:.1f}% of FLOPs" if r.flops and total else ""
            if r.kind == "module":  # "path (Class) at file:line `source`: error", as prepare's report says it
                cls, _, rest = r.why.partition(" at ")
                lines.append(f"  {_LABELS[r.kind]}: {r.name} ({cls}) at {rest}" + (f" [{share}]" if share else ""))
            else:
                lines.append(f"  {_LABELS[r.kind]}: {r.name} ({r.why}" + (f", {share})" if share else ")"))
        return "\n".join(lines)


def _flops_text(flops: int) -> str:
    for unit, size in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if flops >= size:
            return f"{flops / size:.3g} {unit}"
    return f"{flops} FLOP"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
