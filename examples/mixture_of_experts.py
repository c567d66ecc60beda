"""Quantize a mixture-of-experts block as Mixtral writes it: a router picks two of eight experts per
token, the token rows are sorted by expert, and each expert's rows are multiplied by that expert's
weights in one grouped product (``F.grouped_mm``) on views of (experts, out, in) parameters.

Prints the SQNR of the int8 block against fp32, how many FLOPs run in int8, what stays float (the
routing: top-k, sort, counts), and the converted code's grouped products: ``lucid_fx::grouped_linear``
on int8 expert weights, one scale per expert and output channel.

Run: python examples/mixture_of_experts.py [--quick]
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class MixtureOfExperts(nn.Module):
    def __init__(self, d_model: int = 64, d_expert: int = 128, experts: int = 8, top_k: int = 2):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        # stored as transformers stores them: (experts, out features, in features)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * d_expert, d_model) / math.sqrt(d_model))
        self.down = nn.Parameter(torch.randn(experts, d_model, d_expert) / math.sqrt(d_expert))

    def forward(self, x):  # x: (tokens, d_model)
        weights, chosen = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        expert_of_row, order = torch.sort(chosen.reshape(-1))  # rows grouped by expert
        rows = x[order // self.top_k]
        ends = torch.cumsum(torch.histc(expert_of_row.float(), bins=self.experts, min=0, max=self.experts - 1), 0)
        offs = ends.to(torch.int32)  # where each expert's rows end
        gate, up = F.grouped_mm(rows, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        back = torch.argsort(order)  # each row's place before the sort (torch.fx cannot trace back[order] = ...)
        return y[back].view(x.shape[0], self.top_k, -1).sum(dim=1)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / max((reference - approx).pow(2).mean().item(), 1e-20))


@torch.no_grad()
def main(quick: bool = False) -> dict:
    torch.manual_seed(0)
    tokens, d_model = 64, 64
    model = MixtureOfExperts(d_model).eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(tokens, d_model, generator=g) for _ in range(4 if quick else 32)]
    test = torch.randn(tokens, d_model, generator=g)

    prepared = lucid_fx.prepare(model, example_inputs=(test,))
    lucid_fx.calibrate(prepared, calibration, progress=not quick)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report

    sqnr = sqnr_db(model(test), qmodel(test))
    print(f"SQNR int8 vs fp32: {sqnr:.1f} dB ({tokens} tokens, 8 experts, top 2)")
    print(str(report).splitlines()[1])
    print(f"float ({len(report.float_ops)}): " + ", ".join(sorted(report.float_ops)))
    grouped = [line.strip().split(";")[0] for line in qmodel.code.splitlines() if "grouped_linear(" in line]
    print("grouped products in qmodel.code:")
    for line in grouped:
        print("    " + line)
    return {"sqnr_db": sqnr, "report": report, "code": qmodel.code, "model": qmodel}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="calibrate on 4 batches instead of 32")
    main(parser.parse_args().quick)
