"""Prepare a small gated CNN, calibrate it, and print which observer each node got and why.

Run: python examples/prepare_and_explain.py [--quick]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class GatedCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.gate = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        y = self.pool(F.relu(self.bn(self.conv(x)))).flatten(1)
        return self.fc(y) * torch.sigmoid(self.gate(y)), (torch.tanh(self.fc(y)) + 1) / 2


def main(quick: bool = False) -> lucid_fx.Explanation:
    torch.manual_seed(0)
    model = GatedCNN().eval()
    example = torch.randn(2, 3, 16, 16)
    prepared = lucid_fx.prepare(model, example_inputs=(example,))
    batches = [torch.randn(4, 3, 16, 16) for _ in range(2 if quick else 16)]
    lucid_fx.calibrate(prepared, batches, progress=not quick)
    assert all(torch.equal(a, b) for a, b in zip(prepared(example), model(example)))
    table = lucid_fx.explain(prepared)
    print(table)
    print("summary:", table.summary())
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="calibrate on 2 batches instead of 16")
    main(parser.parse_args().quick)
