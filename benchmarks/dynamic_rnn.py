"""Dynamic int8 LSTM, GRU and RNN (and their cells): lucid_fx's quantize_dynamic against fp32 eager and torch.ao's
quantize_dynamic (fbgemm's quantized LSTM/GRU/RNNCell; torch.ao leaves nn.RNN float and fails on an LSTM with
proj_size: "-"), same run.

    python benchmarks/dynamic_rnn.py [--rounds 7] [--threads 1]

Each row is one layer stack on random weights and a random input (T steps, batch B, I inputs, H hidden
units; a cell row is a decoder's loop of T calls carrying the state); ms is the same-run median of ``--rounds`` rounds with the variants taking turns
(int8_inference.timed), speedups are over fp32 eager, "vs ao" is torch.ao's time over lucid_fx's (> 1:
lucid_fx is faster), SQNR is of the output sequence against fp32.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_inference import cpu_line, timed  # noqa: E402

import lucid_fx.quantization as Q  # noqa: E402

# (name, layer type, T, B, I, H, layers, bidirectional[, constructor options])
ROWS = [
    ("tagger LSTM", nn.LSTM, 32, 8, 256, 256, 1, False),
    ("token-by-token LSTM", nn.LSTM, 64, 1, 128, 128, 1, False),
    ("language model LSTM", nn.LSTM, 35, 20, 650, 650, 2, False),
    ("bi-LSTM encoder", nn.LSTM, 50, 16, 300, 256, 2, True),
    ("tagger GRU", nn.GRU, 32, 8, 256, 256, 1, False),
    ("speech GRU", nn.GRU, 100, 4, 80, 512, 3, False),
    ("decoder LSTMCell", nn.LSTMCell, 20, 8, 256, 512, 1, False),
    ("decoder GRUCell", nn.GRUCell, 20, 1, 128, 256, 1, False),
    ("speech LSTMP", nn.LSTM, 100, 4, 80, 512, 2, False, {"proj_size": 128}),
    ("Elman RNN (tanh)", nn.RNN, 50, 8, 128, 256, 2, False, {"nonlinearity": "tanh"}),
    ("decoder RNNCell (relu)", nn.RNNCell, 20, 4, 128, 256, 1, False, {"nonlinearity": "relu"}),
]


def _run(layer, cell: bool):
    """The output sequence of ``layer``: a layer's own, or a cell's states step by step."""
    if not cell:
        return lambda x: layer(x)[0]

    def loop(x):
        state, outs = None, []
        for step in x:
            state = layer(step, state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs)
    return loop


def _sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (reference - test).pow(2).sum()
    return float(10 * torch.log10(reference.pow(2).sum() / noise)) if noise > 0 else float("inf")


def start(doc: str) -> argparse.Namespace:
    """``--rounds`` and ``--threads`` parsed (the threads set), and the CPU's and torch's lines printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} rounds")
    return args


def main() -> None:
    args = start(__doc__)
    print(f"{'model':22} {'T,B,I,H,layers':20} {'fp32 ms':>8} {'ao ms':>8} {'lucid ms':>9} {'x fp32':>7} {'vs ao':>6} "
          f"{'SQNR ao':>8} {'SQNR lucid':>10}")
    for name, kind, steps, batch, inputs, hidden, layers, both, *extra in ROWS:
        torch.manual_seed(0)
        cell, options = kind in (nn.LSTMCell, nn.GRUCell, nn.RNNCell), (extra or [{}])[0]
        sizes = {} if cell else {"num_layers": layers, "bidirectional": both}
        model = nn.Sequential(kind(inputs, hidden, **sizes, **options)).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao announces its migration
            ao = torch.ao.quantization.quantize_dynamic(model, {kind}, dtype=torch.qint8)
        ours = Q.quantize_dynamic(model)
        x = torch.randn(steps, batch, inputs)
        fns = {"fp32": _run(model[0], cell), "ao": _run(ao[0], cell), "lucid": _run(ours[0], cell)}
        swapped = type(ao[0]) is not kind  # torch.ao left it float, or its layer fails: no figures of its own
        try:
            with torch.no_grad():
                fns["ao"](x)
        except RuntimeError:  # an LSTM with proj_size: "The number of rows in the packB should be equal to K"
            swapped = False
        if not swapped:
            del fns["ao"]
        ms = {k: 1e3 * v for k, v in timed(fns, x, args.rounds).items()}
        with torch.no_grad():
            reference = fns["fp32"](x)
            quality = {k: _sqnr(reference, fn(x)) for k, fn in fns.items() if k != "fp32"}
        shape = f"{steps},{batch},{inputs},{hidden},{layers}{'x2' if both else ''}"
        ao_ms, vs_ao, ao_db = (f"{ms['ao']:8.2f}", f"{ms['ao'] / ms['lucid']:6.2f}", f"{quality['ao']:8.1f}") if swapped else \
            (f"{'-':>8}", f"{'-':>6}", f"{'-':>8}")
        print(f"{name:22} {shape:20} {ms['fp32']:8.2f} {ao_ms} {ms['lucid']:9.2f} {ms['fp32'] / ms['lucid']:6.2f}x "
              f"{vs_ao} {ao_db} {quality['lucid']:10.1f}")


if __name__ == "__main__":
    main()
