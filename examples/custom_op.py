"""Teach lucid_fx a custom op: a bounded activation of your own and an int8 lowering for it.

``squash(x) = x / (1 + |x|)`` lies in ``(-1, 1)`` for every ``x``. (It is the same function as
``F.softsign``, which lucid_fx knows already; written by hand it stands for any function of
yours.) Traced as is, lucid_fx sees ``abs``, ``add`` and ``div`` and cannot bound the quotient,
so it calibrates the output with statistics. Registered with ``register_bounded_op``, it is one
node with a ``FixedQParamsObserver`` on the ``[-1, 1]`` grid, and ``register_lowering`` turns it
into a 256-entry lookup table on int8 codes.

Run: python examples/custom_op.py [--quick]
"""

import argparse
import math

import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import make_lut


def squash(x):
    return x / (1 + x.abs())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(squash(self.fc1(x)))


LOWERED = []  # names of the nodes our rule lowered, to show it ran


def lower_squash(ctx, members, resolve):
    """squash(x) on int8 codes -> lucid_fx.lut with a table made from squash itself.

    ``members`` is the node (or fused group); ``resolve`` sees through observer calls to the
    value a node reads. Returning None would decline: the node would run in float."""
    node = members[0]
    x = ctx.quant_of(resolve(node.args[0]))  # the input as codes, with its scale and zero point
    scale, zero_point, qdtype = ctx.qparams_of(node)  # the fixed [-1, 1] grid chosen at prepare
    table = make_lut(
        squash, x.scale, x.zero_point, (x.qdtype.quant_min, x.qdtype.quant_max),
        scale, zero_point, (qdtype.quant_min, qdtype.quant_max),
    )
    LOWERED.append(node.name)
    codes = ctx.call(torch.ops.lucid_fx.lut, x.node, ctx.constant(f"{node.name}_table", table))
    return ctx.output_qvalue(node, codes)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / max((reference - approx).pow(2).mean().item(), 1e-20))


@torch.no_grad()
def main(quick: bool = False) -> dict:
    torch.manual_seed(0)
    model = Net().eval()
    g = torch.Generator().manual_seed(1)
    calibration = [torch.randn(32, 16, generator=g) for _ in range(4 if quick else 32)]
    test = torch.randn(256, 16, generator=g)
    example = (calibration[0][:2],)

    plain = [r for r in lucid_fx.explain(lucid_fx.prepare(model, example_inputs=example)).rows if r["op"] in ("abs", "add", "div")]
    print("without registration: " + ", ".join(f"{r['node']} ({r['op']}: {r['kind']})" for r in plain))

    with lucid_fx.registry_scope():  # the registrations vanish after this block
        lucid_fx.register_bounded_op(squash, (-1.0, 1.0))
        prepared = lucid_fx.prepare(model, example_inputs=example)
        lucid_fx.calibrate(prepared, calibration, progress=False)
        row = lucid_fx.explain(prepared).by_node()["squash"]
        print(f"registered: squash ({row['op']}: {row['kind']}, {row['observer']} {row['qparams']}; rule {row['rule']})")
        before = lucid_fx.convert(prepared).lucid_fx_convert_report
        print(f"convert without a lowering: {before}")

        lucid_fx.register_lowering("squash", lower_squash, backend="cpu")
        qmodel = lucid_fx.convert(prepared)
        lowered = list(LOWERED)
        # simulated int8, float ops (it lowers the graph too, to learn which values int8 rounds: LOWERED grows)
        reference = lucid_fx.convert(prepared, reference=True)
    report = qmodel.lucid_fx_convert_report
    print(f"convert with lower_squash: {report} (lowered by our rule: {', '.join(lowered)})")
    table_line = next(line.strip().split(";")[0] for line in qmodel.code.splitlines() if "lucid_fx.lut" in line)
    print(f"in qmodel.code: {table_line}")
    results = {
        "sqnr_db": sqnr_db(model(test), qmodel(test)),
        # fc2 gives its float result (nothing reads its codes), in the simulation too
        "max_diff_vs_reference": (qmodel(test) - reference(test)).abs().max().item(),
        "output_scale": float(prepared.lucid_fx_observers["fc2"].calculate_qparams()[0]),
        "report": report,
        "lowered": lowered,
        "row": row,
        "before": before,
        "plain": plain,
        "code": qmodel.code,
    }
    print(
        f"SQNR int8 vs fp32: {results['sqnr_db']:.1f} dB; max |int8 - reference| {results['max_diff_vs_reference']:.4f} "
        f"(output grid step {results['output_scale']:.4f})"
    )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="calibrate on 4 batches instead of 32")
    main(parser.parse_args().quick)
