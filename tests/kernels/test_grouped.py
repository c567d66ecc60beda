"""lucid_fx/kernels/grouped.py: lucid_fx::grouped_linear, each expert's rows on the device's int8 linear."""

import pytest
import torch

import lucid_fx  # noqa: F401  (registers the ops)
from lucid_fx.kernels import KernelInputError, grouped
from lucid_fx.kernels.codes import dequant
from lucid_fx.kernels.library import KERNELS

OPS = torch.ops.lucid_fx


def _case(seed=0, experts=4, rows=13, k=24, n=20):
    g = torch.Generator().manual_seed(seed)
    qx = torch.randint(0, 256, (rows, k), dtype=torch.uint8, generator=g)
    qw = torch.randint(-64, 64, (experts, n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(experts, n, generator=g) * 0.01 + 0.001
    return qx, qw, ws


def _float(qx, x_scale, x_zp, qw, ws, ends):
    """The grouped product in float64 of the dequantized codes; rows past the last offset zero."""
    x = dequant(qx, x_scale, x_zp).double()
    y = torch.zeros(qx.shape[0], qw.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(ends):
        y[start:end] = x[start:end] @ (qw[e].double() * ws[e].double()[:, None]).T
        start = end
    return y


# an empty expert first, one in the middle, and rows past the last offset
@pytest.mark.parametrize("ends", [[0, 5, 5, 13], [3, 3, 9, 11]])
def test_each_expert_s_rows_are_its_int8_linear(ends):
    qx, qw, ws = _case()
    offs = torch.tensor(ends, dtype=torch.int32)
    out = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    assert out.shape == (13, 20) and out.dtype == torch.uint8
    start = 0
    for e, end in enumerate(ends):  # bit for bit the device's linear on that expert's rows
        expected = OPS.linear(qx[start:end], 0.02, 120, qw[e], ws[e], None, 0.04, 100, "none", None)
        assert torch.equal(out[start:end], expected), f"expert {e}, rows {start}:{end}"
        start = end
    assert (out[ends[-1]:] == 100).all()  # past the last offset: zero, its zero point's code
    # and the codes are the float product's, to within one code (rounding inside the kernel)
    exact = _float(qx, 0.02, 120, qw, ws, ends) / 0.04 + 100
    assert (out.double() - exact.round().clamp(0, 255)).abs().max() <= 1
    reference = grouped.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    assert (reference.int() - out.int()).abs().max() <= 1


def test_each_expert_is_prepared_once_and_kept_until_its_weight_changes():
    qx, qw, ws = _case(1)
    offs = torch.tensor([4, 8, 10, 13])
    first = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    builds, views = grouped.EXPERTS.builds, grouped._experts(qw, ws)
    assert torch.equal(OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100), first)
    assert grouped._experts(qw, ws)[0][2] is views[0][2] and grouped.EXPERTS.builds == builds  # nothing built again
    qw[2].neg_()  # written in place: prepared again, and the result follows
    changed = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    assert grouped.EXPERTS.builds > builds
    assert torch.equal(changed[:8], first[:8]) and not torch.equal(changed[8:10], first[8:10])


def test_the_cpu_s_kept_constants_and_its_per_call_linear_agree(monkeypatch):
    """Where the small-linear engine takes the rows, each expert's constants are kept (grouped._cpu);
    elsewhere (oneDNN's sizes, another CPU kind) each expert runs lucid_fx::linear: the same codes."""
    qx, qw, ws = _case(3, rows=40, k=64, n=48)
    offs = torch.tensor([0, 17, 30, 40])
    kept = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    monkeypatch.setattr(grouped.lr, "takes_row", lambda *args: None)
    assert torch.equal(OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100), kept)


def test_the_cpu_s_experts_write_their_rows_in_place(native_on, monkeypatch):
    # lucid_fx's GEMM writes each expert's rows into the result (no copy); a strided input takes the copy
    qx, qw, ws = _case(4, rows=40, k=64, n=48)
    offs = torch.tensor([0, 17, 30, 40])
    expected = [OPS.linear(qx[a:b], 0.02, 120, qw[e], ws[e], None, 0.04, 100, "none", None)
                for e, (a, b) in enumerate(zip([0, 0, 17, 30], [0, 17, 30, 40]))]
    calls = []
    real = grouped.lr.gemm_into
    monkeypatch.setattr(grouped.lr, "gemm_into", lambda q, out, *a, **k: calls.append(q.shape[0]) or real(q, out, *a, **k))
    out = grouped._cpu(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    target = grouped.cpu._cpu_target()  # an AMX CPU: oneDNN's call per expert (grouped._cpu)
    engine = target.row_limit is None and grouped.lr.takes_row(target, grouped.cpu._onednn_on(), "none", torch.uint8, 40, 48, 64)
    assert calls == ([17, 13, 10] if engine else []) and torch.equal(out, torch.cat(expected))  # oneDNN's kinds: per call
    calls.clear()
    strided = torch.empty(40, 128, dtype=torch.uint8)[:, ::2]
    strided.copy_(qx)
    assert torch.equal(grouped._cpu(strided, 0.02, 120, qw, ws, offs, 0.04, 100), out) and calls == []


@pytest.mark.parametrize(
    "offs, message",
    [
        (torch.tensor([5, 3, 9, 13]), "do not rise from 0 to at most the 13 rows"),
        (torch.tensor([5, 6, 9, 14]), "do not rise from 0 to at most the 13 rows"),
        (torch.tensor([5.0, 6.0, 9.0, 13.0]), "offsets of shape (4,) (torch.float32) for 4 experts"),
        (torch.tensor([5, 13]), "offsets of shape (2,) (torch.int64) for 4 experts"),
    ],
)
def test_bad_offsets_are_named(offs, message):
    qx, qw, ws = _case()
    with pytest.raises(KernelInputError, match="grouped_linear") as raised:
        OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    assert message in str(raised.value)


def test_rows_that_do_not_fit_the_experts_are_named():
    qx, qw, ws = _case()
    with pytest.raises(KernelInputError, match=r"rows \(13, 24\), weights \(4, 20, 23\)"):
        OPS.grouped_linear(qx, 0.02, 120, qw[..., :23], ws, torch.tensor([1, 2, 3, 13]), 0.04, 100)


def test_the_cuda_kernel_s_logic_runs_on_the_cpu():
    """The CUDA grouped kernel (each expert on lucid_fx::linear's CUDA kernel: padded torch._int_mm,
    which runs on the CPU too), on CPU tensors: each expert's rows are that kernel's, and within a
    code of the CPU kernel's."""
    qx, qw, ws = _case(4, rows=40, k=32, n=24)
    offs = torch.tensor([0, 17, 30, 40])
    on_cuda = grouped._on("cuda")(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    start = 0
    for e, end in enumerate(offs.tolist()):
        expected = KERNELS["linear"]["cuda"](qx[start:end], 0.02, 120, qw[e], ws[e], None, 0.04, 100, "none", None)
        assert torch.equal(on_cuda[start:end], expected), f"expert {e}"
        start = end
    cpu = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    assert (on_cuda.int() - cpu.int()).abs().max() <= 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_experts_match_the_cpu_s():
    qx, qw, ws = _case(2, rows=40, k=32, n=24)
    offs = torch.tensor([0, 17, 30, 40])
    cpu = OPS.grouped_linear(qx, 0.02, 120, qw, ws, offs, 0.04, 100)
    cuda = OPS.grouped_linear(qx.cuda(), 0.02, 120, qw.cuda(), ws.cuda(), offs.cuda(), 0.04, 100)
    assert (cuda.cpu().int() - cpu.int()).abs().max() <= 1
