"""What torch 2.13's ``torch.ops.onednn.q{linear,conv2d}_pointwise`` overloads accept, and how exact they are.

    python benchmarks/prototypes/onednn_calls.py            # the table, on this CPU
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/prototypes/onednn_calls.py   # the no-VNNI kernels

Each row tries one call on a small layer (linear 64 -> 48 on 8 rows, conv 16 -> 24 3x3 on 1x16x10x10,
weights on [-64, 63] so the AVX2 kernels are exact too) and prints "ok" with the largest difference in
codes from a float64 oracle ``quantize(post(dequant(x) @ dequant(w).T + bias))`` (ties counted as they
fall: a difference of 1 on a rounding tie is float32 rounding, not a bug), or the error's first words.
For a float output the difference is in output steps of the int8 output's scale.

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0; the same under ONEDNN_MAX_CPU_ISA=AVX2 except that
qlinear "add" with a bf16 other fails to create a primitive there):
- qlinear .default/.tensor: input uint8 or int8 (float32/bf16 rejected); output None (= input dtype),
  uint8, int8, float32, bf16 (float outputs need scale 1, zero point 0); post-ops none, relu, hardtanh
  [lo, hi], hardswish, swish, tanh, gelu (algorithm "none" or "tanh"), leaky_relu [slope]; sigmoid and
  "silu" rejected. 0 code difference from the float64 oracle on every accepted integer/float32 row.
- qlinear .binary "sum": other must have the output's dtype; written in place and returned (same tensor);
  unary after it none/relu. "add": exact with a float32/bf16 other; a uint8/int8 other is accepted but
  added raw (other_scale/zp ignored: 255-code errors).
- qconv2d .default: input uint8 only; post-ops none, relu, hardtanh, hardswish, swish (tanh, gelu,
  leaky_relu, sigmoid rejected); exact. .binary: "sum" only (add rejected), accum uint8/int8 and
  channels-last, output takes the accum's dtype, the accum is written AND a copy is returned; a float32
  accum with an integer output is accepted and wrong (no check).
"""

import itertools
import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
OPS = torch.ops.onednn

POST = {  # label -> (scalars, algorithm, float64 function); the op name is the label's first word
    "none": ([], "", lambda y: y),
    "relu": ([], "", F.relu),
    "hardtanh": ([0.0, 6.0], "", lambda y: y.clamp(0.0, 6.0)),
    "hardswish": ([], "", F.hardswish),
    "swish": ([], "", F.silu),
    "silu": ([], "", F.silu),
    "sigmoid": ([], "", torch.sigmoid),
    "tanh": ([], "", torch.tanh),
    "gelu": ([], "none", F.gelu),
    "gelu tanh": ([], "tanh", lambda y: F.gelu(y, approximate="tanh")),
    "leaky_relu": ([0.1], "", lambda y: F.leaky_relu(y, 0.1)),
}

X_SCALE, X_ZP, OUT_SCALE, OUT_ZP = 0.05, 7, 0.04, 100


def codes(y, scale, zp, dtype):
    info = torch.iinfo(dtype)
    return torch.clamp(torch.round(y / scale) + zp, info.min, info.max)


def oracle(x_real, w_real, bias, post, out_dtype):
    y = POST[post][2](x_real @ w_real.T + bias) if w_real.dim() == 2 else POST[post][2](
        F.conv2d(x_real, w_real, bias, 1, 1))
    return y


def compare(out, y, out_dtype, out_scale, out_zp):
    if out.dtype in (torch.float32, torch.bfloat16):
        return float(((out.double() - y).abs() / OUT_SCALE).max())
    return float((out.double() - codes(y, out_scale, out_zp, out.dtype)).abs().max())


def inputs(in_dtype, shape):
    if in_dtype == torch.uint8:
        q = torch.randint(0, 256, shape, dtype=torch.uint8)
        return q, (q.double() - X_ZP) * X_SCALE, X_ZP
    if in_dtype == torch.int8:
        q = torch.randint(-128, 128, shape, dtype=torch.int8)
        return q, (q.double() - X_ZP) * X_SCALE, X_ZP
    x = torch.randn(shape).to(in_dtype)
    return x, x.double(), 0


def try_call(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return None, " ".join(str(exc).split())[:110]


def linear_rows():
    qw = torch.randint(-64, 64, (48, 64), dtype=torch.int8)
    ws = torch.rand(48) * 0.01 + 0.002
    bias = torch.randn(48)
    packed = OPS.qlinear_prepack(qw, None)
    w_real = qw.double() * ws.double()[:, None]
    for in_dtype, out_dtype, post in itertools.product(
            (torch.uint8, torch.int8, torch.float32, torch.bfloat16),
            (None, torch.uint8, torch.int8, torch.float32, torch.bfloat16), POST):
        if in_dtype in (torch.float32, torch.bfloat16) and post not in ("none", "relu"):
            continue
        q, x_real, zp = inputs(in_dtype, (8, 64))
        flt = out_dtype in (torch.float32, torch.bfloat16)
        scale, ozp = (1.0, 0) if flt else (OUT_SCALE, OUT_ZP + (-128 if out_dtype == torch.int8 else 0))
        scalars, algo, _ = POST[post]
        out, err = try_call(lambda: OPS.qlinear_pointwise.default(
            q, X_SCALE if zp else 1.0, zp, packed, ws, torch.zeros(48, dtype=torch.int64), bias, scale, ozp,
            out_dtype, post.split()[0], scalars, algo))
        yield ("qlinear.default", str(in_dtype)[6:], str(out_dtype)[6:] if out_dtype else "None", post,
               out, err, lambda o: compare(o, oracle(x_real, w_real, bias.double(), post, out_dtype), out_dtype,
                                           scale, ozp))
    # .tensor: qparams as tensors
    q, x_real, zp = inputs(torch.uint8, (8, 64))
    out, err = try_call(lambda: OPS.qlinear_pointwise.tensor(
        q, torch.tensor(X_SCALE), torch.tensor(zp), packed, ws, torch.zeros(48, dtype=torch.int64), bias, OUT_SCALE,
        OUT_ZP, None, "relu", [], ""))
    yield ("qlinear.tensor", "uint8", "None", "relu", out, err,
           lambda o: compare(o, oracle(x_real, w_real, bias.double(), "relu", None), None, OUT_SCALE, OUT_ZP))
    # .binary: sum (accumulator = output, its dtype), add (other any float/int8 dtype)
    for binary, other_dtype, out_dtype, post in itertools.product(
            ("sum", "add"), (torch.uint8, torch.int8, torch.float32, torch.bfloat16),
            (None, torch.uint8, torch.int8, torch.float32, torch.bfloat16), ("none", "relu", "hardswish")):
        q, x_real, zp = inputs(torch.uint8, (8, 64))
        flt = out_dtype in (torch.float32, torch.bfloat16)
        scale, ozp = (1.0, 0) if flt else (OUT_SCALE, OUT_ZP + (-128 if out_dtype == torch.int8 else 0))
        if other_dtype in (torch.uint8, torch.int8):
            o_q, o_real, o_zp = inputs(other_dtype, (8, 48))
            o_scale = X_SCALE
        else:
            o_q = torch.randn(8, 48).to(other_dtype)
            o_real, o_zp, o_scale = o_q.double(), 0, 1.0
        accum = o_q.clone()
        out, err = try_call(lambda: OPS.qlinear_pointwise.binary(
            q, X_SCALE, zp, packed, ws, torch.zeros(48, dtype=torch.int64), accum, bias, scale, ozp, out_dtype,
            o_scale, o_zp, binary, 1.0, post, [], ""))

        def check(o, x_real=x_real, o_real=o_real, post=post, out_dtype=out_dtype, scale=scale, ozp=ozp):
            y = POST[post][2](x_real @ w_real.T + bias.double() + o_real)
            return compare(o, y, out_dtype, scale, ozp)

        alias = "" if out is None else (" =other" if out.data_ptr() == accum.data_ptr() else
                                        " (other changed)" if not torch.equal(accum, o_q) else "")
        yield (f"qlinear.binary {binary}", f"u8, other {str(other_dtype)[6:]}",
               (str(out_dtype)[6:] if out_dtype else "None") + alias, post, out, err, check)


def conv_rows():
    qw = torch.randint(-64, 64, (24, 16, 3, 3), dtype=torch.int8)
    ws = torch.rand(24) * 0.01 + 0.002
    bias = torch.randn(24)
    packed = OPS.qconv_prepack(qw, ws, 1.0, 0, [1, 1], [1, 1], [1, 1], 1, [1, 16, 10, 10])
    w_real = qw.double() * ws.double()[:, None, None, None]
    zeros = torch.zeros(24, dtype=torch.int64)
    for in_dtype, out_dtype, post in itertools.product(
            (torch.uint8, torch.int8, torch.float32), (None, torch.uint8, torch.int8, torch.float32, torch.bfloat16),
            POST):
        if in_dtype != torch.uint8 and post != "none":
            continue
        q, x_real, zp = inputs(in_dtype, (1, 16, 10, 10))
        q = q.contiguous(memory_format=torch.channels_last)
        flt = out_dtype in (torch.float32, torch.bfloat16)
        scale, ozp = (1.0, 0) if flt else (OUT_SCALE, OUT_ZP + (-128 if out_dtype == torch.int8 else 0))
        scalars, algo, _ = POST[post]
        out, err = try_call(lambda: OPS.qconv2d_pointwise.default(
            q, X_SCALE if zp else 1.0, zp, packed, ws, zeros, bias, [1, 1], [1, 1], [1, 1], 1, scale, ozp, out_dtype,
            post.split()[0], scalars, algo or None))
        yield ("qconv2d.default", str(in_dtype)[6:], str(out_dtype)[6:] if out_dtype else "None", post, out, err,
               lambda o: compare(o, oracle(x_real, w_real, bias.double(), post, out_dtype), out_dtype, scale, ozp))
    for binary, other_dtype, out_dtype, post in itertools.product(
            ("sum", "add"), (torch.uint8, torch.int8, torch.float32), (None, torch.uint8, torch.float32),
            ("none", "relu", "hardswish")):
        q, x_real, zp = inputs(torch.uint8, (1, 16, 10, 10))
        q = q.contiguous(memory_format=torch.channels_last)
        flt = out_dtype in (torch.float32, torch.bfloat16)
        scale, ozp = (1.0, 0) if flt else (OUT_SCALE, OUT_ZP)
        if other_dtype in (torch.uint8, torch.int8):
            o_q, o_real, o_zp = inputs(other_dtype, (1, 24, 10, 10))
            o_scale = X_SCALE
        else:
            o_q = torch.randn(1, 24, 10, 10)
            o_real, o_zp, o_scale = o_q.double(), 0, 1.0
        accum = o_q.contiguous(memory_format=torch.channels_last)
        out, err = try_call(lambda: OPS.qconv2d_pointwise.binary(
            q, X_SCALE, zp, packed, ws, zeros, accum, bias, [1, 1], [1, 1], [1, 1], 1, scale, ozp, out_dtype,
            o_scale, o_zp, binary, 1.0, post, [], ""))

        def check(o, x_real=x_real, o_real=o_real, post=post, out_dtype=out_dtype, scale=scale, ozp=ozp):
            y = POST[post][2](F.conv2d(x_real, w_real, bias.double(), 1, 1) + o_real)
            return compare(o, y, out_dtype, scale, ozp)

        alias = "" if out is None else (" =accum" if out.data_ptr() == accum.data_ptr() else
                                        " (copy; accum changed)" if not torch.equal(accum, o_q) else " (copy)")
        yield (f"qconv2d.binary {binary}", f"u8, accum {str(other_dtype)[6:]}",
               (str(out_dtype)[6:] if out_dtype else "None") + alias, post, out, err, check)


def main(verbose: bool = "-v" in sys.argv):
    """One line per (call, input, output dtype asked): the post-ops accepted, with the largest code
    difference over them, and the rejected ones grouped by message (``-v``: one line per call)."""
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    groups = {}
    for name, ind, outd, post, out, err, check in itertools.chain(linear_rows(), conv_rows()):
        entry = groups.setdefault((name, ind, outd.split(" ")[0]), {"ok": {}, "no": {}, "note": set()})
        if err:
            entry["no"].setdefault(err[:70], []).append(post)
        else:
            entry["ok"][post] = check(out)
            entry["note"].add(f"out {str(out.dtype)[6:]}" + (outd[len(outd.split(' ')[0]):]))
        if verbose:
            print(name, ind, outd, post, err or f"max |diff| {check(out):.2f}")
    for (name, ind, outd), entry in groups.items():
        line = f"{name:<19} in {ind:<20} out_dtype {outd:<9}"
        if entry["ok"]:
            worst = max(entry["ok"].values())
            line += f" OK {'/'.join(entry['ok'])} [{', '.join(sorted(entry['note']))}] max|diff| {worst:.2f}"
        for msg, posts in entry["no"].items():
            line += f" | NO {'/'.join(posts)}: {msg}"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
