"""The bad-input matrix, cases 1-8: awkward arguments and data (cases 9-16, awkward models,
devices and reductions, are in test_bad_input_models.py).

Each test asserts the exact message (class, the node or module it names, what to do), or, for
inputs that are awkward but legal, that the result is right.
"""

import re
import sys
import warnings

import pytest
import torch
from torch import nn

import lucid_fx
from _bad_input import _batches, _calibrated, _mlp, _targets


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
@pytest.mark.parametrize("stage", ["prepared", "calibrated", "converted"])
@pytest.mark.parametrize("verb", ["prepare", "quantize"])
def test_a_model_lucid_fx_already_prepared_or_converted_is_refused(stage, verb):
    x = torch.randn(2, 4)
    model = lucid_fx.prepare(_mlp(), example_inputs=(x,))
    if stage != "prepared":
        lucid_fx.calibrate(model, [x], progress=False)
    if stage == "converted":
        model = lucid_fx.convert(model)
    message = (f"^{verb}: the model is already prepared \\(it holds lucid_fx's observers\\); calibrate it and convert it "
               f"\\(lucid_fx.calibrate, lucid_fx.convert\\), or {verb} the float model$" if stage != "converted" else
               f"^{verb}: the model is already converted to int8 \\(its graph calls lucid_fx's kernels\\); {verb} the "
               "float model it came from$")
    with pytest.raises(ValueError, match=message):  # preparing it again observed the observers
        lucid_fx.prepare(model, example_inputs=(x,)) if verb == "prepare" else lucid_fx.quantize(model, (x,), [x])


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


def test_calibrate_names_the_inputs_a_batch_does_not_fit():
    x = torch.randn(2, 8)
    prepared = lucid_fx.prepare(nn.Linear(8, 8).eval(), None, (x,))
    with pytest.raises(TypeError, match=r"^calibrate: batch 1 does not fit the prepared model's inputs \(input\): forward\(\) "
                                        r"takes 2 positional arguments but 3 were given; pass each batch as the example "
                                        r"inputs were passed to prepare$"):
        lucid_fx.calibrate(prepared, [x, (x, x)], progress=False)


def _observer_states(prepared):
    return {name: {k: v.clone() for k, v in o.state_dict().items()} for name, o in prepared.lucid_fx_observers.items()}


@pytest.mark.parametrize("bad, message", [
    (torch.randn(4, 8) * 100, r"^calibrate: batch 1 \(Tensor\[4, 8\] float32\) raised RuntimeError at node '_0' "
                              r"\(module '0'\) on \(Tensor\[4, 8\] float32\): mat1 and mat2 shapes cannot be multiplied "
                              r"\(4x8 and 4x8\); prepare's example inputs were \(Tensor\[2, 4\] float32\)\. The observers "
                              r"are as they were before this batch: fix or drop it and calibrate again$"),
    (torch.randint(0, 5, (4, 4)), r"^calibrate: batch 1 \(Tensor\[4, 4\] int64\) raised RuntimeError at node '_0' "
                                  r"\(module '0'\) on \(Tensor\[4, 4\] int64\): mat1 and mat2 must have the same dtype"),
], ids=["wrong-shape", "wrong-dtype"])
def test_a_batch_that_raises_is_named_and_leaves_the_observers_as_they_were(bad, message):
    batches = _batches(4)
    prepared = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    lucid_fx.calibrate(prepared, batches[:2], progress=False)
    with pytest.raises(RuntimeError, match=message):
        lucid_fx.calibrate(prepared, [batches[2], bad], progress=False)  # batch 0 runs, batch 1 raises
    lucid_fx.calibrate(prepared, [batches[3]], progress=False)
    reference = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    lucid_fx.calibrate(reference, batches, progress=False)  # the same batches, without the bad one
    after, expected = _observer_states(prepared), _observer_states(reference)
    assert after.keys() == expected.keys()
    for name in after:  # the input's observer saw the bad batch before the linear raised: rolled back
        assert all(torch.equal(after[name][k], expected[name][k]) for k in after[name]), name


class _Counter(nn.Module):
    """A model whose forward writes its own buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return self.fc(x) * self.count


def test_calibration_leaves_the_models_own_buffers_as_prepare_found_them():
    model, batches = _Counter().eval(), _batches(6)
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    # The six calibration calls counted: the converted model started at 6, its first output 7x the float one's.
    assert (float(model.count), float(qmodel.count)) == (0.0, 0.0)
    x = batches[0]
    assert (qmodel(x) - model(x)).abs().max() < 0.05 and (float(model.count), float(qmodel.count)) == (1.0, 1.0)


def test_one_tensor_as_the_calibration_data_is_refused():
    prepared = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    with pytest.raises(TypeError, match=r"^calibrate: data is one tensor \(Tensor\[8, 4\] float32\), which would run "
                                        r"row by row; pass a list of batches: \[x\] for one batch, or "
                                        r"list\(x\.split\(n\)\) for batches of n$"):
        lucid_fx.calibrate(prepared, torch.randn(8, 4), progress=False)


# 6. NaN and inf in calibration batches ---------------------------------------------------------
def test_nonfinite_calibration_values_are_skipped_counted_and_named():
    model = _mlp()
    batches = _batches(4)
    batches[1][0, 0], batches[1][3, 2], batches[2][5, 1] = float("nan"), float("inf"), float("-inf")
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lucid_fx.calibrate(prepared, batches, progress=False); calibrated_at = sys._getframe().f_lineno  # noqa: E702
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    # Each points at the line that calibrated (it pointed into torch's Module._call_impl).
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, calibrated_at)}
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


def test_convert_after_only_nonfinite_calibration_says_so():
    prepared = lucid_fx.prepare(_mlp(), example_inputs=(torch.randn(2, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lucid_fx.calibrate(prepared, [torch.full((2, 4), float("nan"))], progress=False)
    with pytest.raises(ValueError, match=r"^convert: the observers of node\(s\) input_1, _1, _2 saw only NaN or ±inf "
                                         r"values \(\d+ skipped\), no finite one: clean the calibration data"):
        lucid_fx.convert(prepared)


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
