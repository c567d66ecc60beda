"""The fixed cost of one int8 kernel call on CPU, by route (issue 13: where 30-50 us per op goes).

    python benchmarks/prototypes/call_cost.py
    ONEDNN_CACHE_CONTEXT_UNSAFE=1 python benchmarks/prototypes/call_cost.py   # oneDNN's per-weight primitive cache

Tiny layers (linear 16 -> 16 on one row; conv 1x1 16 -> 16 on 1x16x4x4, channels-last) make the arithmetic
negligible, so each time is the route's fixed cost: lucid_fx's Python kernel (``torch.ops.lucid_fx.*``),
the direct oneDNN op (``torch.ops.onednn.*.default``, packed weight, Python constants), the same op through
its OpOverloadPacket (overload resolution per call), torch.ao's fbgemm/onednn ``quantized::linear`` on
quint8 tensors (deprecated API, as a reference), and an empty aten op (``torch.ops.aten.alias``).

``ONEDNN_CACHE_CONTEXT_UNSAFE=1`` (read once per process by torch's qlinear, see OnednnUtils.h) keeps
each weight's oneDNN primitive and arguments keyed by the packed weight's address: unsafe when one packed
weight meets two input shapes or scales, but it shows the per-call cost of building the primitive.

Figures here (AMD EPYC, AVX512-VNNI, torch 2.13.0, 1 thread, one run, us): empty aten op 1.5;
lucid_fx::linear 43 (18 with the context cache); onednn qlinear .default 23 (5.4), through the packet
23; lucid_fx::conv2d 51; onednn qconv2d .default 36 (no cache for conv); torch.ao quantized::linear
fbgemm 15, onednn 22. A second, more loaded run: fp32 F.linear 4, F.conv2d 11, torch.ao conv 35-36.
"""

import os
import warnings

import torch

import lucid_fx  # noqa: F401
from _timing import interleaved, table

warnings.simplefilter("ignore")


def main():
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, ONEDNN_CACHE_CONTEXT_UNSAFE="
          f"{os.environ.get('ONEDNN_CACHE_CONTEXT_UNSAFE', '')!r}")
    qw = torch.randint(-64, 64, (16, 16), dtype=torch.int8)
    ws, bias, zeros = torch.rand(16) * 0.01 + 0.001, torch.randn(16), torch.zeros(16, dtype=torch.int64)
    qx = torch.randint(0, 256, (1, 16), dtype=torch.uint8)
    packed = torch.ops.onednn.qlinear_prepack(qw, None)
    lin = torch.ops.onednn.qlinear_pointwise
    qcw = qw.view(16, 16, 1, 1)
    cx = torch.randint(0, 256, (1, 16, 4, 4), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    cpacked = torch.ops.onednn.qconv_prepack(qcw, ws, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, [1, 16, 4, 4])
    ao_w = torch.quantize_per_channel(qw.float() * ws[:, None], ws.double(), zeros, 0, torch.qint8)
    ao_x = torch.quantize_per_tensor(qx.float() * 0.05, 0.05, 0, torch.quint8)
    routes = {
        "aten.alias (empty op)": lambda: torch.ops.aten.alias.default(qx),
        "lucid_fx::linear": lambda: torch.ops.lucid_fx.linear(qx, 0.05, 3, qw, ws, bias, 0.1, 5, "relu", None),
        "onednn linear .default": lambda: lin.default(qx, 0.05, 3, packed, ws, zeros, bias, 0.1, 5, None, "relu",
                                                      [], ""),
        "onednn linear packet": lambda: lin(qx, 0.05, 3, packed, ws, zeros, bias, 0.1, 5, None, "relu", [], ""),
        "lucid_fx::conv2d 1x1": lambda: torch.ops.lucid_fx.conv2d(cx, 0.05, 3, qcw, ws, bias, [1, 1], [0, 0], [1, 1],
                                                                  1, 0.1, 5, "relu", None),
        "onednn conv2d .default": lambda: torch.ops.onednn.qconv2d_pointwise.default(
            cx, 0.05, 3, cpacked, ws, zeros, bias, [1, 1], [0, 0], [1, 1], 1, 0.1, 5, None, "relu", [], None),
    }
    fw, fx = qw.float(), qx.float()
    routes["fp32 F.linear"] = lambda: torch.nn.functional.linear(fx, fw, bias)
    routes["fp32 F.conv2d 1x1"] = lambda: torch.nn.functional.conv2d(cx.float(), qcw.float(), bias)
    ao_cw = torch.quantize_per_channel(qcw.float() * ws[:, None, None, None], ws.double(), zeros, 0, torch.qint8)
    ao_cx = torch.quantize_per_tensor(cx.float() * 0.05, 0.05, 0, torch.quint8)
    for engine in ("x86", "onednn"):
        torch.backends.quantized.engine = engine
        params = torch.ops.quantized.linear_prepack(ao_w, bias)
        cparams = torch.ops.quantized.conv2d_prepack(ao_cw, bias, [1, 1], [0, 0], [1, 1], 1)
        routes[f"torch.ao quantized::linear ({engine})"] = (
            lambda params=params, engine=engine: (setattr(torch.backends.quantized, "engine", engine),
                                                  torch.ops.quantized.linear_relu(ao_x, params, 0.1, 5)))
        routes[f"torch.ao quantized::conv2d ({engine})"] = (
            lambda cparams=cparams, engine=engine: (setattr(torch.backends.quantized, "engine", engine),
                                                    torch.ops.quantized.conv2d_relu(ao_cx, cparams, 0.1, 5)))
    print(table(interleaved(routes, rounds=21)))


if __name__ == "__main__":
    main()
