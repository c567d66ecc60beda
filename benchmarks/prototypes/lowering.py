"""Two-level lowering prototype: today's portable int8 graph -> a program of direct oneDNN calls.

    python benchmarks/prototypes/lowering.py [--models mlp_b1,mlp_b64,resnet_1x] [--rounds 9]

:func:`lower` takes a model converted by today's lucid_fx (``lucid_fx::*`` ops, the portable graph) and
builds a new GraphModule in which every decision is taken once, at lowering time:

- ``lucid_fx::linear`` / ``conv2d`` -> ``torch.ops.onednn.qlinear_pointwise.default`` /
  ``qconv2d_pointwise.default`` on weights prepacked once (plain module attributes: a packed mkldnn
  tensor cannot be deep-copied or pickled, see :func:`packed_weight_containers`), scales and zero
  points as Python constants, the activation zero point folded into the bias where lucid_fx folds it
  (linears; convolutions without padding), relu fused as today, int8 outputs made by oneDNN directly;
- ``lucid_fx::conv2d_add`` -> ``qconv2d_pointwise.binary`` with the "sum" post-op, writing into the
  residual's codes without a defensive copy when the add is the residual's last reader;
- ``quantize_per_tensor`` -> 4 or 5 aten ops (:func:`quantize_magic`: no float32 -> uint8 cast, the slow
  one in torch 2.13); ``dequantize_per_tensor`` -> fused into the kernel before it (float output,
  the grid's range kept by a hardtanh post-op; within half a step of today's output) or 3 aten ops;
- ``max_pool2d`` -> the maximum of strided views of the uint8 codes (:func:`max_pool_taps`);
- ``adaptive_avg_pool2d`` to 1x1 -> an int32 sum and one requantization.

Every other node stays as it was. :func:`main` checks each lowered program's output against today's
lucid_fx output (in steps of the output scale) and times fp32 eager, torch.ao FX (x86, onednn),
lucid_fx and the lowered program with ``benchmarks/overhead.py``'s profiler split.

Figures here (AMD EPYC 2 cores shared and heavily loaded, AVX512-VNNI, torch 2.13.0, 1 thread, medians
of 7 interleaved rounds; wall us, lowered with the dequantize fused / lucid_fx today / fastest peer):
mlp_b1 473 / 728 / 287 (torch.ao x86), mlp_b64 2506 / 2769 / 2354 (x86), resnet_1x 22646 / 25185 / 22281
(x86), encoder 23145 / 25656 / 20275 (onednn), gated_mlp 3435 / 3920 / 3112 (onednn), mobilenet_v3
11288 / 20184 / 9647 (onednn; fp32 13222), efficientnet 35433 / 45950 / 30049 (x86; fp32 41459).
Outputs identical to lucid_fx's on all seven models without the dequantize fusion, within 0.5 output
step with it. With ONEDNN_CACHE_CONTEXT_UNSAFE=1 (a separate run): mlp_b1 243 (peer 284), mlp_b64 2138
(2404), gated_mlp 2657 (2828), encoder 18637 (19624). Under ONEDNN_MAX_CPU_ISA=AVX2 (linears keep
lucid_fx's 1x1-conv path here): mlp_b64 4581 / 4846 (torch.ao x86 2254: fbgemm ignores the oneDNN cap).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from overhead import measure, variants_for  # noqa: E402
from int8_inference import cpu_line  # noqa: E402

from lucid_fx.kernels.cpu_features import cpu_features  # noqa: E402

LF, ON = torch.ops.lucid_fx, torch.ops.onednn
MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 below 2**22 half to even


def quantize_magic(x, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype):
    """Codes of ``x`` as lucid_fx's quantize_per_tensor makes them, in 4 passes (5 for an odd zero point).

    ``clamp(round(v)) == round(clamp(v))`` for integer bounds; ``v + MAGIC + zp`` rounds ``v`` and leaves
    ``MAGIC + code`` in float32, whose int32 bits end in the code's byte; the int32 -> 8-bit narrowing keeps
    that byte (measured 12 us for 150k values against 80-160 us for torch's float32 -> uint8 cast). The add
    rounds ties to an even *sum*, which is an even ``round(v)`` only when ``zp`` is even: an odd zero point
    rounds first (measured: 0 mismatches in 10M near-tie values either way; an odd zp without the separate
    round_ gave 1-code errors on exact ties)."""
    t = torch.mul(x, inv_scale).clamp_(qmin - zp, qmax - zp)
    if zp % 2:
        t = t.round_()
    return t.add_(MAGIC + zp).view(torch.int32).to(dtype)


def max_pool_taps(q, kernel, stride, padding):
    """max_pool2d of 8-bit codes as the maximum of strided views of the padded codes (rows, then
    columns); pads with the smallest code, exact while every window holds a real element."""
    k, s, p = kernel[0], stride[0], padding[0]
    h, w = q.shape[2], q.shape[3]
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    padded = F.pad(q, (p, p, p, p), value=0 if q.dtype == torch.uint8 else -128)
    rows = padded[:, :, 0:s * (oh - 1) + 1:s, :]
    for i in range(1, k):
        rows = torch.maximum(rows, padded[:, :, i:i + s * (oh - 1) + 1:s, :])
    out = rows[:, :, :, 0:s * (ow - 1) + 1:s]
    for j in range(1, k):
        out = torch.maximum(out, rows[:, :, :, j:j + s * (ow - 1) + 1:s])
    return out


def global_avg_pool(q, scale: float, zp: int, out_scale: float, out_zp: int):
    """adaptive_avg_pool2d(q, 1) of codes: an exact int32 sum, then one requantization of N x C values."""
    hw = q.shape[2] * q.shape[3]
    y = q.sum((2, 3), keepdim=True, dtype=torch.int32).to(torch.float32)
    y = y.sub_(zp * hw).mul_(scale / (out_scale * hw)).round_().add_(out_zp).clamp_(0, 255)
    return y.to(torch.int16).to(q.dtype)


def _packet(node: fx.Node):
    """The op of a call_function node whether the graph names the overload or the packet."""
    return getattr(node.target, "_overloadpacket", node.target)


def _attr(gm: fx.GraphModule, node: Optional[fx.Node]):
    if node is None:
        return None
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


class _Lowering:
    def __init__(self, gm: fx.GraphModule, example, fuse_dequantize: bool):
        self.gm = copy.deepcopy(gm)
        ShapeProp(self.gm).propagate(example)
        self.graph = self.gm.graph
        self.fuse_dequantize = fuse_dequantize
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}
        self.count = 0
        self.float_out = {}  # lowered kernel node -> index of its (scale, zp, dtype, post, args) arguments

    def const(self, value, hint: str) -> fx.Node:
        name = f"_low_{hint}_{self.count}"
        self.count += 1
        setattr(self.gm, name, value)  # a plain attribute: packed mkldnn tensors cannot be buffers that copy
        return self.graph.get_attr(name)

    def replace(self, node: fx.Node, target, args) -> fx.Node:
        with self.graph.inserting_before(node):
            new = self.graph.call_function(target, tuple(args))
        new.meta = dict(node.meta)  # the value's shape and dtype (a fused dequantize changes the dtype)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    def _folded(self, qw, ws, bias, x_scale, x_zp):
        """(zero point, bias) as lucid_fx's CPU kernel folds them (kernels/cpu.py: _zero_point_in_bias)."""
        if not x_zp:
            return 0, None if bias is None else bias.float()
        flat = qw.reshape(qw.shape[0], -1)
        if 255 * int(flat.abs().sum(1, dtype=torch.int64).max()) >= 2**24:
            return x_zp, None if bias is None else bias.float()
        sums = flat.sum(1, dtype=torch.int64).double()
        folded = -(x_scale * x_zp) * ws.double() * sums
        return 0, (folded if bias is None else folded + bias.double()).to(torch.float32)

    def linear(self, node):
        qx, x_scale, x_zp, qw_n, ws_n, b_n, out_scale, out_zp, post, out_dtype = node.args
        if qx.meta["tensor_meta"].dtype != torch.uint8 or not cpu_features().vnni:
            return  # prototype: uint8 activations on VNNI CPUs (AVX2 keeps lucid_fx's 1x1-conv path)
        qw, ws, bias = _attr(self.gm, qw_n), _attr(self.gm, ws_n).float(), _attr(self.gm, b_n)
        zp, bias = self._folded(qw, ws, bias, x_scale, x_zp)
        with self.graph.inserting_before(node):
            args = [qx, x_scale, zp, self.const(ON.qlinear_prepack(qw.contiguous(), None), "packed"),
                    self.const(ws, "wscale"), self.const(torch.zeros(qw.shape[0], dtype=torch.int64), "wzp"),
                    None if bias is None else self.const(bias, "bias")]
        dtype = out_dtype or torch.uint8
        tail = [1.0, 0, torch.float32] if dtype == torch.float32 else [out_scale, out_zp, dtype]
        new = self.replace(node, ON.qlinear_pointwise.default, args + tail + [post, [], ""])
        self.float_out[new] = 7

    def conv2d(self, node):
        qx, x_scale, x_zp, qw_n, ws_n, b_n, stride, padding, dilation, groups, out_scale, out_zp, post, out_dtype = \
            node.args
        meta = qx.meta["tensor_meta"]
        if meta.dtype != torch.uint8 or len(meta.shape) != 4:
            return
        qw, ws, bias = _attr(self.gm, qw_n), _attr(self.gm, ws_n).float(), _attr(self.gm, b_n)
        zp, bias = (x_zp, None if bias is None else bias.float()) if any(padding) else \
            self._folded(qw, ws, bias, x_scale, x_zp)
        packed = ON.qconv_prepack(qw.contiguous(), ws, 1.0, 0, stride, padding, dilation, groups, list(meta.shape))
        with self.graph.inserting_before(node):
            args = [qx, x_scale, zp, self.const(packed, "packed"), self.const(ws, "wscale"),
                    self.const(torch.zeros(qw.shape[0], dtype=torch.int64), "wzp"),
                    None if bias is None else self.const(bias, "bias"), stride, padding, dilation, groups]
        dtype = out_dtype or torch.uint8
        tail = [1.0, 0, torch.float32] if dtype == torch.float32 else [out_scale, out_zp, dtype]
        new = self.replace(node, ON.qconv2d_pointwise.default, args + tail + [post, [], None])
        self.float_out[new] = 11

    def conv2d_add(self, node):
        (qx, x_scale, x_zp, qw_n, ws_n, b_n, stride, padding, dilation, groups, qother, o_scale, o_zp, out_scale,
         out_zp, post, out_dtype) = node.args
        meta, other = qx.meta["tensor_meta"], qother.meta["tensor_meta"]
        if meta.dtype != torch.uint8 or other.dtype != torch.uint8 or out_dtype not in (None, torch.uint8):
            return
        qw, ws, bias = _attr(self.gm, qw_n), _attr(self.gm, ws_n).float(), _attr(self.gm, b_n)
        if list(other.shape) != list(node.meta["tensor_meta"].shape):
            return
        zp, bias = (x_zp, None if bias is None else bias.float()) if any(padding) else \
            self._folded(qw, ws, bias, x_scale, x_zp)
        packed = ON.qconv_prepack(qw.contiguous(), ws, 1.0, 0, stride, padding, dilation, groups, list(meta.shape))
        # oneDNN writes the sum into the residual's codes: copy them only if someone reads them later.
        later = any(self.order.get(user, -1) > self.order[node] for user in qother.users if user is not node)
        with self.graph.inserting_before(node):
            accum = self.graph.call_method("clone", (qother,), {"memory_format": torch.channels_last}) if later \
                else qother
            args = [qx, x_scale, zp, self.const(packed, "packed"), self.const(ws, "wscale"),
                    self.const(torch.zeros(qw.shape[0], dtype=torch.int64), "wzp"), accum,
                    None if bias is None else self.const(bias, "bias"), stride, padding, dilation, groups]
        self.replace(node, ON.qconv2d_pointwise.binary,
                     args + [out_scale, out_zp, None, o_scale, o_zp, "sum", 1.0, post, [], ""])

    def quantize_per_tensor(self, node):
        x, scale, zp, qmin, qmax, dtype = node.args
        if dtype != torch.uint8:
            return
        inv = float(1.0 / torch.tensor(scale, dtype=torch.float32))
        self.replace(node, quantize_magic, [x, inv, zp, qmin, qmax, dtype])

    def dequantize_per_tensor(self, node):
        q, scale, zp = node.args
        producer = q
        if self.fuse_dequantize and producer in self.float_out and len(producer.users) == 1:
            i = self.float_out[producer]
            args = list(producer.args)
            dtype = args[i + 2] or torch.uint8
            qmin, qmax = torch.iinfo(dtype).min, torch.iinfo(dtype).max
            f32 = float(torch.tensor(scale, dtype=torch.float32))
            low, high = (qmin - zp) * f32, (qmax - zp) * f32
            if args[i + 3] == "relu":
                low = max(low, 0.0)
            # float output: oneDNN wants scale 1 and zero point 0; hardtanh keeps the grid's range.
            args[i:i + 6] = [1.0, 0, torch.float32, "hardtanh", [low, high], args[i + 5]]
            producer.args = tuple(args)
            node.replace_all_uses_with(producer)
            self.graph.erase_node(node)
            return
        f32 = float(torch.tensor(scale, dtype=torch.float32))
        with self.graph.inserting_before(node):
            y = self.graph.call_method("to", (q, torch.float32))
            y = self.graph.call_method("sub_", (y, zp))
        self.replace(node, torch.Tensor.mul_, [y, f32])

    def max_pool2d(self, node):
        q, kernel, stride, padding, dilation, ceil_mode = node.args
        if ceil_mode or list(dilation) != [1, 1] or kernel[0] != kernel[1] or 2 * padding[0] >= kernel[0]:
            return
        self.replace(node, max_pool_taps, [q, list(kernel), list(stride or kernel), list(padding)])

    def adaptive_avg_pool2d(self, node):
        q, scale, zp, size, out_scale, out_zp = node.args
        if list(size) != [1, 1] or q.meta["tensor_meta"].dtype != torch.uint8:
            return
        self.replace(node, global_avg_pool, [q, scale, zp, out_scale, out_zp])

    def lut(self, node):
        """lut(lut(q, t1), t2) -> lut(q, t2[t1]): one pass instead of two, the same codes."""
        inner, outer_table = node.args
        if inner.op != "call_function" or _packet(inner) != LF.lut or len(inner.users) != 1:
            return
        q, inner_table = inner.args
        t1, t2 = _attr(self.gm, inner_table), _attr(self.gm, outer_table)
        # t2 is indexed by the intermediate codes t1 holds: int8 codes from -128 (byte ^ 128).
        index = (t1.view(torch.uint8) ^ 128).long() if t1.dtype == torch.int8 else t1.long()
        with self.graph.inserting_before(node):
            composed = self.const(t2[index].contiguous(), "lut")
        self.replace(node, LF.lut, [q, composed])

    RULES = {LF.linear: linear, LF.lut: lut, LF.conv2d: conv2d, LF.conv2d_add: conv2d_add,
             LF.quantize_per_tensor: quantize_per_tensor, LF.max_pool2d: max_pool2d,
             LF.adaptive_avg_pool2d: adaptive_avg_pool2d}

    def run(self) -> fx.GraphModule:
        for node in list(self.graph.nodes):
            rule = self.RULES.get(_packet(node)) if node.op == "call_function" else None
            if rule is not None:
                rule(self, node)
        for node in list(self.graph.nodes):  # after the kernels: a dequantize may fold into its producer
            if node.op == "call_function" and _packet(node) == LF.dequantize_per_tensor:
                self.dequantize_per_tensor(node)
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()
        return self.gm


def lower(gm: fx.GraphModule, example, fuse_dequantize: bool = True) -> fx.GraphModule:
    """The lowered program of lucid_fx-converted ``gm`` for this CPU (shapes taken from ``example``)."""
    return _Lowering(gm, example, fuse_dequantize).run()


def packed_weight_containers() -> dict:
    """Which containers hold a oneDNN-packed weight through copy, state_dict, save and ``.to()``."""
    import io

    packed = ON.qlinear_prepack(torch.randint(-64, 64, (8, 16), dtype=torch.int8), None)
    results = {}

    def attempt(label, fn):
        try:
            fn()
            results[label] = "ok"
        except Exception as exc:  # noqa: BLE001 - the failure is the result
            results[label] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:60]}"

    m = torch.nn.Module()
    attempt("register_buffer", lambda: m.register_buffer("w", packed))
    attempt("state_dict()", lambda: m.state_dict())
    attempt("torch.save(state_dict)", lambda: torch.save(m.state_dict(), io.BytesIO()))
    attempt("copy.deepcopy(module)", lambda: copy.deepcopy(m))
    attempt("module.to('cpu')", lambda: m.to("cpu"))
    attempt("module.to(torch.float32)", lambda: m.to(torch.float32))
    attempt("nn.Parameter(packed)", lambda: torch.nn.Parameter(packed, requires_grad=False))
    attempt("packed.to_dense()", lambda: packed.to_dense())
    return results


def _steps(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    return float((a.float() - b.float()).abs().max() / scale)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp_b1,mlp_b64,resnet_1x")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--peers", default="x86,onednn")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(cpu_line())
    print("packed weight containers:", packed_weight_containers())
    print(f"{'model':<10} {'variant':<26} {'wall us':>8} {'kernel us':>9} {'outside us':>10} {'ops':>4} "
          f"{'outside/op':>10} {'vs lucid_fx':>11} {'vs fp32':>8}")
    for name in args.models.split(","):
        variants, example, model, batches = variants_for(name, [p for p in args.peers.split(",") if p], 4)
        today = variants["lucid_fx int8"]
        out_scale = next(n for n in today.graph.nodes if _packet(n) == LF.dequantize_per_tensor).args[1]
        for fuse in (False, True):
            label = "lowered" + (", dequant fused" if fuse else "")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                variants[label] = lower(today, example, fuse_dequantize=fuse)
            with torch.no_grad():
                held_out = batches[-1]
                ref_out, low_out = today(held_out), variants[label](held_out)
            print(f"  {name} {label}: max |out - lucid_fx| = {_steps(low_out, ref_out, out_scale):.3f} output steps, "
                  f"identical: {torch.equal(low_out, ref_out)}")
        figures = measure(variants, example, args.rounds, 10)
        base, fp32 = figures["lucid_fx int8"]["wall_us"], figures["fp32 eager"]["wall_us"]
        for variant, f in figures.items():
            print(f"{name:<10} {variant:<26} {f['wall_us']:>8.0f} {f['kernel_us']:>9.0f} {f['outside_us']:>10.0f} "
                  f"{f['ops']:>4.0f} {f['outside_us'] / max(f['ops'], 1):>10.1f} {base / f['wall_us']:>10.2f}x "
                  f"{fp32 / f['wall_us']:>7.2f}x")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
