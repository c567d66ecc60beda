"""Int8 where it pays: the gated MLP's tanh/sigmoid/mul as a float island between int8 linears.

    python benchmarks/prototypes/gated_island.py [--rounds 9]

Starts from the lowered program (``lowering.lower``) of today's lucid_fx gated MLP, whose middle is
lut(tanh), lut(sigmoid) and an int8 mul. The island version changes only that middle: the value linear
emits float32 with oneDNN's fused tanh post-op, the gate linear emits float32, ``torch.sigmoid`` and one
multiply run in float, and one quantize (:func:`lowering.quantize_magic`) feeds the last linear with the
same input qparams as today. The tables are recognised by rebuilding them with ``make_lut`` from the
qparams around them (a real convert would record the float function on the node).

Prints SQNR against fp32 on a held-out batch and interleaved times for fp32, torch.ao (x86, onednn),
lucid_fx, the lowered program and the island.

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread, 9 rounds): SQNR torch.ao x86 26.1 dB,
onednn 31.7, lucid_fx 31.7, lowered 32.2, float island 36.2; wall fp32 8313 us, torch.ao x86 2371,
onednn 2390, lucid_fx 2738, lowered 2487, island 2218 (1.07x the fastest peer, 1.23x lucid_fx).
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from int8_inference import sqnr  # noqa: E402
from lowering import LF, ON, _attr, _packet, lower, quantize_magic  # noqa: E402
from overhead import measure, variants_for  # noqa: E402

from lucid_fx.kernels.reference import make_lut  # noqa: E402

warnings.simplefilter("ignore")


def _is_table(table, fn, in_scale, in_zp, out_scale, out_zp):
    return torch.equal(table, make_lut(fn, in_scale, in_zp, (0, 255), out_scale, out_zp, (0, 255)))


def island(lowered):
    """The lowered gated MLP with tanh(value) * sigmoid(gate) computed in float32."""
    gm, graph = lowered, lowered.graph
    mul = next(n for n in graph.nodes if n.op == "call_function" and _packet(n) == LF.mul)
    a, sa, za, b, sb, zb, out_scale, out_zp, post = mul.args
    pieces = {}
    for lut, scale, zp in ((a, sa, za), (b, sb, zb)):
        producer, table = lut.args
        p_scale, p_zp = producer.args[7], producer.args[8]
        kind = "tanh" if _is_table(_attr(gm, table), torch.tanh, p_scale, p_zp, scale, zp) else \
            "sigmoid" if _is_table(_attr(gm, table), torch.sigmoid, p_scale, p_zp, scale, zp) else None
        assert kind is not None and producer.target == ON.qlinear_pointwise.default and len(producer.users) == 1
        args = list(producer.args)
        args[7:11] = [1.0, 0, torch.float32, "tanh" if kind == "tanh" else "none"]
        producer.args = tuple(args)
        if kind == "tanh":
            lut.replace_all_uses_with(producer)
            pieces["tanh"] = producer
        else:
            with graph.inserting_before(lut):
                pieces["sigmoid"] = graph.call_function(torch.sigmoid, (producer,))
            lut.replace_all_uses_with(pieces["sigmoid"])
        graph.erase_node(lut)
    inv = float(1.0 / torch.tensor(out_scale, dtype=torch.float32))
    with graph.inserting_before(mul):
        product = graph.call_function(torch.mul, (pieces["tanh"], pieces["sigmoid"]))
        codes = graph.call_function(quantize_magic, (product, inv, out_zp, 0, 255, torch.uint8))
    mul.replace_all_uses_with(codes)
    graph.erase_node(mul)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    variants, x, model, batches = variants_for("gated_mlp", ["x86", "onednn"], 4)
    variants["lowered"] = lower(variants["lucid_fx int8"], x, fuse_dequantize=True)
    variants["lowered, float island"] = island(lower(variants["lucid_fx int8"], x, fuse_dequantize=True))
    held_out = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1000))
    with torch.no_grad():
        reference = model(held_out)
        for name, fn in variants.items():
            if name != "fp32 eager":
                print(f"  {name:<24} SQNR {sqnr(reference, fn(held_out)):.1f} dB")
    figures = measure(variants, x, args.rounds, 10)
    base = figures["fp32 eager"]["wall_us"]
    for name, f in figures.items():
        print(f"  {name:<24} {f['wall_us']:>8.0f} us  {base / f['wall_us']:.2f}x fp32  "
              f"outside {f['outside_us']:.0f} us over {f['ops']:.0f} ops")
    print(variants["lowered, float island"].code)


if __name__ == "__main__":
    main()
