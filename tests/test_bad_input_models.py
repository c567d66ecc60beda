"""The bad-input matrix, cases 9-16: awkward models, devices and reductions (cases 1-8 are in
test_bad_input.py).

Each test asserts the exact message (class, the node or module it names, what to do), or, for
inputs that are awkward but legal, that the result is right.
"""

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from _bad_input import _batches, _calibrated, _mlp, _ops, _targets


# 9. integer inputs stay unquantized ------------------------------------------------------------
class MaskedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 8)

    def forward(self, ids, mask):
        h = self.fc(self.emb(ids))
        return h * mask.unsqueeze(-1).to(h.dtype)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64], ids=["bool-mask", "int-mask"])
def test_embedding_indices_and_masks_are_never_quantized(mask_dtype):
    g = torch.Generator().manual_seed(0)

    def batch(rows):
        return torch.randint(0, 50, (rows, 7), generator=g), (torch.rand(rows, 7, generator=g) > 0.3).to(mask_dtype)

    model = MaskedEmbedding().eval()
    prepared = lucid_fx.prepare(model, example_inputs=batch(2))
    assert "ids" not in prepared.lucid_fx_observers and "mask" not in prepared.lucid_fx_observers
    lucid_fx.calibrate(prepared, [batch(4) for _ in range(4)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    placeholders = {n.name: n for n in qmodel.graph.nodes if n.op == "placeholder"}
    quantized = [n.args[0] for n in qmodel.graph.nodes if n.op == "call_function" and n.target is _ops.quantize_per_tensor]
    for name in ("ids", "mask"):
        assert placeholders[name] not in quantized
        assert all(u.target is not _ops.quantize_per_tensor for u in placeholders[name].users)
    assert "linear" in _targets(qmodel)
    ids, mask = batch(3)
    out, ref = qmodel(ids, mask), model(ids, mask)
    assert torch.equal(out[~mask.bool()], torch.zeros_like(out[~mask.bool()]))  # masked rows exactly 0
    assert (out - ref).abs().max() < 0.05


# 10. in-place ops ----------------------------------------------------------------------------------
class InPlace(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        torch.manual_seed(0)
        self.spelling = spelling
        self.fc1, self.fc2, self.fc3 = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc1(x)
        if self.spelling == "relu_":
            h = h.relu_()
        elif self.spelling == "F.relu(inplace=True)":
            h = F.relu(h, inplace=True)
        elif self.spelling == "nn.ReLU(inplace=True)":
            h = self.act(h)
        else:  # x += y
            h += self.fc2(x)
        return self.fc3(h)


@pytest.mark.parametrize("spelling", ["relu_", "F.relu(inplace=True)", "nn.ReLU(inplace=True)", "+="])
def test_in_place_ops_prepare_and_convert(spelling, sqnr_db):
    model = InPlace(spelling).eval()
    batches = _batches(6, (16, 6))
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0][:2],))
    x = batches[0]
    assert torch.equal(prepared(x), model(x))  # observers change nothing
    lucid_fx.calibrate(prepared, batches, progress=False)
    observers = prepared.lucid_fx_observers
    with torch.no_grad():
        seen = torch.cat([model.fc1(b) for b in batches])
    if spelling == "+=":
        # fc1's observer saw fc1's output before the in-place add changed it
        assert float(observers["fc1"].min_val) == pytest.approx(float(seen.min()))
        assert float(observers["fc1"].max_val) == pytest.approx(float(seen.max()))
    else:
        relu = next(k for k in observers if k not in ("x", "fc3"))
        assert float(observers[relu].min_val) == 0.0  # the relu's observer saw relu's output
    qmodel = lucid_fx.convert(prepared)
    x_before = x.clone()
    out = qmodel(x)
    assert torch.equal(x, x_before)
    assert sqnr_db(model(x), out) > 25
    assert "linear" in _targets(qmodel)


# 11. structured outputs --------------------------------------------------------------------------
class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return {"logits": h, "pair": (torch.relu(h), [torch.sigmoid(h), h.shape[0]])}


def test_dict_tuple_list_outputs_keep_their_structure():
    model = Structured().eval()
    prepared = _calibrated(model, torch.randn(2, 4), _batches(3))
    x = _batches(1, seed=3)[0]
    for candidate, tol in ((prepared, 0.0), (lucid_fx.convert(prepared), 0.05), (lucid_fx.convert(prepared, reference=True), 0.05)):
        out, ref = candidate(x), model(x)
        assert set(out) == {"logits", "pair"} and isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
        assert out["pair"][1][1] == 8
        for got, want in ((out["logits"], ref["logits"]), (out["pair"][0], ref["pair"][0]), (out["pair"][1][0], ref["pair"][1][0])):
            assert got.shape == want.shape and (got - want).abs().max() <= tol


# 12. a submodule called twice -------------------------------------------------------------------
class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)))


def test_shared_submodule_quantizes_both_calls_with_one_weight(sqnr_db):
    model = Twice().eval()
    prepared = _calibrated(model, torch.randn(2, 8), _batches(4, (16, 8)))
    qmodel = lucid_fx.convert(prepared)
    linears = [n for n in qmodel.graph.nodes if n.op == "call_function" and n.target is _ops.linear]
    assert len(linears) == 2
    weights = [getattr(qmodel, n.args[3].target) for n in linears]
    scales = [getattr(qmodel, n.args[4].target) for n in linears]
    assert torch.equal(weights[0], weights[1]) and torch.equal(scales[0], scales[1])
    x = _batches(1, (16, 8), seed=9)[0]
    assert sqnr_db(model(x), qmodel(x)) > 25


# 13. another batch size at run time -------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_other_batch_sizes_than_at_prepare(rows, sqnr_db):
    model = _mlp()
    prepared = _calibrated(model, torch.randn(2, 4), _batches(4, (8, 4)))
    qmodel = lucid_fx.convert(prepared)
    x = _batches(1, (rows, 4), seed=rows)[0]
    assert torch.equal(prepared(x), model(x))
    out = qmodel(x)
    assert out.shape == (rows, 3) and sqnr_db(model(x), out) > 20
    assert torch.equal(out[:1], qmodel(x[:1]))  # each row's result is independent of the batch around it


# 14. backend and device disagree ------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the message of a machine without CUDA")
def test_cuda_backend_without_a_gpu():
    prepared = _calibrated(_mlp(), torch.randn(2, 4), _batches(2))
    with pytest.raises(RuntimeError, match=re.escape("convert: backend 'cuda' needs a CUDA device, and torch.cuda.is_available() is False; use backend='cpu' on this machine")):
        lucid_fx.convert(prepared, backend="cuda")


def test_cuda_backend_with_a_cpu_model(monkeypatch):
    prepared = _calibrated(_mlp(), torch.randn(2, 4), _batches(2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, model left on the CPU
    with pytest.raises(ValueError, match=re.escape("convert: the model's tensors are on cpu but backend is 'cuda'; move the model with prepared.cuda() before convert, or pass backend='cpu'")):
        lucid_fx.convert(prepared, backend="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_backend_with_a_cuda_model():
    model = _mlp().cuda()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4, device="cuda"),))
    assert prepared.lucid_fx_report.backend == "cuda"  # the default follows the model's device
    lucid_fx.calibrate(prepared, [b.cuda() for b in _batches(2)], progress=False)
    with pytest.raises(ValueError, match=re.escape("convert: the model's tensors are on cuda:0 but backend is 'cpu'; move the model with prepared.cpu() before convert, or pass backend='cuda'")):
        lucid_fx.convert(prepared, backend="cpu")
    x = torch.randn(5, 4, device="cuda")
    assert (lucid_fx.convert(prepared)(x) - model(x)).abs().max() < 0.1


# 15. int32 accumulator overflow --------------------------------------------------------------------
def test_a_reduction_that_could_overflow_int32_runs_in_float_with_a_warning():
    k = 140_000  # 255 * 63 * K > 2^31 - 1 even on the narrow [-64, 63] weight grid
    model = nn.Sequential(nn.Linear(k, 2), nn.ReLU(), nn.Linear(2, 2)).eval()
    with torch.no_grad():
        model[0].weight.fill_(0.01)
        model[0].bias.zero_()
    x = torch.full((2, k), 10.0)
    x[1] = 5.0
    prepared = _calibrated(model, x, [x])
    with pytest.warns(RuntimeWarning, match=re.escape(f"convert: node '_0' (linear, K={k} inputs per output) could overflow the int8 kernel's int32 accumulator (worst case ")) as caught:
        qmodel = lucid_fx.convert(prepared)
    assert "so it runs in float instead (see lucid_fx_convert_report.float_ops). To keep it int8, split it into layers with fewer inputs" in str(caught[0].message)
    report = qmodel.lucid_fx_convert_report
    assert report.float_ops["_1"].startswith(f"int32 accumulator could overflow: K={k}, worst case sum ")
    assert report.lowered == {"_2": "linear"}  # the small layer after it is still int8
    step = float(prepared.lucid_fx_observers["_2"].calculate_qparams()[0])
    assert (qmodel(x) - model(x)).abs().max() <= 2 * step  # right to the output grid, not wrapped around


def test_a_weight_of_minus_128_codes_counts_its_magnitude():
    # int8 -128 .abs() is -128 in torch: summed as it was, a weight of the grid's lowest code looked safe and wrapped
    k = 140_000
    model = nn.Sequential(nn.Linear(k, 2)).eval()
    with torch.no_grad():
        model[0].weight.fill_(-0.01)  # every code the grid's lowest: -128 with VNNI, -64 without
        model[0].bias.zero_()
    x = torch.full((2, k), 10.0)
    x[1] = 5.0
    prepared = _calibrated(model, x, [x])
    with pytest.warns(RuntimeWarning, match="could overflow the int8 kernel's int32 accumulator"):
        qmodel = lucid_fx.convert(prepared)
    assert qmodel.lucid_fx_convert_report.lowered == {}
    torch.testing.assert_close(qmodel(x), model(x), rtol=1e-3, atol=0.1)


def test_a_wide_but_safe_reduction_stays_int8():
    model = nn.Sequential(nn.Linear(4096, 4)).eval()
    x = torch.rand(3, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qmodel = lucid_fx.convert(_calibrated(model, x, [x]))
    assert qmodel.lucid_fx_convert_report.float_ops == {} and "linear" in _targets(qmodel)


# 16. nothing a user passed in is modified ----------------------------------------------------------
class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.fc = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(torch.relu(self.bn(self.conv(x))), 1).flatten(1))


def _snapshot(model):
    return {
        "state": copy.deepcopy(model.state_dict()),
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {name: (list(m._forward_hooks), list(m._forward_pre_hooks)) for name, m in model.named_modules()},
        "modules": [name for name, _ in model.named_modules()],
    }


def _same(a, b):
    assert a["training"] == b["training"] and a["hooks"] == b["hooks"] and a["modules"] == b["modules"]
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


@pytest.mark.parametrize("path", ["prepare+calibrate+convert", "quantize", "prepare_qat+train+convert"])
def test_nothing_the_user_passed_in_is_modified(path):
    qat = path.startswith("prepare_qat")
    model = WithBatchNorm().train(qat)
    seen = []
    model.conv.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    example = (torch.randn(2, 3, 8, 8),)
    batches = [torch.randn(4, 3, 8, 8) for _ in range(3)]
    before, example_copy, batches_copy = _snapshot(model), copy.deepcopy(example), copy.deepcopy(batches)
    if path == "quantize":
        lucid_fx.quantize(model, example, batches)
    else:
        prepared = (lucid_fx.prepare_qat if qat else lucid_fx.prepare)(model, example_inputs=example)
        if qat:
            opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
            for b in batches:
                opt.zero_grad()
                prepared(b).sum().backward()
                opt.step()
        else:
            lucid_fx.calibrate(prepared, batches, progress=False)
        prepared_before = _snapshot(prepared)
        lucid_fx.convert(prepared)
        _same(prepared_before, _snapshot(prepared))  # convert copies the prepared model too
    _same(before, _snapshot(model))
    seen.clear()
    model(example[0])
    assert len(seen) == 1  # the user's model still runs, with its hook
    assert all(torch.equal(a, b) for a, b in zip(example, example_copy))
    assert all(torch.equal(a, b) for a, b in zip(batches, batches_copy))
