"""Pooling uint8 codes on CPU without a detour through int16 or float (issue 13, question 5).

    python benchmarks/prototypes/int8_pools.py

max_pool2d 3x3/2 pad 1 over ResNet's first activation (1x64x112x112 uint8, channels-last), and global
average pooling over 1x512x7x7 and 1x576x7x7 uint8 codes, each candidate checked equal to lucid_fx's
op (the max-pool exactly, the average within 1 code: lucid_fx rounds the float mean).

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread, one run): max-pool lucid_fx (int16)
482 us, taps padded 164 us (2.9x), taps without the padded copy 136 us (3.5x), via float32 655 us, torch
uint8 NCHW 7657 us, torch uint8 channels-last rejected; all equal. Global average pool: int32 sum or
float mean 1.3-1.8x faster than lucid_fx's op, same codes.
"""

import torch
import torch.nn.functional as F

import lucid_fx  # noqa: F401
from _timing import interleaved, table


def max_lucid(q):
    return torch.ops.lucid_fx.max_pool2d(q, [3, 3], [2, 2], [1, 1], [1, 1], False)


def max_torch_u8(q):  # torch's own uint8 max-pool (with indices internally)
    return F.max_pool2d(q, 3, 2, 1)


def max_taps(q, k=3, s=2, p=1):
    """Max of the k*k strided views of the zero-padded codes, rows then columns (2*(k-1) maximum ops).

    Padding with 0, the smallest uint8 code, is exact while every window holds a real element."""
    n, c, h, w = q.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    padded = F.pad(q, (p, p, p, p))  # keeps channels-last
    rows = padded[:, :, 0:s * (oh - 1) + 1:s, :]
    for i in range(1, k):
        rows = torch.maximum(rows, padded[:, :, i:i + s * (oh - 1) + 1:s, :])
    out = rows[:, :, :, 0:s * (ow - 1) + 1:s]
    for j in range(1, k):
        out = torch.maximum(out, rows[:, :, :, j:j + s * (ow - 1) + 1:s])
    return out


def max_taps_nopad(q, k=3, s=2, p=1):
    """As :func:`max_taps` without the padded copy: the border rows/columns take fewer taps."""
    n, c, h, w = q.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    # rows: output row r covers input rows s*r - p + i, i < k; for p=1, s=2, k=3: 2r-1, 2r, 2r+1
    rows = q[:, :, 0:s * oh:s, :].clone(memory_format=torch.channels_last)  # tap i = p (centre)
    torch.maximum(rows[:, :, 1:], q[:, :, 1:s * (oh - 1):s, :], out=rows[:, :, 1:])  # tap i = 0 (r >= 1)
    last = min(oh, (h - 2) // s + 1)
    torch.maximum(rows[:, :, :last], q[:, :, 1:s * last:s, :], out=rows[:, :, :last])  # tap i = 2
    out = rows[:, :, :, 0:s * ow:s].clone(memory_format=torch.channels_last)
    torch.maximum(out[:, :, :, 1:], rows[:, :, :, 1:s * (ow - 1):s], out=out[:, :, :, 1:])
    lastw = min(ow, (w - 2) // s + 1)
    torch.maximum(out[:, :, :, :lastw], rows[:, :, :, 1:s * lastw:s], out=out[:, :, :, :lastw])
    return out


def max_float(q):  # through float32 (mkldnn/ATen float kernels), for comparison
    return F.max_pool2d(q.float(), 3, 2, 1).to(torch.int16).to(torch.uint8)


S_IN, Z_IN, S_OUT, Z_OUT = 0.02, 0, 0.015, 0


def avg_lucid(q):
    return torch.ops.lucid_fx.adaptive_avg_pool2d(q, S_IN, Z_IN, [1, 1], S_OUT, Z_OUT)


def avg_sum_int(q):
    """Sum the codes in int32 (exact), then one tiny float requantization of the N x C sums."""
    hw = q.shape[2] * q.shape[3]
    total = q.sum((2, 3), keepdim=True, dtype=torch.int32)
    y = total.to(torch.float32).sub_(Z_IN * hw).mul_(S_IN / (S_OUT * hw)).round_().add_(Z_OUT).clamp_(0, 255)
    return y.to(torch.int16).to(torch.uint8)


def avg_mean_f32(q):
    y = q.mean((2, 3), keepdim=True, dtype=torch.float32)
    return y.sub_(Z_IN).mul_(S_IN / S_OUT).round_().add_(Z_OUT).clamp_(0, 255).to(torch.int16).to(torch.uint8)


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    q = torch.randint(0, 256, (1, 64, 112, 112), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    qn = q.contiguous()
    expected = max_lucid(q)
    cands = {"lucid_fx (int16)": lambda: max_lucid(q), "taps, padded": lambda: max_taps(q),
             "taps, no pad": lambda: max_taps_nopad(q), "via float32": lambda: max_float(q),
             "torch uint8 NCHW": lambda: max_torch_u8(qn)}
    try:
        max_torch_u8(q)
        cands["torch uint8 channels-last"] = lambda: max_torch_u8(q)
    except RuntimeError as exc:
        print("  torch uint8 max_pool2d on channels-last:", " ".join(str(exc).split())[:100])
    for name, fn in cands.items():
        out = fn()
        print(f"  {name:<26} equal: {torch.equal(out, expected)}, channels-last: "
              f"{out.is_contiguous(memory_format=torch.channels_last)}")
    print("max_pool2d 3x3/2 pad 1, 1x64x112x112 uint8:")
    print(table(interleaved(cands)))
    for shape in [(1, 512, 7, 7), (1, 576, 7, 7), (1, 960, 14, 14)]:
        q = torch.randint(0, 256, shape, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        expected = avg_lucid(q)
        cands = {"lucid_fx": lambda: avg_lucid(q), "int32 sum": lambda: avg_sum_int(q),
                 "float mean": lambda: avg_mean_f32(q)}
        diffs = {n: int((fn().int() - expected.int()).abs().max()) for n, fn in cands.items()}
        print(f"global average pool {shape} (max code diff vs lucid_fx: {diffs}):")
        print(table(interleaved(cands)))


if __name__ == "__main__":
    main()
