"""lucid_fx/rules/program_cpu.py on an AMX CPU (lucid_fx/kernels/conv_native.py, amx_conv_engine): a convolution runs on lucid_fx's VNNI kernels where oneDNN runs it
on its own VNNI kernels there (lucid_fx/kernels/onednn_steps.py asks it), and stays on oneDNN where it runs AMX's.
The answer is forced here so that every machine takes both routes; on an AMX CPU the real one is compared too."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import conv_native, cpu, force_cpu_features, onednn_steps
from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.rules import program_cpu
from _program import lowered

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


def _block():
    """MobileNet's inverted residual without its shortcut: 1x1 expand, 3x3 depthwise, 1x1 project."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.Hardswish(),
                          nn.Conv2d(64, 24, 1)).eval()
    x = torch.randn(1, 16, 10, 10)
    with force_cpu_features("amx"):
        prepared = lucid_fx.prepare(model, example_inputs=(x,))
        lucid_fx.calibrate(prepared, [x, torch.randn_like(x)])
        return lucid_fx.convert(prepared), x


def _lucid_fx_convs(targets):
    return sum(t in (program_cpu.conv_native.conv_codes, program_cpu.pointwise_rows) for t in targets)


@pytest.mark.parametrize("steps", ["vnni", "amx", None])
def test_on_an_amx_cpu_a_convolution_leaves_onednn_only_where_it_runs_vnni_kernels(steps, monkeypatch):
    if not (detected_cpu_features().vnni and ln.full_grid()):
        pytest.skip("lucid_fx's VNNI kernels need a CPU with VNNI and the native build")
    qmodel, x = _block()
    monkeypatch.setattr(conv_native, "few_rows_engine_here", lambda: "int_mm")  # as on an AMX CPU
    asked = []
    monkeypatch.setattr(conv_native, "conv_steps", lambda *args: asked.append(args[-2]) or steps)
    with force_cpu_features("amx"):
        portable, program, targets = lowered(qmodel, x)
    assert sorted(set(asked)) == ["hardswish", "none", "relu"]  # each convolution's own post-op was asked about
    assert _lucid_fx_convs(targets) == (3 if steps == "vnni" else 0)
    # The VNNI kernels' values are oneDNN's where its VNNI kernels run: any VNNI CPU, forced or not
    if steps != "vnni" or not detected_cpu_features().amx or onednn_steps.conv_steps(
            (1, 64, 10, 10), (64, 1, 3, 3), (1, 1), (1, 1), (1, 1), 64, "hardswish", torch.get_num_threads()) == "vnni":
        assert torch.equal(program(x), portable)


def test_on_this_cpu_the_program_gives_the_portable_graph_s_values():
    qmodel, x = _block()
    portable, program, targets = lowered(qmodel, x)
    assert torch.equal(program(x), portable)
    if detected_cpu_features().amx and ln.full_grid():  # the real question, asked of this machine's oneDNN
        vnni = [onednn_steps.conv_steps(shape, w, (1, 1), pad, (1, 1), g, post, torch.get_num_threads()) == "vnni"
                for shape, w, pad, g, post in [((1, 16, 10, 10), (64, 16, 1, 1), (0, 0), 1, "relu"),
                                               ((1, 64, 10, 10), (64, 1, 3, 3), (1, 1), 64, "hardswish"),
                                               ((1, 64, 10, 10), (24, 64, 1, 1), (0, 0), 1, "none")]]
        assert _lucid_fx_convs(targets) == sum(vnni)



def test_on_an_amx_cpu_a_batch_of_64_runs_lucid_fx_s_amx_gemm_with_onednn_s_values():
    # row_sizes.amx_gemm: 64 rows of 256 and 512 inputs run on lucid_fx's AMX GEMM, with the float steps oneDNN's own
    # call takes for each shape (onednn_steps.linear_steps); with the tiles off they are oneDNN's calls: the same values
    if not (detected_cpu_features().amx and ln.use_amx(ln.amx())):
        pytest.skip(f"needs an AMX CPU and lucid_fx's AMX GEMM on (this one: {detected_cpu_features().name})")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128)).eval()
    x = torch.randn(64, 256)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x, torch.randn_like(x)])
    qmodel = lucid_fx.convert(prepared)
    portable, program, targets = lowered(qmodel, x)
    assert torch.ops.onednn.qlinear_pointwise.default not in targets
    before = ln.amx_calls()
    out = program(x)
    assert ln.amx_calls() - before == 2 and torch.equal(out, portable)
    ln.use_amx(False)
    try:
        onednn_portable, onednn_program, onednn_targets = lowered(qmodel, x)
    finally:
        ln.use_amx(True)
    assert sum(t == torch.ops.onednn.qlinear_pointwise.default for t in onednn_targets) == 2
    assert torch.equal(onednn_program(x), out) and torch.equal(onednn_portable, out)
