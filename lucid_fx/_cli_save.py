"""What the CLI's quantize checks before it saves: a model whose parts stayed float names user classes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, List

import torch
from torch import nn

from lucid_fx._cli_inputs import CLIError

__all__ = ["check_saveable"]


def _class_spec(cls: type, args: argparse.Namespace) -> str:
    """The MODULE:CLASS that names ``cls`` for --allow (the factory's own .py path if it came from one)."""
    module_name = args.factory.rpartition(":")[0]
    if module_name.endswith(".py") and Path(module_name).stem == cls.__module__:
        return f"{module_name}:{cls.__qualname__}"
    return f"{cls.__module__}:{cls.__qualname__}"


def check_saveable(qmodel: nn.Module, prepared: nn.Module, allow: List[Any], args: argparse.Namespace) -> None:
    """A model whose top level (or a part of it) stayed float keeps the user's module classes, which
    a file names and lucid_fx.load must trust: say which, and the flag that allows them."""
    from lucid_fx._allowlist import is_module_class

    classes = dict.fromkeys(type(m) for m in qmodel.modules())
    missing = [c for c in classes if not issubclass(c, torch.fx.GraphModule) and not is_module_class(c) and c not in allow]
    if missing:
        report = getattr(prepared, "lucid_fx_report", None)
        kept = "; ".join(u.describe() for u in getattr(report, "float_modules", ()))
        flags = " ".join(f"--allow {_class_spec(c, args)}" for c in missing)
        raise CLIError(
            f"cannot save {args.factory}'s model as data: {', '.join(c.__qualname__ for c in missing)} stayed float "
            f"({kept or 'not traced'}), so the file must name the class{'es' if len(missing) > 1 else ''} and loading must trust "
            "the code",
            f"rerun with {flags} to save it (load it with lucid_fx.load(path, allow=[...]) or `lucid-fx show PATH {flags}`), "
            "or make the model's top-level forward traceable by torch.fx",
        )
