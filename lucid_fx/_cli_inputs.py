"""The CLI's inputs: shapes, random or saved calibration batches, and the checks that turn a mistake in them into
one ``error:``/``hint:`` pair (:class:`CLIError`) instead of a traceback. The model itself (``MODULE:FACTORY``, its
device, the check that its forward runs) is :mod:`lucid_fx._cli_model`; the commands are in :mod:`lucid_fx.cli`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch

__all__ = ["CLIError", "Batch", "parse_shape", "load_calibration_data", "call_with", "example_inputs", "describe", "Inputs",
           "read_inputs"]


class CLIError(Exception):
    """A failure the user can fix: printed as ``error: message`` and ``hint: hint``, exit code 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


#: One calibration batch: forward's single input, a tuple of its positional inputs, or a dict of its keyword inputs.
Batch = Union[torch.Tensor, Tuple[torch.Tensor, ...], Dict[str, torch.Tensor]]


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


def _random_inputs(shape: Tuple[int, ...], count: int, seed: int, device: torch.device) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device) for _ in range(count)]


def call_with(model: Any, batch: Batch) -> Any:
    """``model`` on one batch: a tensor, a tuple of positional inputs or a dict of keyword inputs."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def example_inputs(batch: Batch) -> Any:
    """prepare's ``example_inputs`` for a batch: positional inputs as a tuple, keyword inputs as a dict."""
    return batch if isinstance(batch, (tuple, dict)) else (batch,)


def describe(batch: Batch) -> str:
    """``"input_ids (2, 16) int64, attention_mask (2, 16) int64"``: each input's name or place, shape and dtype."""
    named = batch.items() if isinstance(batch, dict) else enumerate(batch if isinstance(batch, tuple) else (batch,))
    return ", ".join(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in named)


def _step(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a lucid_fx limitation on this model
        if 'dynamic_shapes="auto"' in str(e):  # a batch of another shape than a torch.export capture's
            raise CLIError(f"{name} failed: {_first_line(e)}", "pass --dynamic, or give every batch the first one's shape") from e
        raise CLIError(
            f"{name} failed: {_first_line(e)}",
            "pass --traceback for the full error; `lucid-fx explain` shows how prepare sees the model",
        ) from e


_DATA_HINT = ("torch.save(torch.stack(samples), PATH) with --input-shape, or a list of batches: torch.save([batch, ...], "
              "PATH), where a batch is a tensor, a tuple of forward's positional inputs or a dict of its keyword inputs")


def _batch(path: str, i: int, batch: Any) -> Batch:
    """One batch of the file, checked: a tensor, a tuple of tensors or a dict of tensors by name."""
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else (batch,)
    keys_ok = not isinstance(batch, dict) or all(isinstance(k, str) and k.isidentifier() for k in batch)
    if not items or not keys_ok or not all(isinstance(t, torch.Tensor) for t in items):
        raise CLIError(f"--calib-data {path!r}: batch {i} is {_shown(batch)}, not a tensor, a tuple of tensors or a dict "
                       "of tensors by parameter name", _DATA_HINT)
    return tuple(batch) if isinstance(batch, list) else batch


def _shown(value: Any) -> str:
    if isinstance(value, dict):
        return "a dict of " + ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(value.items())[:4])
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of " + ", ".join(type(v).__name__ for v in value[:4]) if value else f"an empty {type(value).__name__}"
    return f"a {type(value).__name__}"


def _structure(batch: Batch) -> Any:
    """What every batch must share: the kind, and the number of inputs or their names."""
    if isinstance(batch, dict):
        return "dict", sorted(batch)
    return ("tuple", len(batch)) if isinstance(batch, tuple) else ("tensor",)


def _on(batch: Batch, device: torch.device) -> Batch:
    """Float inputs as float32 (the float model's dtype), integer and bool ones (token ids, masks) as they are."""
    def move(t: torch.Tensor) -> torch.Tensor:
        return (t.float() if t.is_floating_point() else t).to(device)
    if isinstance(batch, dict):
        return {k: move(t) for k, t in batch.items()}
    return tuple(move(t) for t in batch) if isinstance(batch, tuple) else move(batch)


def load_calibration_data(path: str, shape: Optional[Tuple[int, ...]], device: torch.device) -> List[Batch]:
    """Batches from a file written by ``torch.save``: one tensor of samples (split into batches of
    ``shape[0]``; needs ``shape``) or a list of batches, each a tensor, a tuple of positional inputs or
    a dict of keyword inputs (``input_ids``, ``attention_mask``, ...), all batches alike. With
    ``shape``, single-tensor batches must have its per-sample shape. Loaded with
    ``weights_only=True``: no code runs."""
    file = Path(path)
    if not file.is_file():
        raise CLIError(f"--calib-data {path!r}: no such file", _DATA_HINT)
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - not a torch file, or one that needs pickled code
        raise CLIError(f"--calib-data {path!r} cannot be read safely: {_first_line(e)}",
                       "it must hold tensors, lists, tuples and dicts of tensors only, saved with torch.save") from e
    if isinstance(data, torch.Tensor):
        if shape is None:
            raise CLIError(f"--calib-data {path!r} holds one tensor of samples, shape {tuple(data.shape)}: give "
                           "--input-shape for the batch size, or save a list of batches", _DATA_HINT)
        if data.dim() != len(shape):
            raise CLIError(
                f"--calib-data {path!r} holds a tensor of shape {tuple(data.shape)}; expected samples stacked along "
                f"dim 0 with --input-shape's {len(shape)} dimensions, (N, {', '.join(map(str, shape[1:]))})", _DATA_HINT)
        data = list(torch.split(data, shape[0]))
    if not isinstance(data, (list, tuple)) or not data:
        raise CLIError(f"--calib-data {path!r} holds {_shown(data)}, not a tensor of samples or a list of batches", _DATA_HINT)
    batches = [_batch(path, i, batch) for i, batch in enumerate(data)]
    first = _structure(batches[0])
    for i, batch in enumerate(batches):
        if _structure(batch) != first:
            raise CLIError(f"--calib-data {path!r}: batch {i} is not like batch 0 ({describe(batch)} against "
                           f"{describe(batches[0])})", "every batch holds the same inputs, by place or by name")
        if shape is not None and (not isinstance(batch, torch.Tensor) or tuple(batch.shape[1:]) != tuple(shape[1:])
                                  or not batch.is_floating_point()):
            raise CLIError(
                f"--calib-data {path!r}: batch {i} is {describe(batch)}; --input-shape {','.join(map(str, shape))} "
                f"expects float batches of shape (B, {', '.join(map(str, shape[1:]))})",
                "the per-sample shape must match --input-shape; for several or integer inputs, drop --input-shape")
    return [_on(batch, device) for batch in batches]


class Inputs(NamedTuple):
    """What the CLI runs the model on."""

    example: Batch  # prepare's example and the forward check
    batches: List[Batch]  # calibration
    probe: Batch  # the converted model's first run, and the report's comparison
    text: str  # what they are, for the summary line


def read_inputs(args: argparse.Namespace, device: torch.device, calibration_batches: int) -> Inputs:
    """Random float inputs of --input-shape, or the batches of --calib-data (with the last as the probe)."""
    shape = None if args.input_shape is None else parse_shape(args.input_shape)
    if getattr(args, "calib_data", None):
        batches = load_calibration_data(args.calib_data, shape, device)
        example = batches[0][: shape[0]] if shape is not None else batches[0]
        text = f"{len(batches)} calibration batches from {args.calib_data} (batch 0: {describe(batches[0])})"
        return Inputs(example, batches, batches[-1], text)
    if shape is None:
        raise CLIError("give --input-shape (random float input) or --calib-data (your batches)",
                       "e.g. --input-shape 1,3,32,32, or --calib-data batches.pt holding a list of batches")
    example, *batches = _random_inputs(shape, 1 + calibration_batches, args.seed, device)
    probe = _random_inputs(shape, 1, args.seed + 1, device)[0]
    return Inputs(example, batches, probe, f"random input {shape}, {calibration_batches} random calibration batches")
