"""Which oneDNN route runs an int8 linear fastest on this CPU kind (per-target lowering decisions).

    python benchmarks/prototypes/linear_paths.py                          # this CPU (VNNI here)
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/prototypes/linear_paths.py  # oneDNN's no-VNNI kernels

Linear 1024 -> 1024 at batch 1 and 64 (weights on [-64, 63], exact on every kind), each route checked
equal to the first: ``qlinear_pointwise`` with uint8 input and the zero point folded into the bias, with
the zero point left to oneDNN, with int8 input (accepted by torch 2.13's qlinear; conv takes uint8 only),
and as a 1x1 ``qconv2d_pointwise`` over a channels-last view of the rows (lucid_fx's choice without VNNI).

Figures here (AMD EPYC, torch 2.13.0, 1 thread, us, batch 1 / batch 64):
- AVX512-VNNI: u8 zp folded 95 / 760; zp left to oneDNN 107 / 754; s8 input 84331 / 5226455 (a
  reference kernel); 1x1 conv 118 / 99025 (a cliff at 64 rows).
- ONEDNN_MAX_CPU_ISA=AVX2: u8 zp folded 225 / 1416; zp left 318 / 1497; s8 input 21246 / 58792;
  1x1 conv 108 / 1261 (2.1x / 1.1x: lucid_fx's no-VNNI choice holds).
"""

import os

import torch

from _timing import interleaved, table


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')!r}")
    g = torch.Generator().manual_seed(0)
    n = k = 1024
    qw = torch.randint(-64, 64, (n, k), dtype=torch.int8, generator=g)
    ws, bias, zeros = torch.rand(n, generator=g) * 0.001, torch.randn(n, generator=g), torch.zeros(n, dtype=torch.int64)
    x_scale, x_zp = 0.05, 100
    sums = qw.sum(1, dtype=torch.int64).double()
    folded = (bias.double() - x_scale * x_zp * ws.double() * sums).float()
    packed = torch.ops.onednn.qlinear_prepack(qw, None)
    cpacked = torch.ops.onednn.qconv_prepack(qw.view(n, k, 1, 1), ws, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
    lin, conv = torch.ops.onednn.qlinear_pointwise.default, torch.ops.onednn.qconv2d_pointwise.default
    for m in (1, 64):
        x = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
        xs8 = (x ^ 128).view(torch.int8)  # the same values as int8 codes with zero point x_zp - 128
        image = x.as_strided((1, k, 1, m), (m * k, 1, m * k, k))
        routes = {
            "u8, zp folded": lambda: lin(x, x_scale, 0, packed, ws, zeros, folded, 0.02, 128, None, "relu", [], ""),
            "u8, zp in oneDNN": lambda: lin(x, x_scale, x_zp, packed, ws, zeros, bias, 0.02, 128, None, "relu", [], ""),
            "s8 input, zp in oneDNN": lambda: lin(xs8, x_scale, x_zp - 128, packed, ws, zeros, bias, 0.02, 128,
                                                  torch.uint8, "relu", [], ""),
            "1x1 conv, zp folded": lambda: conv(image, x_scale, 0, cpacked, ws, zeros, folded, [1, 1], [0, 0], [1, 1], 1,
                                                0.02, 128, None, "relu", [], None).permute(0, 2, 3, 1).reshape(m, n),
        }
        first = next(iter(routes.values()))()
        for name, fn in routes.items():
            diff = int((fn().int() - first.int()).abs().max())
            print(f"  batch {m}: {name:<24} max code diff vs first: {diff}")
        print(f"linear {k}->{n}, batch {m}:")
        print(table(interleaved(routes)))


if __name__ == "__main__":
    main()
