"""The CLI's inputs: the model factory (``MODULE:FACTORY``), shapes, random or saved calibration
batches, and the checks that turn a mistake in them into one ``error:``/``hint:`` pair
(:class:`CLIError`) instead of a traceback. The commands are in :mod:`lucid_fx.cli`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Tuple

import torch
from torch import nn

__all__ = ["CLIError", "parse_shape", "load_factory", "load_calibration_data"]


class CLIError(Exception):
    """A failure the user can fix: printed as ``error: message`` and ``hint: hint``, exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# -- arguments ----------------------------------------------------------------------------------
def parse_shape(text: str) -> Tuple[int, ...]:
    """``"1,3,32,32"`` -> ``(1, 3, 32, 32)``; raises :class:`CLIError` on anything else.

    >>> parse_shape("1, 3,32,32")
    (1, 3, 32, 32)
    """
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CLIError(
            f"bad --input-shape {text!r}: expected positive integers separated by commas",
            "give the full shape of forward's input, batch first, e.g. --input-shape 1,3,32,32",
        )
    return tuple(int(p) for p in parts)


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return int(text)

    return parse


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


def _build_model(spec: str, device: torch.device) -> nn.Module:
    factory = load_factory(spec)
    try:
        model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise CLIError(f"calling {spec}() failed: {_first_line(e)}", "the factory is called with no arguments; pass --traceback for the full error") from e
    if not isinstance(model, nn.Module):
        raise CLIError(f"{spec}() returned an object of type {type(model).__name__}, not a torch.nn.Module", "make the factory return the model itself")
    return model.eval().to(device)


def _device(backend: str) -> torch.device:
    if backend == "cuda" and not torch.cuda.is_available():
        raise CLIError("--backend cuda needs a CUDA device, and torch.cuda.is_available() is False", "use --backend cpu")
    return torch.device(backend)


def _random_inputs(shape: Tuple[int, ...], count: int, seed: int, device: torch.device) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device) for _ in range(count)]


def _check_forward(model: nn.Module, example: torch.Tensor) -> None:
    try:
        with torch.no_grad():
            model(example)
    except Exception as e:  # noqa: BLE001 - the user's forward
        raise CLIError(
            f"the model's forward failed on a random float input of shape {tuple(example.shape)}: {_first_line(e)}",
            "check --input-shape: it is the full shape of forward's single input, batch first",
        ) from e


def _step(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a lucid_fx limitation on this model
        raise CLIError(
            f"{name} failed: {_first_line(e)}",
            "pass --traceback for the full error; `lucid-fx explain` shows how prepare sees the model",
        ) from e


def load_calibration_data(path: str, shape: Tuple[int, ...], device: torch.device) -> List[torch.Tensor]:
    """Batches from a file written by ``torch.save``: one tensor of samples (split into batches of
    ``shape[0]``) or a list of batch tensors. Loaded with ``weights_only=True``: no code runs."""
    file = Path(path)
    if not file.is_file():
        raise CLIError(f"--calib-data {path!r}: no such file", "save your batches with torch.save(tensor_or_list_of_tensors, PATH)")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - not a torch file, or one that needs pickled code
        raise CLIError(f"--calib-data {path!r} cannot be read safely: {_first_line(e)}", "it must hold a tensor or a list of tensors, saved with torch.save") from e
    if isinstance(data, torch.Tensor):
        if data.dim() != len(shape):
            raise CLIError(
                f"--calib-data {path!r} holds a tensor of shape {tuple(data.shape)}; expected samples stacked along "
                f"dim 0 with --input-shape's {len(shape)} dimensions, (N, {', '.join(map(str, shape[1:]))})",
                "torch.save(torch.stack(samples), PATH) or torch.save([batch, batch, ...], PATH)",
            )
        data = list(torch.split(data, shape[0]))
    if not isinstance(data, (list, tuple)) or not data or not all(isinstance(t, torch.Tensor) for t in data):
        raise CLIError(
            f"--calib-data {path!r} holds {type(data).__name__}, not a tensor of samples shaped like --input-shape "
            f"{','.join(map(str, shape))} or a list of such batches",
            "torch.save(torch.stack(samples), PATH) or torch.save([batch, batch, ...], PATH)",
        )
    for i, batch in enumerate(data):
        if tuple(batch.shape[1:]) != tuple(shape[1:]) or not batch.is_floating_point():
            raise CLIError(
                f"--calib-data {path!r}: batch {i} has shape {tuple(batch.shape)} and dtype {batch.dtype}; "
                f"expected float batches of shape (B, {', '.join(map(str, shape[1:]))})",
                "the per-sample shape must match --input-shape",
            )
    return [batch.float().to(device) for batch in data]
