"""Post-training int8 quantization of a small CNN: fp32 against int8 accuracy, SQNR, size, latency.

The task is made in-process (nothing is downloaded): 1x16x16 grey images of five procedural
patterns (horizontal and vertical gratings, a checkerboard, a centred blob, a ring) with random
frequency, phase and contrast, plus Gaussian noise. The CNN has what a real one has:
conv-bn-relu blocks, max-pool, adaptive average pooling and a linear head.

Run: python examples/ptq_cnn.py [--quick]
"""

import argparse
import io
import math
import statistics
import time

import torch
from torch import nn

import lucid_fx

CLASSES = ("horizontal", "vertical", "checkerboard", "blob", "ring")
SIZE = 16


def make_images(n: int, seed: int):
    """``n`` noisy pattern images (N, 1, 16, 16) and their labels, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(CLASSES), (n,), generator=g)
    axis = torch.linspace(-1, 1, SIZE)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    freq = 2 + 3 * torch.rand(n, 1, 1, generator=g)
    phase = 2 * math.pi * torch.rand(n, 1, 1, generator=g)
    radius = torch.sqrt(x * x + y * y)
    patterns = torch.stack(
        [
            torch.sin(freq * math.pi * y + phase),  # horizontal grating
            torch.sin(freq * math.pi * x + phase),  # vertical grating
            torch.sign(torch.sin(freq * math.pi * x) * torch.sin(freq * math.pi * y)),  # checkerboard
            2 * torch.exp(-(radius * freq / 3) ** 2) - 1,  # blob
            2 * torch.exp(-((radius - 0.6) * freq * 2) ** 2) - 1,  # ring
        ]
    )  # (classes, n, H, W)
    images = patterns[labels, torch.arange(n)]
    contrast = 0.5 + torch.rand(n, 1, 1, generator=g)
    images = contrast * images + 0.6 * torch.randn(n, SIZE, SIZE, generator=g)
    return images.unsqueeze(1), labels


class SmallCNN(nn.Module):
    def __init__(self, classes: int = len(CLASSES), width: int = 16):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.conv3, self.bn3 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.bn2(self.conv2(x))))
        x = torch.relu(self.bn3(self.conv3(x)))
        return self.fc(self.avg(x).flatten(1))


def train(model: nn.Module, images, labels, epochs: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(images)).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images[idx]), labels[idx]).backward()
            optimizer.step()
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, images, labels) -> float:
    return sum((model(x).argmax(1) == y).sum().item() for x, y in zip(images.split(256), labels.split(256))) / len(labels)


@torch.no_grad()
def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / max((reference - approx).pow(2).mean().item(), 1e-20))


@torch.no_grad()
def latency_ms(model: nn.Module, batch: torch.Tensor, rounds: int) -> float:
    model(batch)  # warm-up: packs int8 weights once
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        model(batch)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def size_mb(model: nn.Module) -> float:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 1e6


def main(quick: bool = False) -> dict:
    train_n, test_n, epochs, rounds = (1000, 400, 2, 5) if quick else (6000, 2000, 4, 30)
    train_x, train_y = make_images(train_n, seed=1)
    test_x, test_y = make_images(test_n, seed=2)
    model = train(SmallCNN(), train_x, train_y, epochs, seed=0)

    # prepare -> calibrate on 8 training batches -> convert to int8 kernels
    prepared = lucid_fx.prepare(model, example_inputs=(train_x[:2],))
    lucid_fx.calibrate(prepared, list(train_x[:512].split(64)), progress=not quick)
    qmodel = lucid_fx.convert(prepared)

    results = {
        "fp32_accuracy": accuracy(model, test_x, test_y),
        "int8_accuracy": accuracy(qmodel, test_x, test_y),
        "sqnr_db": sqnr_db(model(test_x).detach(), qmodel(test_x)),
        "fp32_mb": size_mb(model),
        "int8_mb": size_mb(qmodel),
        "fp32_ms": latency_ms(model, test_x[:64], rounds),
        "int8_ms": latency_ms(qmodel, test_x[:64], rounds),
        "report": qmodel.lucid_fx_convert_report,
        "explain": lucid_fx.explain(prepared).summary(),
    }
    change = 100 * (results["int8_accuracy"] - results["fp32_accuracy"])
    print(f"fp32 accuracy: {100 * results['fp32_accuracy']:.2f}%")
    print(f"int8 accuracy: {100 * results['int8_accuracy']:.2f}%  (change {change:+.2f} points)")
    print(f"logits SQNR: {results['sqnr_db']:.1f} dB (int8 against fp32, {test_n} test images)")
    print(f"model size: fp32 {results['fp32_mb']:.3f} MB, int8 {results['int8_mb']:.3f} MB (serialized state_dict)")
    threads = torch.get_num_threads()
    print(
        f"latency: fp32 {results['fp32_ms']:.2f} ms, int8 {results['int8_ms']:.2f} ms "
        f"(batch 64, median of {rounds}, {threads} thread{'' if threads == 1 else 's'})"
    )
    print(f"explain: {results['explain']}")
    print(f"convert: {results['report']}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="less data, fewer epochs, fewer latency rounds")
    main(parser.parse_args().quick)
