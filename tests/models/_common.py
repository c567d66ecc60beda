"""Pieces the family models share: torchvision's eval-mode stochastic depth, the benchmark
models' CNN blocks, token and image inputs from seeded generators."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

Inputs = Tuple[tuple, Dict[str, Any]]  # (positional args, keyword args) of forward


def _load_benchmark_models():
    # benchmarks/ is on sys.path only under pytest (tests/conftest.py): load the file by its path,
    # so that the scripts here run outside pytest too.
    name = "lucid_fx_benchmark_models"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "models.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


benchmark_models = _load_benchmark_models()


def stochastic_depth(input: torch.Tensor, p: float, mode: str, training: bool = True) -> torch.Tensor:
    """torchvision.ops.stochastic_depth, as torchvision writes it (fx-wrapped, so a traced graph
    holds one opaque call to it, as it does for torchvision's EfficientNet and ConvNeXt)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device).bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    """torchvision.ops.StochasticDepth."""

    def __init__(self, p: float, mode: str) -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(input, self.p, self.mode, self.training)


def init_batch_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Trained-looking batch-norm statistics (the benchmark models' recipe), so folding is real."""
    return benchmark_models._init_bn(model, seed)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image_inputs(shape: Tuple[int, ...]):
    """(example inputs factory, calibration batches factory) for a model taking one image batch."""

    def example() -> Inputs:
        return (torch.randn(shape, generator=_generator(0)),), {}

    def batches(n: int = 4) -> List[Inputs]:
        return [((torch.randn(shape, generator=_generator(1000 + i)),), {}) for i in range(n)]

    return example, batches


def token_inputs(vocab: int, batch: int, seq: int, padded: int = 3):
    """(example, batches) for a text model called the transformers way, ``model(**encoding)``:
    ``input_ids`` and an ``attention_mask`` whose last row ends in ``padded`` padding tokens."""

    def make(seed: int) -> Inputs:
        ids = torch.randint(0, vocab, (batch, seq), generator=_generator(seed))
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, seq - padded :] = 0
        return (), {"input_ids": ids, "attention_mask": mask}

    return (lambda: make(0)), (lambda n=4: [make(1000 + i) for i in range(n)])


def as_batch(inputs: Inputs) -> Any:
    """One batch in the form lucid_fx.calibrate takes: a tuple of positional or a dict of keyword inputs."""
    args, kwargs = inputs
    if args and kwargs:
        raise ValueError("a batch is either positional or keyword inputs, not both")
    return kwargs if kwargs else args
