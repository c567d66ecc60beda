"""The benchmark models, small, quantized with ``backend="cuda"`` and run on a GPU: every value
on the device, the same ops in int8 as on the CPU backend, within a code or so of the reference
(simulated) model and near fp32. Skips without a GPU."""

import pytest
import torch

import lucid_fx
import models as M

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SMALL = {
    "mlp": lambda: M.mlp(4, 64),
    "resnet": lambda: M.resnet_like(2, 32, 16),
    "encoder": lambda: M.encoder_block(2, 16, 64),
    "gated": lambda: M.gated_mlp(4, 64),
    "mobilenet": lambda: M.mobilenet_v3_like(1, 64),
    "efficientnet": lambda: M.efficientnet_like(1, 64),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_model_runs_in_int8_on_the_gpu(sqnr_db, name):
    model, example, make_batch = SMALL[name]()
    batches = [make_batch(s) for s in range(4)]
    on_cpu = lucid_fx.quantize(model, (example,), batches)
    gpu_model = model.cuda()
    gpu_batches = [b.cuda() for b in batches]
    ours = lucid_fx.quantize(gpu_model, (example.cuda(),), gpu_batches, backend="cuda")
    simulated = lucid_fx.quantize(gpu_model, (example.cuda(),), gpu_batches, backend="cuda", reference=True)
    x = make_batch(100).cuda()
    with torch.no_grad():
        y, out, ref = gpu_model(x), ours(x), simulated(x)
    assert out.device.type == "cuda" and out.dtype == torch.float32
    assert {t.device.type for t in ours.state_dict().values()} <= {"cuda"}
    report, cpu_report = ours.lucid_fx_convert_report, on_cpu.lucid_fx_convert_report
    assert report.backend == "cuda"
    assert (len(report.lowered), sorted(report.float_ops)) == (len(cpu_report.lowered), sorted(cpu_report.float_ops))
    assert sqnr_db(ref, out) >= 35, "the int8 kernels stray from the simulation they implement"
    assert sqnr_db(y, out) >= 30
