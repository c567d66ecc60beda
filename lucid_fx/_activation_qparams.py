"""A converted graph's activation qparams as state, and the guard that keeps ``load_state_dict`` honest.

Convert writes each activation's scale and zero point into the generated code as literals (the
kernels read Python numbers, not tensors: no ``.item()`` per op). So they were in no
``state_dict``, and loading the state of a model converted from another calibration reported
every key matched while the int8 weights of one calibration ran with the activation grids of
the other. Now every converted graph holds them as a buffer too, :data:`BUFFER`: one row per
node that outputs codes, in graph order, of ``(scale, zero_point, quant_min, quant_max)`` as
int64, the scale by the bits of its float64 value (exact, and ``.half()`` or ``.to(dtype)``, which
cast floating buffers, leave it alone). A ``load_state_dict`` pre-hook refuses a state whose rows differ,
naming the first node that differs; the code cannot follow a loaded grid, so refusing is the
only honest answer.
"""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.quantization.dtypes import to_qdtype

__all__ = ["BUFFER", "record_activation_qparams", "attach_guard", "without_guard", "scales"]

BUFFER = "_lucid_activation_qparams"
_GRID = re.compile(r".*\[(-?\d+),\s*(-?\d+)\]")  # grids made for a kernel are named "qint[-64,63]"


def _grid(name: str) -> Tuple[int, int]:
    found = _GRID.fullmatch(name)
    if found:
        return int(found.group(1)), int(found.group(2))
    qdtype = to_qdtype(name)
    return qdtype.quant_min, qdtype.quant_max


def _coded_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return [node for node in gm.graph.nodes if _meta.QPARAMS in node.meta]


def record_activation_qparams(gm: fx.GraphModule) -> fx.GraphModule:
    """Register :data:`BUFFER` on converted ``gm`` from its nodes' ``[QPARAMS]`` and guard its loads."""
    qparams = [n.meta[_meta.QPARAMS] for n in _coded_nodes(gm)]
    rows = torch.zeros(len(qparams), 4, dtype=torch.int64)
    rows[:, 0] = torch.tensor([scale for scale, _, _ in qparams], dtype=torch.float64).view(torch.int64)
    rows[:, 1:] = torch.tensor([(zp, *_grid(grid)) for _, zp, grid in qparams], dtype=torch.int64).reshape(-1, 3)
    device = next((t.device for t in gm.parameters()), None) or next((t.device for t in gm.buffers()), None)
    gm.register_buffer(BUFFER, rows if device is None else rows.to(device))  # beside the rest of the state
    attach_guard(gm)
    return gm


def attach_guard(gm: fx.GraphModule) -> None:
    """Register the load_state_dict pre-hook on ``gm`` (once). ``with_module=True`` makes the hook
    hold the module weakly and lets ``copy.deepcopy`` rebind it to the copy."""
    if BUFFER in gm._buffers and not any(_is_guard(h) for h in gm._load_state_dict_pre_hooks.values()):
        gm._register_load_state_dict_pre_hook(_refuse_other_calibration, with_module=True)


def _is_guard(hook) -> bool:
    return getattr(hook, "hook", hook) is _refuse_other_calibration


def without_guard(hooks) -> list:
    """The hooks of a module's hook table other than the guard: lucid_fx.save writes no code, and
    lucid_fx.load attaches the guard again to every graph that holds :data:`BUFFER`."""
    return [hook for hook in (hooks.values() if isinstance(hooks, dict) else hooks) if not _is_guard(hook)]


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float64 scales of :data:`BUFFER` rows."""
    return rows[:, 0].contiguous().view(torch.float64)


def _describe(row: torch.Tensor) -> str:
    scale = scales(row.reshape(1, 4)).item()
    _, zp, qmin, qmax = row.tolist()
    return f"scale {scale:.8g}, zero_point {zp}, grid [{qmin}, {qmax}]"


def _node_label(gm: fx.GraphModule, index: int) -> str:
    nodes = _coded_nodes(gm)
    if index >= len(nodes):
        return f"entry {index}"
    node = nodes[index]
    source = node.meta.get(_meta.SOURCE)
    return f"node {node.name!r}" + (f" (the value of {source!r})" if source and source != node.name else "")


_FIX = ("The activation qparams are constants of the converted model's code, so its state cannot change them: "
        "convert from the same calibration (load the state into the prepared model, then convert), or save and "
        "load the whole converted model with lucid_fx.save / lucid_fx.load")


def _first_difference(mine: torch.Tensor, theirs: torch.Tensor) -> Optional[int]:
    differs = (mine != theirs).any(dim=1).nonzero()
    return int(differs[0]) if differs.numel() else None


def _refuse_other_calibration(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    theirs = state_dict.get(prefix + BUFFER)
    mine = module._buffers.get(BUFFER)
    if theirs is None or mine is None:
        return  # a strict load reports the missing key itself
    where = f" of {prefix[:-1]!r}" if prefix else ""
    if not isinstance(theirs, torch.Tensor) or tuple(theirs.shape) != tuple(mine.shape):
        shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
        raise ValueError(
            f"load_state_dict: the state's {BUFFER!r}{where} has shape {shape}, this converted model "
            f"{tuple(mine.shape)}: it comes from a model converted differently. {_FIX}"
        )
    if theirs.dtype != mine.dtype:
        raise ValueError(f"load_state_dict: the state's {BUFFER!r}{where} is {theirs.dtype}, not {mine.dtype}. {_FIX}")
    theirs = theirs.detach().to(mine.device)
    index = _first_difference(mine, theirs)
    if index is not None:
        raise ValueError(
            f"load_state_dict: the state was converted from another calibration{where}: "
            f"{_node_label(module, index)} has {_describe(mine[index])} in this model and {_describe(theirs[index])} "
            f"in the state. {_FIX}"
        )
