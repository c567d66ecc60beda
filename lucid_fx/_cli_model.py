"""The CLI's model: the factory ``MODULE:FACTORY`` (a module name or a path to a .py file), the device of
``--backend``, and the check that the model's forward runs on the inputs before prepare sees them, each mistake
one ``error:``/``hint:`` pair (:class:`lucid_fx._cli_inputs.CLIError`). The inputs are :mod:`lucid_fx._cli_inputs`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, List

import torch
from torch import nn

from lucid_fx._cli_inputs import Batch, CLIError, _first_line, call_with, describe

__all__ = ["load_factory", "build_model", "device_of", "check_forward"]


def _import_module(name: str) -> Any:
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise CLIError(f"cannot import {name!r}: no such file", "give a path to an existing .py file, or a module name")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # so that classes defined there can be pickled by name
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    # As with `python -m`, modules in the current folder are importable (the lucid-fx script's
    # own sys.path[0] is its bin folder); only while importing, so in-process callers keep theirs.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``"package.module:name"`` (or ``"path/to/file.py:name"``);
    ``name`` may be dotted (``module:Class.build``). Raises :class:`CLIError` when it cannot."""
    module_name, colon, attribute = spec.rpartition(":")
    if not colon or not module_name or not attribute:
        raise CLIError(
            f"expected MODULE:FACTORY, got {spec!r}",
            "e.g. my_models:make_resnet, where my_models.make_resnet() returns an nn.Module",
        )
    try:
        module = _import_module(module_name)
    except CLIError:
        raise
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise CLIError(
                f"cannot import module {module_name!r}: no module named {e.name!r}",
                "run from the folder that holds it, add that folder to PYTHONPATH, or give a path: path/to/file.py:FACTORY",
            ) from e
        raise CLIError(f"importing {module_name!r} failed: {_first_line(e)}", "install the missing package") from e
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises while importing
        raise CLIError(
            f"importing {module_name!r} failed: {_first_line(e)}",
            f"run `python -c \"import {module_name}\"` to see the full error, or pass --traceback",
        ) from e
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise CLIError(
                f"module {module_name!r} has no attribute {attribute!r}",
                f"callables defined there: {', '.join(found[:12]) or 'none'}",
            )
        target = getattr(target, part)
    if not callable(target):
        raise CLIError(
            f"{spec} is not callable (it is of type {type(target).__name__})",
            "FACTORY must be a function or class that returns an nn.Module when called with no arguments",
        )
    return target


def build_model(spec: str, device: torch.device) -> nn.Module:
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise CLIError(f"calling {spec}() failed: {_first_line(e)}", "the factory is called with no arguments; pass --traceback for the full error") from e
    if not isinstance(model, nn.Module):
        raise CLIError(f"{spec}() returned an object of type {type(model).__name__}, not a torch.nn.Module", "make the factory return the model itself")
    return model.eval().to(device)


def device_of(backend: str) -> torch.device:
    if backend == "cuda" and not torch.cuda.is_available():
        raise CLIError("--backend cuda needs a CUDA device, and torch.cuda.is_available() is False", "use --backend cpu")
    return torch.device(backend)


def _required_inputs(model: nn.Module) -> List[str]:
    """The names of forward's inputs that have no default (``[]`` when its signature cannot be read)."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _several_inputs_hint(names: List[str]) -> str:
    """Where to go when forward takes more inputs than the one tensor --input-shape makes."""
    takes = f"{len(names)} inputs ({', '.join(names)})" if names else "more than one input"
    example = ", ".join(names) if names else "x, y"
    return (f"forward takes {takes} and --input-shape makes only one: drop --input-shape and pass --calib-data FILE "
            f"holding a list of batches, each a tuple of forward's inputs in order or a dict of them by name, "
            f"e.g. torch.save([({example}), ...], FILE)")


def check_forward(model: nn.Module, example: Batch, random: bool) -> None:
    try:
        with torch.no_grad():
            call_with(model, example)
    except Exception as e:  # noqa: BLE001 - the user's forward
        if random:
            required = _required_inputs(model)
            # A forward whose signature is hidden (a wrapper's *args) still says so when it is called.
            several = len(required) > 1 or (isinstance(e, TypeError) and "required positional argument" in str(e))
            raise CLIError(
                f"the model's forward failed on a random float input of shape {tuple(example.shape)}: {_first_line(e)}",
                _several_inputs_hint(required if len(required) > 1 else [])
                if several else "check --input-shape: it is the full shape of forward's single input, batch first",
            ) from e
        raise CLIError(
            f"the model's forward failed on the first batch of --calib-data ({describe(example)}): {_first_line(e)}",
            "a batch is forward's input: a tensor, a tuple of its positional inputs or a dict of its keyword inputs",
        ) from e
