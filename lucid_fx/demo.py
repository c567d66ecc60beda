"""The built-in demo: train a small CNN on procedural images, quantize it, compare with fp32.

Everything is generated in-process from a seed, so the demo needs no download and gives the same
numbers on every run on a given machine::

    lucid-fx demo            # 4,000 training images, 4 epochs: ~15 s in all on 2 CPU cores
    lucid-fx demo --quick    # 1,200 images, 3 epochs: a few seconds, for tests

The task: 10 classes of 1x32x32 grey images, each a procedural pattern (gratings at four
orientations, a checkerboard, rings, a blob, scattered dots, a cross, a square outline) with a
random frequency, phase, position and contrast, plus Gaussian pixel noise.

The model has what int8 convert has to handle in a real CNN: conv-bn-relu blocks (folded and
fused), a residual add (fused into the conv), max-pool on the codes, a sigmoid gate (a fixed
``[0, 1]`` grid, as a lookup table) multiplied into the features, adaptive average pooling and
a linear head.
"""

from __future__ import annotations

import io
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, TextIO

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.demo_data import CLASSES, SIZE, make_patterns
from lucid_fx.kernels.target import resolve_target
from lucid_fx._progress import Progress

__all__ = ["CLASSES", "DemoConfig", "DemoResult", "DemoNet", "make_patterns", "run_demo"]

@dataclass(frozen=True)
class DemoConfig:
    """How much work the demo does; :meth:`full` and :meth:`quick` are the two presets."""

    train_images: int
    test_images: int
    epochs: int
    calibration_batches: int
    latency_rounds: int
    batch_size: int = 64
    latency_batch: int = 32

    def __post_init__(self) -> None:
        for name in ("train_images", "test_images", "epochs", "calibration_batches", "latency_rounds", "batch_size", "latency_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def full(cls) -> "DemoConfig":
        return cls(train_images=4000, test_images=2000, epochs=4, calibration_batches=16, latency_rounds=50)

    @classmethod
    def quick(cls) -> "DemoConfig":
        return cls(train_images=1200, test_images=600, epochs=3, calibration_batches=4, latency_rounds=3)


# -- model --------------------------------------------------------------------------------------
class DemoNet(nn.Module):
    """conv-bn-relu, max-pool, a residual block, a strided conv, a sigmoid gate, avg-pool, linear."""

    def __init__(self, classes: int = len(CLASSES), width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.down_bn = nn.BatchNorm2d(2 * width)
        self.gate = nn.Conv2d(2 * width, 2 * width, 1)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.stem_bn(self.stem(x))))  # 16 x 16
        y = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(y)) + x)  # residual
        x = F.relu(self.down_bn(self.down(x)))  # 8 x 8
        x = x * torch.sigmoid(self.gate(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def train(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, config: DemoConfig, seed: int,
    *, progress: Optional[bool] = False, stream: Optional[TextIO] = None,
) -> nn.Module:
    """Adam with a one-cycle schedule; returns ``model`` in eval mode. ``progress`` as calibrate's,
    one step per batch, with the epoch and the running loss."""
    g = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(images) / config.batch_size)
    bar = Progress("train", config.epochs * steps_per_epoch, stream or sys.stderr, progress, unit="step")
    optimizer = torch.optim.Adam(model.parameters())  # lr set by the schedule
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=config.epochs * steps_per_epoch)
    model.train()
    for epoch in range(config.epochs):
        order = torch.randperm(len(images), generator=g)
        for start in range(0, len(images), config.batch_size):
            index = order[start : start + config.batch_size]
            loss = F.cross_entropy(model(images[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.step(f"epoch {epoch + 1}/{config.epochs} loss {loss.item():.3f}")
    bar.close()
    return model.eval()


# -- measurements -------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch: int = 250) -> float:
    """Top-1 accuracy in percent."""
    correct = sum(int((model(images[i : i + batch]).argmax(1) == labels[i : i + batch]).sum()) for i in range(0, len(images), batch))
    return 100.0 * correct / len(images)


@torch.no_grad()
def latency_ms(models: Sequence[nn.Module], batch: torch.Tensor, rounds: int) -> List[float]:
    """Median wall time of one forward pass of each model, in milliseconds, after two warm-up
    passes. The models take turns, so a slow spell of a shared machine hits them alike."""
    for model in models:
        for _ in range(2):
            model(batch)
    times: List[List[float]] = [[] for _ in models]
    for _ in range(rounds):
        for model, samples in zip(models, times):
            start = time.perf_counter()
            model(batch)
            samples.append(time.perf_counter() - start)
    return [1000.0 * statistics.median(samples) for samples in times]


def state_dict_mb(model: nn.Module) -> float:
    """Size of ``torch.save(model.state_dict())`` in MB (10**6 bytes)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell() / 1e6


def _cpu_note() -> str:
    # Without VNNI, oneDNN's int8 kernels run at about twice fp32's rate, not four times
    # (docs/benchmarks.md), and a model this small is dominated by per-op overhead.
    vnni = resolve_target("cpu").cpu.vnni
    threads = torch.get_num_threads()
    return f"oneDNN int8, {threads} thread{'' if threads == 1 else 's'}, {'VNNI' if vnni else 'no VNNI'} on this CPU"


# -- the demo -----------------------------------------------------------------------------------
# The temporary folder, not the current one: a demo run from a checkout leaves no stray file there.
DEFAULT_HTML = Path(tempfile.gettempdir()) / "lucid_fx_demo.html"


@dataclass
class DemoResult:
    """The numbers the demo prints."""

    fp32_accuracy: float
    int8_accuracy: float
    fp32_ms: float
    int8_ms: float
    fp32_mb: float
    int8_mb: float
    explain_summary: str
    convert_report: str
    seconds: Dict[str, float]
    worst_nodes: List[str] = field(default_factory=list)
    html: Optional[Path] = None

    @property
    def speedup(self) -> float:
        return self.fp32_ms / self.int8_ms

    def lines(self, config: DemoConfig) -> List[str]:
        change = self.int8_accuracy - self.fp32_accuracy
        return [
            f"fp32 accuracy: {self.fp32_accuracy:.2f}%",
            f"int8 accuracy: {self.int8_accuracy:.2f}%  (change {change:+.2f} points)",
            f"fp32 latency: {self.fp32_ms:.2f} ms/batch (batch {config.latency_batch}, median of {config.latency_rounds})",
            f"int8 latency: {self.int8_ms:.2f} ms/batch ({_cpu_note()})",
            f"speedup: {self.speedup:.2f}x",
            f"model size: fp32 {self.fp32_mb:.3f} MB, int8 {self.int8_mb:.3f} MB (serialized state_dict)",
            f"explain: {self.explain_summary}",
            f"convert: {self.convert_report}",
            "worst nodes (SQNR vs fp32 on a held-out batch): " + "; ".join(self.worst_nodes),
        ] + ([f"graph: {self.html.resolve()} (open it in a browser: int8 regions, float fallbacks, qparams, error per node)"] if self.html else []) + [
            "time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()),
        ]


def run_demo(
    seed: int = 0,
    quick: bool = False,
    *,
    out: Optional[TextIO] = None,
    err: Optional[TextIO] = None,
    progress: Optional[bool] = None,
    html: Optional[Path] = DEFAULT_HTML,
) -> DemoResult:
    """Train :class:`DemoNet` on :func:`make_patterns`, quantize it with lucid_fx and print
    fp32 against int8: accuracy on held-out images, latency, size, explain and convert summaries.

    Results go to ``out`` (default stdout); status lines and the training and calibration progress
    go to ``err`` (default stderr), ``progress`` as calibrate's (a bar on a terminal, nothing in a
    log unless True). The converted graph, coloured by each node's error against fp32 on a held-out
    batch, is written to ``html`` (None: not written).
    """
    out, err = out or sys.stdout, err or sys.stderr
    config = DemoConfig.quick() if quick else DemoConfig.full()
    seconds: Dict[str, float] = {}

    def timed(name: str, fn: Callable):
        start = time.perf_counter()
        value = fn()
        seconds[name] = time.perf_counter() - start
        return value

    torch.manual_seed(seed)
    train_x, train_y = make_patterns(config.train_images, seed=2 * seed)
    test_x, test_y = make_patterns(config.test_images, seed=2 * seed + 1)
    print(
        f"demo: {len(CLASSES)}-class procedural 1x{SIZE}x{SIZE} patterns, {config.train_images} train / "
        f"{config.test_images} held-out images (seed {seed}); training for {config.epochs} epochs...",
        file=err,
    )
    model = timed("train", lambda: train(DemoNet(), train_x, train_y, config, seed, progress=progress, stream=err))

    def quantize():
        prepared = lucid_fx.prepare(model, example_inputs=(train_x[: config.latency_batch],))
        batches = [train_x[i * config.latency_batch : (i + 1) * config.latency_batch] for i in range(config.calibration_batches)]
        lucid_fx.calibrate(prepared, batches, progress=progress, stream=err)
        return prepared, lucid_fx.convert(prepared)

    prepared, qmodel = timed("quantize", quantize)
    batch = test_x[: config.latency_batch]
    fp32_ms, int8_ms = timed("latency", lambda: latency_ms([model, qmodel], batch, config.latency_rounds))
    comparison = timed("compare", lambda: lucid_fx.compare(model, qmodel, batch))
    if html is not None:
        timed("graph", lambda: lucid_fx.visualize(qmodel, html, compare=comparison, title="lucid_fx demo: DemoNet, int8"))
    result = DemoResult(
        fp32_accuracy=accuracy(model, test_x, test_y),
        int8_accuracy=accuracy(qmodel, test_x, test_y),
        fp32_ms=fp32_ms,
        int8_ms=int8_ms,
        fp32_mb=state_dict_mb(model),
        int8_mb=state_dict_mb(qmodel),
        explain_summary=lucid_fx.explain(prepared).summary(),
        convert_report=str(qmodel.lucid_fx_convert_report),
        seconds=seconds,
        worst_nodes=[f"{r.node} ({r.op}) {r.sqnr_db:.1f} dB" for r in comparison.worst(3)],
        html=html,
    )
    for line in result.lines(config):
        print(line, file=out)
    return result
