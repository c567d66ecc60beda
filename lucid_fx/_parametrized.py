"""Parametrized modules (QAT's fake-quantized weights) in the save format.

``torch.nn.utils.parametrize`` swaps a module's class for a generated subclass and moves the
tensor into ``module.parametrizations[name].original``. The file holds the module as its base
class, with each parametrized tensor's original and its parametrization modules in order; load
builds the base module and registers the same parametrizations again (``unsafe=True``, as
prepare_qat does, so nothing runs a fake quant and moves its statistics).
"""

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["base_class", "encode", "decode", "CONTAINER"]

CONTAINER = "parametrizations"  # the child that holds the parametrizations


def base_class(module: nn.Module) -> type:
    """The class a parametrized module had before ``register_parametrization`` replaced it."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def encode(module: nn.Module, path: str, encode_child: Callable[[nn.Module, str], Any]) -> Optional[Dict[str, Any]]:
    """``{tensor name: {original, requires_grad, modules}}``, or None for a plain module."""
    if not parametrize.is_parametrized(module):
        return None
    records = {}
    for name, chain in getattr(module, CONTAINER).items():
        original = chain.original
        records[name] = {
            "original": original.detach(),
            "requires_grad": original.requires_grad,
            "is_parameter": isinstance(original, nn.Parameter),
            "modules": [encode_child(p, f"{path}.{CONTAINER}.{name}.{i}" if path else f"{CONTAINER}.{name}.{i}")
                        for i, p in enumerate(chain)],
        }
    return records


def decode(module: nn.Module, records: Dict[str, Any], path: str, decode_child: Callable[[Any, str], nn.Module]) -> None:
    """Register the parametrizations of ``records`` on ``module`` (built as its base class)."""
    where = f"module {path!r}" if path else "the top module"
    for name, record in records.items():
        if not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")) or hasattr(nn.Module, name):
            raise ValueError(f"{where}: parametrized tensor name {name!r} may not be set from a file")
        if not isinstance(record, dict):
            raise ValueError(f"{where}: malformed parametrization record for {name!r}")
        original, is_parameter, requires_grad = record.get("original"), record.get("is_parameter"), record.get("requires_grad")
        if not (isinstance(original, torch.Tensor) and isinstance(record.get("modules"), list)
                and isinstance(is_parameter, bool) and isinstance(requires_grad, bool)
                and (not requires_grad or original.is_floating_point())):
            raise ValueError(f"{where}: malformed parametrization record for {name!r}")
        if is_parameter:
            module._parameters[name] = nn.Parameter(original, requires_grad=requires_grad)
        else:
            module._buffers[name] = original
        for i, child in enumerate(record["modules"]):
            child_path = f"{path}.{CONTAINER}.{name}.{i}" if path else f"{CONTAINER}.{name}.{i}"
            parametrize.register_parametrization(module, name, decode_child(child, child_path), unsafe=True)
