"""Quantization-aware training recovers what post-training quantization loses.

The task: classify 16-feature points into 4 classes by a random linear teacher (narrow margins
near the class boundaries). Feature 15 is always zero (padding), so the data never constrains the
first layer's weights on it; we set them large, as an outlier weight column in a real model can
be. The float model does not notice (they multiply zeros), but per-channel int8 weights do: each
row's scale is set by its outlier, so the informative weights round to 0 or +-1 and PTQ
accuracy collapses. QAT trains the informative weights through the fake-quantized grid until
they carry the signal again; its int8 model is then exactly what training saw.

Run: python examples/qat_recovers_accuracy.py [--quick]
"""

import argparse
import contextlib
import copy
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.kernels import weight_quant_range
from lucid_fx.quantization import FakeQuantize

FEATURES, CLASSES, HIDDEN = 16, 4, 32


def make_data(rows: int, seed: int):
    teacher = torch.randn(CLASSES, FEATURES - 1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=g)
    x[:, -1] = 0.0  # the padding feature
    return x, (x[:, :-1] @ teacher.t()).argmax(1)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(model: nn.Module, x, y, steps: int, lr: float, seed: int) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, len(x), (128,), generator=g)
        loss = F.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def float_model_with_outliers(x, y, steps: int) -> nn.Module:
    torch.manual_seed(0)
    model = train(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)), x, y, steps, 1e-2, 1)
    # Twice the weight grid's qmax times each row's largest weight: the informative weights land
    # within one code of 0 on any CPU's grid ([-64, 63] without VNNI, [-128, 127] with it).
    factor = 2 * weight_quant_range("cpu")[1]
    with torch.no_grad():
        model[0].weight[:, -1] = factor * model[0].weight[:, :-1].abs().amax(1)
    return model.eval()


@contextlib.contextmanager
def _threads(n: int):
    # Small matrices: more threads only contend (measured 4x slower on a shared 2-core machine).
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def main(quick: bool = False) -> Dict[str, float]:
    with _threads(1):
        x, y = make_data(4096, 1)
        x_test, y_test = make_data(2048, 2)
        model = float_model_with_outliers(x, y, 300)
        example = (x[:2],)

        ptq = lucid_fx.quantize(model, example, [x[i : i + 256] for i in range(0, 1024, 256)])

        prepared = lucid_fx.prepare_qat(copy.deepcopy(model).train(), example_inputs=example)
        train(prepared, x, y, 150 if quick else 400, 1e-2, 3)
        for module in prepared.modules():  # freeze the ranges before evaluating on test data
            if isinstance(module, FakeQuantize):
                module.disable_observer()
        prepared.eval()
        qat_int8 = lucid_fx.convert(prepared)

        figures = {
            "fp32": accuracy(model, x_test, y_test),
            "ptq_int8": accuracy(ptq, x_test, y_test),
            "qat_fake_quant": accuracy(prepared, x_test, y_test),
            "qat_int8": accuracy(qat_int8, x_test, y_test),
        }
    for name, value in figures.items():
        print(f"{name:>15}: {100 * value:5.1f}% test accuracy")
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="150 QAT steps instead of 400")
    main(parser.parse_args().quick)
