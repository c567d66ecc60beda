"""Elementwise tables on 8-bit codes: one lookup's cost, composing chains, and float islands (question 6).

    python benchmarks/prototypes/lut_compose.py

1. One 256-entry lookup over 64x1024 uint8 codes by each route (all equal to ``lucid_fx::lut``).
2. A chain of two lookups (``(tanh(x) + 1) / 2`` converts to lut(tanh) then lut(add-div)) against the
   one composed table ``t2[t1]`` (exactly the same codes).
3. The gated MLP's middle, ``tanh(v) * sigmoid(g)`` feeding the last linear, given the two linears'
   outputs: today's int8 ops (lut, lut, mul), the float island (the linears emit float32 - same kernel
   cost - then tanh, sigmoid, mul and one quantize), the island with tanh fused into the value linear
   (oneDNN's linear has a tanh post-op, no sigmoid), and the island compiled by inductor.

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread, one run): one lookup lucid_fx::lut 53 us,
index_select int32 79, gather 82, take 155, table[q.long()] 218, float dequant/tanh/quantize 322; two
chained lookups 107 us against one composed 53 us (same codes). Gated middle: today 193 us, float island
eager 237, island with tanh fused into the value linear 66, inductor 181, inductor with tanh fused 76;
the linear's tanh post-op costs 40-65 us of its ~500 us.
"""

import warnings

import torch

import lucid_fx  # noqa: F401
from _timing import interleaved, table
from lucid_fx.kernels.reference import make_lut

warnings.simplefilter("ignore")
MAGIC = 12582912.0


def quantize_magic(x, inv, zp, qmin=0, qmax=255):
    return torch.mul(x, inv).clamp_(qmin - zp, qmax - zp).add_(MAGIC + zp).view(torch.int32).to(torch.uint8)


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (64, 1024), dtype=torch.uint8, generator=g)
    t_tanh = make_lut(torch.tanh, 0.02, 128, (0, 255), 1 / 128, 128, (0, 255))
    t_half = make_lut(lambda y: (y + 1) / 2, 1 / 128, 128, (0, 255), 1 / 256, 0, (0, 255))
    expected = torch.ops.lucid_fx.lut(q, t_tanh)
    t64, t32 = t_tanh.long(), t_tanh
    routes = {
        "lucid_fx::lut (pair table)": lambda: torch.ops.lucid_fx.lut(q, t_tanh),
        "torch.take(int64 index)": lambda: torch.take(t_tanh, q.long()),
        "index_select(int32 index)": lambda: torch.index_select(t32, 0, q.view(-1).int()).view(q.shape),
        "index_select(int64 index)": lambda: torch.index_select(t32, 0, q.view(-1).long()).view(q.shape),
        "table[q.long()]": lambda: t_tanh[q.long()],
        "gather rows (reference)": lambda: torch.gather(t_tanh.expand(64, 256), 1, q.long()),
        "float: dequant, tanh, quantize": lambda: quantize_magic(torch.tanh(q.float().sub_(128).mul_(0.02)), 128.0, 128),
    }
    for name, fn in routes.items():
        assert torch.equal(fn(), expected) or name.startswith("float"), name
    print("one 256-entry lookup, 64x1024 uint8:")
    print(table(interleaved(routes)))
    composed = t_half[t_tanh.long()]
    two = torch.ops.lucid_fx.lut(torch.ops.lucid_fx.lut(q, t_tanh), t_half)
    print(f"composed table equals the chain: {torch.equal(torch.ops.lucid_fx.lut(q, composed), two)}")
    print(table(interleaved({"two lookups": lambda: torch.ops.lucid_fx.lut(torch.ops.lucid_fx.lut(q, t_tanh), t_half),
                             "one composed lookup": lambda: torch.ops.lucid_fx.lut(q, composed)})))

    # the gated MLP's middle: v, g from the two linears (codes, or float when the linear emits float32)
    v_codes = torch.randint(0, 256, (64, 1024), dtype=torch.uint8, generator=g)
    g_codes = torch.randint(0, 256, (64, 1024), dtype=torch.uint8, generator=g)
    v_f, g_f = v_codes.float().sub_(128).mul_(0.02), g_codes.float().sub_(128).mul_(0.03)
    t_sig = make_lut(torch.sigmoid, 0.03, 128, (0, 255), 1 / 256, 0, (0, 255))
    tanh_v = torch.tanh(v_f)

    def today():
        a = torch.ops.lucid_fx.lut(v_codes, t_tanh)
        b = torch.ops.lucid_fx.lut(g_codes, t_sig)
        return torch.ops.lucid_fx.mul(a, 1 / 128, 128, b, 1 / 256, 0, 1 / 128, 128, "none")

    def island():
        return quantize_magic(torch.tanh(v_f).mul_(torch.sigmoid(g_f)), 128.0, 128)

    def island_tanh_fused():  # tanh already applied by the value linear's post-op
        return quantize_magic(torch.sigmoid(g_f).mul_(tanh_v), 128.0, 128)

    compiled = torch.compile(lambda v, gg: torch.clamp(torch.round(torch.tanh(v) * torch.sigmoid(gg) * 128.0) + 128,
                                                       0, 255).to(torch.uint8), dynamic=False)
    compiled_tanh = torch.compile(lambda t, gg: torch.clamp(torch.round(t * torch.sigmoid(gg) * 128.0) + 128,
                                                            0, 255).to(torch.uint8), dynamic=False)
    middle = {"today: lut, lut, mul (int8)": today, "float island (eager)": island,
              "float island, tanh in linear": island_tanh_fused,
              "float island, inductor": lambda: compiled(v_f, g_f),
              "float island, tanh in linear, inductor": lambda: compiled_tanh(tanh_v, g_f)}
    print("gated MLP middle tanh(v) * sigmoid(g) -> codes for the last linear, 64x1024:")
    print(table(interleaved(middle)))

    # the two linears' cost by output dtype (the float island needs float32 outputs)
    qw = torch.randint(-128, 128, (1024, 1024), dtype=torch.int8, generator=g)
    ws, zeros, bias = torch.rand(1024) * 0.001, torch.zeros(1024, dtype=torch.int64), torch.randn(1024)
    packed = torch.ops.onednn.qlinear_prepack(qw, None)
    x = torch.randint(0, 256, (64, 1024), dtype=torch.uint8, generator=g)
    lin = torch.ops.onednn.qlinear_pointwise.default
    outs = {"linear -> uint8": lambda: lin(x, 0.05, 0, packed, ws, zeros, bias, 0.02, 128, None, "none", [], ""),
            "linear -> float32": lambda: lin(x, 0.05, 0, packed, ws, zeros, bias, 1.0, 0, torch.float32, "none", [], ""),
            "linear + tanh -> float32": lambda: lin(x, 0.05, 0, packed, ws, zeros, bias, 1.0, 0, torch.float32, "tanh",
                                                   [], ""),
            "linear + tanh -> uint8": lambda: lin(x, 0.05, 0, packed, ws, zeros, bias, 1 / 128, 128, None, "tanh", [], "")}
    print("the value/gate linear (64x1024 @ 1024x1024) by output:")
    print(table(interleaved(outs)))


if __name__ == "__main__":
    main()
