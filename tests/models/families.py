"""Small models that reproduce the structure of real model families (transformers' BERT, GPT-2,
Llama, ViT; torchvision's EfficientNet, ConvNeXt, DenseNet, ShuffleNetV2, MobileNetV2; a U-Net; CycleGAN's generator), written here, with
random weights and nothing downloaded. Each prepares, calibrates and converts in a few seconds.

``FAMILIES`` maps a family name to a :class:`Family`: ``make_model()`` gives the eval-mode model,
``example_inputs()`` one ``(args, kwargs)`` pair for ``forward``, ``calibration_batches(n)`` n more.
The text models are called the transformers way, with keywords (``model(**encoding)``).
``BASELINES`` holds the benchmark models' CNNs at a small input size, for comparison.

tests/models is a namespace package (no ``__init__.py``), imported as ``tests.models`` from the
repository root (``python -m tests.models.measure``): as a regular package pytest would import it
as the top-level ``models``, which is benchmarks/models.py for the rest of the suite.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple

from torch import nn

from . import bert, convnext, cyclegan, densenet, efficientnet, gpt2, llama, mobilenet_v2, shufflenet, unet, vit
from ._common import Inputs, as_batch, benchmark_models, image_inputs, init_batch_norms

__all__ = ["Family", "FAMILIES", "BASELINES", "Inputs", "as_batch"]


class Family(NamedTuple):
    make_model: Callable[[], nn.Module]
    example_inputs: Callable[[], Inputs]
    calibration_batches: Callable[..., List[Inputs]]


def _family(module) -> Family:
    return Family(module.make_model, module.example_inputs, module.calibration_batches)


FAMILIES: Dict[str, Family] = {
    "bert": _family(bert),
    "gpt2": _family(gpt2),
    "llama": _family(llama),
    "vit": _family(vit),
    "efficientnet": _family(efficientnet),
    "convnext": _family(convnext),
    "densenet": _family(densenet),
    "shufflenet": _family(shufflenet),
    "mobilenet_v2": _family(mobilenet_v2),
    "unet": _family(unet),
    "cyclegan": _family(cyclegan),
}


def _baseline(cls, **kwargs) -> Family:
    def make() -> nn.Module:
        import torch

        torch.manual_seed(0)
        return init_batch_norms(cls(**kwargs)).eval()

    return Family(make, *image_inputs((2, 3, 64, 64)))


BASELINES: Dict[str, Family] = {
    "mobilenet_v3": _baseline(benchmark_models.MobileNetV3Like, num_classes=10),
    "resnet18": _baseline(benchmark_models.ResNetLike, num_classes=10, width=16),
}
