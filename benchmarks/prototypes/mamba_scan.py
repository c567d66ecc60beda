"""transformers' Mamba at a real width: speed and output SQNR of lucid_fx int8 against fp32, with the unrolled
selective scan float (the default, lucid_fx/rules/recurrences.py) and int8 (as before that rule).

    python benchmarks/prototypes/mamba_scan.py [--hidden 768] [--tokens 64] [--layers 2] [--rounds 15]

Random weights (transformers' own init), nothing downloaded; torch.ao's FX cannot trace the model. Medians of
interleaved rounds at 1 thread (docs/policies.md, "Scans stay float", has the figures).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _timing import interleaved  # noqa: E402

import lucid_fx  # noqa: E402
import lucid_fx.passes.choose_observers as choose_observers  # noqa: E402
from int8_inference import cpu_line  # noqa: E402


def main(argv=None) -> None:
    import transformers as T

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(cpu_line())
    torch.manual_seed(0)
    config = T.MambaConfig(hidden_size=options.hidden, num_hidden_layers=options.layers, vocab_size=1000, state_size=16,
                           use_cache=False)
    model = T.MambaForCausalLM(config).eval()

    def ids(seed):
        return torch.randint(0, 1000, (1, options.tokens), generator=torch.Generator().manual_seed(seed))

    def converted():
        return lucid_fx.quantize(model, (ids(0),), [(ids(i),) for i in range(1, 9)], progress=False)

    found = choose_observers.recurrence_nodes
    variants = {"fp32": model, "lucid_fx, scan float": converted()}
    choose_observers.recurrence_nodes = lambda graph: frozenset()
    try:
        variants["lucid_fx, scan int8"] = converted()
    finally:
        choose_observers.recurrence_nodes = found
    x, held_out = ids(0), [ids(100 + i) for i in range(4)]
    with torch.no_grad():
        us = interleaved({name: (lambda m=m: m(x)) for name, m in variants.items()}, rounds=options.rounds, target_s=0.05)
        reference = torch.cat([model(b).logits for b in held_out])
        print(f"Mamba hidden {options.hidden}, {options.tokens} tokens, {options.layers} layers, 1 thread")
        print("| variant | ms | x fp32 | output SQNR dB |\n|---|---|---|---|")
        for name, m in variants.items():
            out = torch.cat([m(b).logits for b in held_out])
            sqnr = 10 * torch.log10(reference.pow(2).mean() / (reference - out).pow(2).mean().clamp_min(1e-30))
            shown = "-" if m is model else f"{sqnr.item():.1f}"
            print(f"| {name} | {us[name] / 1e3:.2f} | {us['fp32'] / us[name]:.2f}x | {shown} |")


if __name__ == "__main__":
    main()
