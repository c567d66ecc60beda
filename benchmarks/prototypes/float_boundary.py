"""Quantize and dequantize at the float boundary in as few passes as possible (issue 13, question 4).

    python benchmarks/prototypes/float_boundary.py

Quantize spec (lucid_fx.quantization.quantize): ``clamp(round_half_even(x * f32(1/scale)) + zp, qmin, qmax)``.
Each candidate is timed (1 thread, interleaved medians) on 1x3x224x224 and 64x1024 float32 inputs, and its
codes compared with ``torch.ops.lucid_fx.quantize_per_tensor`` on 10M values placed near rounding ties
(``mismatches``). Dequantize candidates are compared in float32 ulps with ``(q - zp) * scale``.

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread, one run):
- casts of 150k values: float32 -> uint8 98 us, -> int8 12 us, -> int16 14 us, -> int32 20 us.
- quantize 1x3x224x224 / 64x1024 (us): lucid_fx op 212 / 72, aten chain (5 ops) 217 / 62, via int16
  104 / 36, magic number (4 ops) 78 / 27 (2.7x), torch.compile 77 / 32, quint8 + int_repr (deprecated)
  172 / 46. Mismatches in 10M near-tie values: 0 for all but add-alpha and quint8 (340k, 1 code);
  the 4-op magic with an odd zero point: 435k (hence a separate round_ then, 0).
- dequantize: all within 10-25% (to/sub_/mul_ exact; add with alpha 1 op, exact here with zp 128).
"""

import torch

import lucid_fx  # noqa: F401  (registers torch.ops.lucid_fx)
from _timing import interleaved, table

SCALE, ZP = 0.0307, 128
INV = float(1.0 / torch.tensor(SCALE, dtype=torch.float32))
F32_SCALE = float(torch.tensor(SCALE, dtype=torch.float32))
ZP_T = torch.tensor(float(ZP))


def q_lucid(x):
    return torch.ops.lucid_fx.quantize_per_tensor(x, SCALE, ZP, 0, 255, torch.uint8)


def q_chain5(x):  # mul, round_, add_, clamp_, to: the spec, op by op
    return torch.mul(x, INV).round_().add_(ZP).clamp_(0, 255).to(torch.uint8)


def q_chain_i16(x):  # the spec, but narrowed through int16: float32 -> uint8 has no fast cast in torch 2.13
    return torch.mul(x, INV).round_().add_(ZP).clamp_(0, 255).to(torch.int16).to(torch.uint8)


MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 below 2**22 to an integer, half to even


def q_magic(x, zp=ZP):
    """mul, clamp_, add_(MAGIC + zp), one int32 -> uint8 narrowing: 4 passes, no float -> uint8 cast.

    clamp(round(v)) == round(clamp(v)) for integer bounds, and ``v + MAGIC`` rounds ``v`` half to even
    (the float32 spacing there is 1) leaving ``MAGIC + code`` whose low byte is the code. The add rounds
    ties to an even *sum*: right for an even zero point only (see :func:`q_magic_round`)."""
    t = torch.mul(x, INV).clamp_(-zp, 255 - zp).add_(MAGIC + zp)
    return t.view(torch.int32).to(torch.uint8)


def q_magic_round(x, zp=ZP):  # round_ first, then the magic add is exact: any zero point, 5 passes
    t = torch.mul(x, INV).clamp_(-zp, 255 - zp).round_().add_(MAGIC + zp)
    return t.view(torch.int32).to(torch.uint8)


def q_alpha_add4(x):  # add(zp, x, alpha=1/scale) rounds x/scale + zp once: codes can differ at ties
    return torch.add(ZP_T, x, alpha=INV).round_().clamp_(0, 255).to(torch.uint8)


def q_deprecated(x):  # for the record only: the quint8 kernel (deprecated dtype) and a copy out
    return torch.quantize_per_tensor(x, SCALE, ZP, torch.quint8).int_repr()


def _compiled():
    fn = torch.compile(q_chain5, dynamic=False)
    return fn


def dq_lucid(q):
    return torch.ops.lucid_fx.dequantize_per_tensor(q, SCALE, ZP)


def dq_chain3(q):  # to, sub_, mul_: bit-identical to the spec
    return q.to(torch.float32).sub_(ZP).mul_(F32_SCALE)


def dq_alpha_add(q):  # -zp*s + s*q in one op: 1 ulp off where rounding differs
    return torch.add(torch.tensor(-ZP * F32_SCALE), q, alpha=F32_SCALE)


def dq_to_then_alpha(q):  # to(float32) (a fast cast), then -zp*s + s*y in place: 2 passes
    return q.to(torch.float32).mul_(F32_SCALE).sub_(ZP * F32_SCALE)


TABLE = (torch.arange(256, dtype=torch.float32) - ZP) * F32_SCALE


def dq_table(q):  # a 256-entry float table indexed by the codes (needs an int index)
    return torch.take(TABLE, q.to(torch.int64))


def ties(n=10_000_000):
    """Values whose x/scale lies within a few ulps of k + 0.5, and plain random ones."""
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-140, 140, (n // 2,), generator=g).float() + 0.5
    near = (k + (torch.randint(-3, 4, (n // 2,), generator=g).float() * 2**-17)) * SCALE
    return torch.cat([near, torch.randn(n // 2, generator=g) * 3])


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; quantize scale {SCALE} zp {ZP} -> uint8")
    data = ties()
    expected = q_lucid(data)
    compiled = _compiled()
    quantizers = {"lucid_fx op": q_lucid, "aten chain (5 ops)": q_chain5, "chain via int16 (6 ops)": q_chain_i16,
                  "magic number (4 ops)": q_magic, "round, then magic (5 ops)": q_magic_round,
                  "add alpha (4 ops)": q_alpha_add4, "torch.compile chain": compiled,
                  "quint8 + int_repr (deprecated)": q_deprecated}
    for name, fn in quantizers.items():
        got = fn(data)
        print(f"  {name:<32} mismatches vs lucid_fx: {int((got != expected).sum())} of {data.numel()}"
              f" (max |diff| {int((got.int() - expected.int()).abs().max())})")
    odd = torch.ops.lucid_fx.quantize_per_tensor(data, SCALE, ZP - 1, 0, 255, torch.uint8)
    for name, fn in (("magic number (4 ops)", q_magic), ("round, then magic (5 ops)", q_magic_round)):
        got = fn(data, ZP - 1)
        print(f"  {name:<32} with odd zp {ZP - 1}: mismatches {int((got != odd).sum())} of {data.numel()}")
    x = torch.randn(1, 3, 224, 224)
    casts = {"float32 -> uint8": lambda: x.to(torch.uint8), "float32 -> int8": lambda: x.to(torch.int8),
             "float32 -> int16": lambda: x.to(torch.int16), "float32 -> int32": lambda: x.to(torch.int32),
             "int16 -> uint8": lambda: x.to(torch.int16).to(torch.uint8),
             "uint8 -> float32": lambda: x.to(torch.uint8).to(torch.float32), "float32 copy": lambda: x.clone()}
    print("casts, 1x3x224x224 (int16 -> uint8 and uint8 -> float32 include the first cast):")
    print(table(interleaved(casts)))
    for shape in [(1, 3, 224, 224), (64, 1024)]:
        x = torch.randn(shape) * 2
        print(f"quantize {shape}:")
        print(table(interleaved({name: (lambda fn=fn: fn(x)) for name, fn in quantizers.items()})))
    q = q_lucid(data)
    exact = dq_chain3(q)
    dequantizers = {"lucid_fx op": dq_lucid, "aten chain (3 ops)": dq_chain3, "add alpha (1 op)": dq_alpha_add,
                    "to, mul_, sub_ (2 roundings)": dq_to_then_alpha,
                    "256-entry table (take)": dq_table}
    for name, fn in dequantizers.items():
        got = fn(q)
        ulps = ((got - exact).abs() / torch.finfo(torch.float32).eps / exact.abs().clamp_min(1e-30)).max()
        print(f"  {name:<32} differs from (q - zp) * scale on {int((got != exact).sum())} of {q.numel()}"
              f" (max {float(ulps):.1f} ulp)")
    for shape in [(1, 3, 224, 224), (64, 1024)]:
        qx = q_lucid(torch.randn(shape) * 2)
        print(f"dequantize {shape}:")
        print(table(interleaved({name: (lambda fn=fn: fn(qx)) for name, fn in dequantizers.items()})))


if __name__ == "__main__":
    main()
