"""Dynamic int8 linears: lucid_fx's quantize_dynamic against fp32 eager and torch.ao's quantize_dynamic (fbgemm),
same run, on the shapes a language model's linears meet: one token a call (decoding), a prompt's rows, a batch;
and, where transformers is installed, a small Llama's and GPT-2's greedy ``generate`` (random weights, nothing
downloaded).

    python benchmarks/dynamic_linear.py [--rounds 7] [--threads 1]

A linear row is one ``nn.Linear`` (rows M, in K, out N) called on a random input; ms (us for the linears) is
the same-run median of ``--rounds`` rounds with the variants taking turns (int8_inference.timed), speedups
are over fp32 eager, "vs ao" is torch.ao's time over lucid_fx's (> 1: lucid_fx is faster), SQNR is of the
output against fp32; the generate row's SQNR column is the share of generated tokens equal to fp32's.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamic_rnn import _sqnr, start  # noqa: E402
from int8_inference import timed  # noqa: E402

import lucid_fx.quantization as Q  # noqa: E402

# (name, M, K, N)
ROWS = [
    ("decode, small model", 1, 256, 256),
    ("decode, MLP up", 1, 1024, 2816),
    ("decode, projection", 1, 1024, 1024),
    ("decode, 3 sequences", 3, 1024, 1024),
    ("decode, 8 sequences", 8, 1024, 1024),
    ("prompt of 64 tokens", 64, 1024, 1024),
    ("batch of 256 rows", 256, 1024, 1024),
]


def _variants(model: nn.Module) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao announces its migration
        ao = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    return {"fp32": model, "ao": ao, "lucid": Q.quantize_dynamic(model)}


def _generate_row(kind: str, rounds: int):
    """(ms by variant, share of tokens equal to fp32's by variant) of a small Llama's or GPT-2's 32-token greedy
    generate (GPT-2's projections are transformers' Conv1D: torch.ao leaves them float)."""
    try:
        import transformers as T
    except ImportError:
        return None
    torch.manual_seed(0)
    if kind == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=2000))
    else:
        model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=2000))
    models = _variants(model.eval())
    prompt = torch.randint(0, 2000, (1, 12), generator=torch.Generator().manual_seed(1))

    def run(model):
        return lambda ids: model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
    fns = {name: run(model) for name, model in models.items()}
    ms = {k: 1e3 * v for k, v in timed(fns, prompt, rounds).items()}
    with torch.no_grad():
        tokens = {name: fn(prompt)[0, 12:] for name, fn in fns.items()}
    return ms, {name: float((t == tokens["fp32"]).float().mean()) for name, t in tokens.items()}


def main() -> None:
    args = start(__doc__)
    print(f"{'linear':22} {'M,K,N':16} {'fp32 us':>8} {'ao us':>8} {'lucid us':>9} {'x fp32':>7} {'vs ao':>6} "
          f"{'SQNR ao':>8} {'SQNR lucid':>10}")
    for name, m, k, n in ROWS:
        torch.manual_seed(0)
        fns = _variants(nn.Sequential(nn.Linear(k, n)).eval())  # torch.ao swaps children only, never the root
        x = torch.randn(m, k)
        us = {key: 1e6 * v for key, v in timed(fns, x, args.rounds).items()}
        with torch.no_grad():
            reference = fns["fp32"](x)
            quality = {key: _sqnr(reference, fn(x)) for key, fn in fns.items() if key != "fp32"}
        print(f"{name:22} {f'{m},{k},{n}':16} {us['fp32']:8.1f} {us['ao']:8.1f} {us['lucid']:9.1f} "
              f"{us['fp32'] / us['lucid']:6.2f}x {us['ao'] / us['lucid']:6.2f} {quality['ao']:8.1f} {quality['lucid']:10.1f}")
    for kind in ("llama", "gpt2"):
        row = _generate_row(kind, args.rounds)
        if row is None:
            print("generate rows: transformers is not installed")
            return
        ms, same = row
        print(f"{kind + ' generate (ms)':22} {'4x256, 32 tok':16} {ms['fp32']:8.1f} {ms['ao']:8.1f} {ms['lucid']:9.1f} "
              f"{ms['fp32'] / ms['lucid']:6.2f}x {ms['ao'] / ms['lucid']:6.2f} {same['ao']:8.0%} {same['lucid']:10.0%}")


if __name__ == "__main__":
    main()
