"""The bad-input matrix: every way a user can hand lucid_fx something awkward, and its answer.

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

_ops = torch.ops.lucid_fx


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def _batches(n=4, shape=(8, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _calibrated(model, example, batches):
    prepared = lucid_fx.prepare(model, example_inputs=(example,))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return prepared


def _targets(qmodel):
    return [getattr(n.target, "__name__", str(n.target)) for n in qmodel.graph.nodes if n.op == "call_function"]


# 1. not an nn.Module ---------------------------------------------------------------------------
NOT_MODULES = [pytest.param(lambda x: x, "function", id="function"), pytest.param(torch.randn(3), "Tensor", id="tensor")]


@pytest.mark.parametrize("obj, type_name", NOT_MODULES)
@pytest.mark.parametrize("verb", ["prepare", "prepare_qat", "quantize"])
def test_model_verbs_refuse_non_modules(verb, obj, type_name):
    call = {
        "prepare": lambda: lucid_fx.prepare(obj),
        "prepare_qat": lambda: lucid_fx.prepare_qat(obj),
        "quantize": lambda: lucid_fx.quantize(obj, (torch.randn(2, 4),), _batches(1)),
    }[verb]
    expected = f"{verb} expects an nn.Module (or fx.GraphModule), got {type_name}; wrap a function in an nn.Module whose forward calls it"
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        call()


@pytest.mark.parametrize("obj, type_name", NOT_MODULES)
@pytest.mark.parametrize("verb", ["calibrate", "convert"])
def test_prepared_verbs_refuse_non_modules_and_unprepared_models(verb, obj, type_name):
    call = {"calibrate": lambda m: lucid_fx.calibrate(m, _batches(1), progress=False), "convert": lucid_fx.convert}[verb]
    with pytest.raises(TypeError, match=re.escape(f"{verb} expects the model returned by lucid_fx.prepare, got {type_name}; call prepared = lucid_fx.prepare(model, example_inputs=...) first")):
        call(obj)
    with pytest.raises(ValueError, match=re.escape(f"{verb} expects a model returned by lucid_fx.prepare (no observers found in Sequential); call prepared = lucid_fx.prepare(")):
        call(_mlp())


# 2. a model in training mode ---------------------------------------------------------------------
def test_training_mode_model_is_refused_naming_the_module():
    with pytest.raises(ValueError, match=r"^prepare: the model is in training mode; call model\.eval\(\) first \(module 'Sequential' has training=True.*or use prepare_qat to train with fake quantization$"):
        lucid_fx.prepare(nn.Sequential(nn.Linear(4, 4), nn.Dropout()), example_inputs=(torch.randn(2, 4),))
    model = _mlp()
    model[1].train()  # eval() on the root, then one child switched back
    with pytest.raises(ValueError, match=r"call model\.eval\(\) first \(module '1' has training=True"):
        lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"^prepare_qat: the model is in eval mode; call model\.train\(\) first"):
        lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 4),))


# 3. example_inputs that do not fit -------------------------------------------------------------
def test_example_inputs_with_the_wrong_count_name_the_signature():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=re.escape("example_inputs do not run through the model: Sequential.forward(input) takes 1 positional argument(s) but example_inputs has 2 (Tensor[2, 4] float32, Tensor[2, 4] float32). Pass example_inputs as a tuple")):
        lucid_fx.prepare(_mlp(), example_inputs=(x, x))

    class TwoInputs(nn.Module):
        def forward(self, a, b, scale=1.0):
            return (a + b) * scale

    with pytest.raises(ValueError, match=re.escape("TwoInputs.forward(a, b, scale) takes 2 to 3 positional argument(s) but example_inputs has 1 (Tensor[2, 4] float32)")):
        lucid_fx.prepare(TwoInputs().eval(), example_inputs=(x,))


def test_example_inputs_with_the_wrong_shape_name_the_node_module_and_shapes():
    with pytest.raises(ValueError) as info:
        lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 5),))
    assert str(info.value) == (
        "example_inputs do not run through the model: node '_0' (module '0' (Linear)) failed on inputs "
        "(Tensor[2, 5] float32) with RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x5 and 4x8). "
        "Pass example_inputs as a tuple of the positional arguments of forward, with shapes the model accepts"
    )

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            return torch.cat([self.block(x), x.t()], dim=1)

    with pytest.raises(ValueError, match=re.escape("node 'cat' (cat) failed on inputs ([Tensor[3, 4] float32, Tensor[4, 3] float32], dim=1) with RuntimeError: Sizes of tensors must match")):
        lucid_fx.prepare(Functional().eval(), example_inputs=(torch.randn(3, 4),))


# 4 and 5. convert before calibration; empty calibration data -----------------------------------
def test_convert_before_calibration_lists_the_uncalibrated_observers():
    prepared = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"^convert: the observers of node\(s\) input_1, _1, _2 saw no data; run lucid_fx\.calibrate\(prepared, batches\) before convert$"):
        lucid_fx.convert(prepared)


@pytest.mark.parametrize("data", [[], iter(()), [torch.randn(0, 4), torch.randn(0, 4)]], ids=["empty-list", "empty-iterator", "zero-size-batches"])
def test_empty_calibration_data(data):
    prepared = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    if isinstance(data, list) and data:
        assert lucid_fx.calibrate(prepared, data, progress=False) == 2  # batches of 0 rows run, and teach nothing
    else:
        with pytest.raises(ValueError, match="^calibrate: the calibration data was empty; pass at least one batch$"):
            lucid_fx.calibrate(prepared, data, progress=False)
    with pytest.raises(ValueError, match=r"observers of node\(s\) input_1, _1, _2 saw no data; run lucid_fx\.calibrate"):
        lucid_fx.convert(prepared)


# 6. NaN and inf in calibration batches ---------------------------------------------------------
def test_nonfinite_calibration_values_are_skipped_counted_and_named():
    model = _mlp()
    batches = _batches(4)
    batches[1][0, 0], batches[1][3, 2], batches[2][5, 1] = float("nan"), float("inf"), float("-inf")
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lucid_fx.calibrate(prepared, batches, progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages[0] == (
        "observer of node 'input_1': skipped 2 non-finite value(s) (NaN/inf) in observed data; they are excluded "
        "from the statistics (the running total is in .nonfinite_count)"
    )
    assert any(m.startswith("observer of node '_1': skipped") for m in messages)  # NaN rows propagate through fc
    observer = prepared.lucid_fx_observers["input_1"]
    assert int(observer.nonfinite_count) == 3  # every bad value counted, though only the first warns
    finite = torch.cat([b[torch.isfinite(b).all(1)] for b in batches])
    assert float(observer.min_val) == pytest.approx(float(finite.min())) and float(observer.max_val) == pytest.approx(float(finite.max()))
    qmodel = lucid_fx.convert(prepared)
    x = _batches(1, seed=7)[0]
    out = qmodel(x)
    assert torch.isfinite(out).all() and (out - model(x)).abs().max() < 0.1


# 7. zero-size and zero-range tensors -----------------------------------------------------------
def test_batches_of_zero_rows_run_prepared_and_converted():
    model = _mlp()
    prepared = _calibrated(model, torch.randn(2, 4), [torch.randn(0, 4)] + _batches(2))
    assert prepared(torch.randn(0, 4)).shape == (0, 3)
    qmodel = lucid_fx.convert(prepared)
    assert qmodel(torch.randn(0, 4)).shape == (0, 3)
    assert "linear" in _targets(qmodel)


class Scaled(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 1.5


@pytest.mark.parametrize("value", [0.0, 0.7, -3.0])
def test_constant_input_gets_a_positive_scale_and_comes_back_within_one_step(value):
    x = torch.full((4, 6), value)
    prepared = _calibrated(Scaled().eval(), x, [x, x])
    scales = {k: float(o.calculate_qparams()[0]) for k, o in prepared.lucid_fx_observers.items()}
    assert all(s > 0 and s == s and s != float("inf") for s in scales.values()), scales
    qmodel = lucid_fx.convert(prepared)
    out = qmodel(x)
    step = scales["mul"]
    assert (out - max(value, 0.0) * 1.5).abs().max() <= step + 1e-6


def test_zero_input_to_a_linear_gives_its_bias():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    zeros = torch.zeros(2, 4)
    prepared = _calibrated(model, zeros, [zeros])
    in_scale = float(prepared.lucid_fx_observers["input_1"].calculate_qparams()[0])
    out_scale = float(prepared.lucid_fx_observers["_0"].calculate_qparams()[0])
    assert 0 < in_scale <= 1e-6  # the eps floor, not 0 or NaN
    out = lucid_fx.convert(prepared)(zeros)
    assert (out - model[0].bias).abs().max() <= out_scale + 1e-6


# 8. half-precision models: refused with what to do ---------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_models_are_refused(dtype):
    x = torch.randn(2, 4)
    expected = f"prepare: the model's parameter '0.weight' is {dtype}; lucid_fx quantizes float32 models. Call model.float() first"
    with pytest.raises(TypeError, match=re.escape(expected)):
        lucid_fx.prepare(_mlp().to(dtype), example_inputs=(x.to(dtype),))
    with pytest.raises(TypeError, match=re.escape(expected.replace("prepare:", "prepare_qat:"))):
        lucid_fx.prepare_qat(_mlp().train().to(dtype), example_inputs=(x.to(dtype),))
    with pytest.raises(TypeError, match=re.escape(f"prepare: example_inputs[0] is {dtype}; lucid_fx quantizes float32 models. Pass example_inputs[0].float()")):
        lucid_fx.prepare(_mlp(), example_inputs=(x.to(dtype),))
    prepared = _calibrated(_mlp(), x, _batches(2))
    with pytest.raises(TypeError, match=re.escape(f"convert: the model's parameter '0.weight' is {dtype}; lucid_fx quantizes float32 models. Call model.float() first")):
        lucid_fx.convert(prepared.to(dtype))


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
