"""Quantize a transformer encoder block: multi-head softmax attention written with matmul and
softmax, LayerNorm, and a GELU MLP, with residual adds.

Prints the SQNR of the int8 block against fp32, which nodes run as int8 kernels and which stay
float (from the convert report), why softmax needs no calibration (from explain), and the
attention part of the converted code.

Run: python examples/transformer_block.py [--quick]
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class EncoderBlock(nn.Module):
    def __init__(self, d_model: int = 64, heads: int = 4, d_ff: int = 256):
        super().__init__()
        self.heads, self.d_head = heads, d_model // heads
        self.q, self.k, self.v = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def heads_first(self, x):  # (batch, seq, d_model) -> (batch, heads, seq, d_head)
        batch, seq, _ = x.shape
        return x.reshape(batch, seq, self.heads, self.d_head).permute(0, 2, 1, 3)

    def forward(self, x):
        h = self.ln1(x)
        q, k, v = self.heads_first(self.q(h)), self.heads_first(self.k(h)), self.heads_first(self.v(h))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_head)
        attention = torch.softmax(scores, dim=-1)
        y = torch.matmul(attention, v).permute(0, 2, 1, 3).flatten(2)
        x = x + self.out(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / max((reference - approx).pow(2).mean().item(), 1e-20))


@torch.no_grad()
def main(quick: bool = False) -> dict:
    torch.manual_seed(0)
    batch, seq, d_model = 8, 32, 64
    model = EncoderBlock(d_model).eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(batch, seq, d_model, generator=g) for _ in range(4 if quick else 32)]
    test = torch.randn(batch, seq, d_model, generator=g)

    prepared = lucid_fx.prepare(model, example_inputs=(test[:1],))
    lucid_fx.calibrate(prepared, calibration, progress=not quick)
    table = lucid_fx.explain(prepared)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report

    sqnr = sqnr_db(model(test), qmodel(test))
    print(f"SQNR int8 vs fp32: {sqnr:.1f} dB (batch {batch}, sequence {seq}, d_model {d_model})")
    print(f"int8 kernels ({len(report.lowered)}): " + ", ".join(f"{n} [{key}]" for n, key in report.lowered.items()))
    print(f"float ({len(report.float_ops)}): " + ", ".join(f"{n} ({why})" for n, why in report.float_ops.items()))
    softmax = table.by_node()["softmax"]
    print(f"softmax: {softmax['kind']} {softmax['observer']} {softmax['qparams']} ({softmax['reason']})")
    print(f"explain: {table.summary()}")
    attention = [line.strip() for line in qmodel.code.splitlines() if "lucid_fx.matmul" in line or "lucid_fx.softmax" in line]
    print("attention in qmodel.code:")
    for line in attention:
        print("    " + line.split(";")[0])
    return {"sqnr_db": sqnr, "report": report, "explain": table, "code": qmodel.code}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="calibrate on 4 batches instead of 32")
    main(parser.parse_args().quick)
