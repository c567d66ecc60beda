"""A model captured by torch.export is called as the model is (lucid_fx/_forward_signature.py):
positional calls bind as the model binds them, and inputs the graph was fixed for are checked."""

import inspect
import io

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.program import programs_of


class WithCache(nn.Module):  # GPT-2's call: (input_ids, past_key_values=None, attention_mask=None)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, cache=None, mask=None):
        y = self.fc(x)
        if cache is not None:
            y = y + cache
        return y if mask is None else y * mask


class WithFlags(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, flag=False, scale=1.0, *, mode="sum"):
        y = self.fc(x)
        return y * scale if flag else y + scale


def _data(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 8, generator=g), (torch.rand(2, 8, generator=g) > 0.3).float()) for _ in range(n)]


@pytest.fixture(scope="module")
def with_cache():
    torch.manual_seed(0)
    model = WithCache().eval()
    x, mask = _data(0, 1)[0]
    prepared = lucid_fx.prepare(model, None, (x, None, mask), capture="export")
    lucid_fx.calibrate(prepared, [(x, None, m) for x, m in _data(1)], progress=False)
    return model, prepared, lucid_fx.convert(prepared)


def test_the_captured_model_keeps_the_models_signature(with_cache):
    model, prepared, qmodel = with_cache
    assert prepared.lucid_fx_report.captures[""] == "export"
    expected = str(inspect.signature(model.forward))
    assert str(inspect.signature(prepared.forward)) == expected == "(x, cache=None, mask=None)"
    assert str(inspect.signature(qmodel.forward)) == expected


def test_positional_keyword_and_dict_calls_agree(with_cache):
    model, _, qmodel = with_cache
    x, mask = _data(2, 1)[0]
    by_keyword = qmodel(x=x, mask=mask)
    for out in (qmodel(x, None, mask), qmodel(x, mask=mask), qmodel(x, None, mask), qmodel(**{"x": x, "mask": mask})):
        assert torch.equal(out, by_keyword)
    assert programs_of(qmodel), "repeated calls run the lowered program"
    error = (by_keyword - model(x, None, mask)).pow(2).mean() / model(x, None, mask).pow(2).mean()
    assert error < 1e-2  # int8 close to the float model called the same way


def test_an_input_left_at_its_default_at_capture_must_stay_there(with_cache):
    model, prepared, qmodel = with_cache
    x, mask = _data(3, 1)[0]
    # The model reads (x, mask) as (x, cache): torch.export's own forward gave mask to `mask` here.
    message = (r"^forward: cache was left at its default \(None\) when prepare captured the model with torch.export, "
               r"so the graph has no input for it; call with cache=None, or prepare again with cache in the example inputs$")
    for call in (lambda: qmodel(x, mask), lambda: qmodel(x, cache=mask, mask=mask), lambda: prepared(x, mask)):
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(TypeError, match=r"^forward: mask was given when prepare captured the model .* pass mask$"):
        qmodel(x)


def test_calibrate_takes_positional_batches_and_names_a_bad_one(with_cache):
    model, _, _ = with_cache
    x, mask = _data(0, 1)[0]
    by_position = lucid_fx.prepare(model, None, (x, None, mask), capture="export")
    by_name = lucid_fx.prepare(model, None, {"x": x, "mask": mask}, capture="export")
    assert lucid_fx.calibrate(by_position, [(x, None, m) for x, m in _data(1)], progress=False) == 4
    assert lucid_fx.calibrate(by_name, [{"x": x, "mask": m} for x, m in _data(1)], progress=False) == 4
    assert torch.equal(lucid_fx.convert(by_position)(x, None, mask), lucid_fx.convert(by_name)(x, None, mask))
    with pytest.raises(TypeError, match=r"^calibrate: batch 0 does not fit the prepared model's inputs \(x, cache, mask\): "
                                        r"forward: cache was left at its default \(None\)"):
        lucid_fx.calibrate(by_position, [(x, mask)], progress=False)


def test_compare_binds_positional_batches_as_the_model_does(with_cache):
    model, _, qmodel = with_cache
    batches = [(x, None, m) for x, m in _data(4, 2)]
    result = lucid_fx.compare(model, qmodel, batches)
    by_name = lucid_fx.compare(model, qmodel, [{"x": x, "mask": m} for x, _, m in batches])
    with torch.no_grad():
        reference = torch.cat([model(*b) for b in batches])
    by_hand = 10 * torch.log10(reference.pow(2).sum() / (torch.cat([qmodel(*b) for b in batches]) - reference).pow(2).sum())
    assert result.output_sqnr_db == pytest.approx(by_name.output_sqnr_db)
    assert result.output_sqnr_db == pytest.approx(float(by_hand), abs=0.05) and result.output_sqnr_db > 15


@pytest.fixture(scope="module")
def with_flags():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    example = {"x": x, "flag": True, "scale": 2.0}
    return WithFlags().eval(), lucid_fx.quantize(WithFlags().eval(), example, [dict(example, x=torch.randn(2, 4)) for _ in range(3)], capture="export")


def test_a_non_tensor_input_must_have_its_captured_value(with_flags):
    _, qmodel = with_flags
    x = torch.randn(2, 4)
    assert str(inspect.signature(qmodel.forward)) == "(x, flag=False, scale=1.0, *, mode='sum')"
    captured = qmodel(x=x, flag=True, scale=2.0)
    assert torch.equal(qmodel(x, True, 2), captured)  # 2 for 2.0: the same number
    for call, name, value in [(lambda: qmodel(x, False, 2.0), "flag", "True"), (lambda: qmodel(x, True, 3.0), "scale", "2.0"),
                              (lambda: qmodel(x), "flag", "True"), (lambda: qmodel(x, 1, 2.0), "flag", "True"),
                              (lambda: qmodel(x, True, 2.0, mode="max"), "mode", "'sum'")]:
        with pytest.raises(TypeError, match=rf"^forward: {name} was (left at its default \()?{value}"):
            call()


def test_save_and_load_keep_the_signature_and_its_checks(with_cache, with_flags):
    for qmodel, call, bad in [(with_cache[2], lambda m, x: m(x, None, torch.ones(2, 8)), lambda m, x: m(x, torch.ones(2, 8))),
                              (with_flags[1], lambda m, x: m(x[:, :4], True, 2.0), lambda m, x: m(x[:, :4], False, 2.0))]:
        buffer = io.BytesIO()
        lucid_fx.save(qmodel, buffer)
        buffer.seek(0)
        loaded = lucid_fx.load(buffer)
        assert str(inspect.signature(loaded.forward)) == str(inspect.signature(qmodel.forward))
        x = torch.randn(2, 8)
        assert torch.equal(call(loaded, x), call(qmodel, x))
        with pytest.raises(TypeError, match=r"^forward: "):
            bad(loaded, x)


def _saved(qmodel):
    """The data ``lucid_fx.save`` writes for ``qmodel``, and its forward-signature record in it."""
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True)
    return data, _pytree_record(data)[2]


def _load(data):
    buffer = io.BytesIO()
    torch.save(data, buffer)
    buffer.seek(0)
    return lucid_fx.load(buffer)


def _pytree_record(data):
    if isinstance(data, dict):
        if "pytree" in data:
            return data["pytree"]
        data = list(data.values())
    for value in data if isinstance(data, list) else ():
        found = _pytree_record(value)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("edit, message", [
    (lambda p: p[0].update(name="x): import os #"), r"forward parameter name 'x\): import os #' is not a Python identifier"),
    (lambda p: p[1].update(name="torch"), r"forward parameter name 'torch' is not a Python identifier the code can take"),
    (lambda p: p[1].update(default=[1]), r"forward parameter 'cache' has a default that is not a literal"),
    (lambda p: p[1].update(default=float("nan")), r"forward parameter 'cache' has a default that is not a literal"),
    (lambda p: p[1].pop("default"), r"forward parameter 'cache' was not captured and has no default"),
    (lambda p: p[2].update(name="x"), r"forward parameter 'x' is repeated or malformed"),
    (lambda p: p[1].update(captured=True), r"the forward signature does not fit the graph's inputs"),
    (lambda p: p[0].update(code="1"), r"malformed forward parameter"),
    (lambda p: p[1].update(kind="keyword"), r"positional parameter 'mask' after a keyword-only one"),
    (lambda p: p[2].pop("default"), r"positional parameter 'mask' without a default follows one with a default"),
], ids=["code-as-name", "shadows-torch", "list-default", "nan-default", "no-default", "repeated", "not-captured", "extra-key",
        "positional-after-keyword", "required-after-default"])
def test_load_refuses_a_crafted_signature_before_it_becomes_code(with_cache, edit, message):
    data, record = _saved(with_cache[2])
    assert [p["name"] for p in record["params"]] == ["x", "cache", "mask"]
    edit(record["params"])
    with pytest.raises(ValueError, match=message):
        _load(data)


def test_a_signature_that_cannot_be_written_keeps_torch_exports_call():
    class Star(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, *xs):
            return self.fc(xs[0] + xs[1])

    a, b = torch.randn(2, 4), torch.randn(2, 4)
    prepared = lucid_fx.prepare(Star().eval(), None, (a, b), capture="export")
    assert list(inspect.signature(prepared.forward).parameters) == ["xs_0", "xs_1"]  # torch.export's flattened inputs
    with pytest.raises(TypeError, match=r"^calibrate: batch 0 does not fit .*prepare captured this model with "
                                        r"torch.export, which takes the inputs it was given, in the order and by the names"):
        lucid_fx.calibrate(prepared, [(a, b, a)], progress=False)


def test_a_parameter_named_like_a_name_the_code_reads_keeps_torch_exports_call():
    class Shadow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, type=None):  # `type` would shadow the builtin the input checks call
            return self.fc(x)

    x = torch.randn(2, 4)
    prepared = lucid_fx.prepare(Shadow().eval(), None, (x,), capture="export")
    assert str(inspect.signature(prepared.forward)) == "(x)"
    assert lucid_fx.calibrate(prepared, [(x,)], progress=False) == 1


def test_keyword_inputs_in_another_order_than_the_signature_still_bind_by_the_signature(with_cache):
    model, _, _ = with_cache
    x, mask = _data(5, 1)[0]
    prepared = lucid_fx.prepare(model, None, {"mask": mask, "x": x}, capture="export")
    assert str(inspect.signature(prepared.forward)) == "(x, cache=None, mask=None)"
    lucid_fx.calibrate(prepared, [(x, None, m) for x, m in _data(1)], progress=False)
    assert torch.equal(lucid_fx.convert(prepared)(x, None, mask), with_cache[2](x, None, mask))


class DictOut(WithCache):
    def forward(self, x, cache=None, mask=None):
        y = super().forward(x, cache, mask)
        return {"y": y, "pair": (y.relu(), x)}


def test_pickling_a_converted_model_keeps_the_signature_and_its_checks(with_cache):
    x, mask = _data(6, 1)[0]
    dict_model = DictOut().eval()
    dict_q = lucid_fx.quantize(dict_model, {"x": x, "mask": mask}, [{"x": x, "mask": m} for x, m in _data(1)], capture="export")
    for qmodel in (with_cache[2], dict_q):
        expected = qmodel(x, None, mask)
        buffer = io.BytesIO()
        torch.save(qmodel, buffer)  # pickles torch.export's call: the input checks would stop the retrace
        buffer.seek(0)
        with pytest.warns(FutureWarning, match="LeafSpec"):  # torch's own, unpickling a pytree spec
            loaded = torch.load(buffer, weights_only=False)
        assert str(inspect.signature(loaded.forward)) == str(inspect.signature(qmodel.forward)) == "(x, cache=None, mask=None)"
        got = loaded(x, None, mask)
        assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)))
        assert torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(expected)
        with pytest.raises(TypeError, match=r"^forward: cache was left at its default"):
            loaded(x, mask)
        assert torch.equal(torch.utils._pytree.tree_leaves(qmodel(x, None, mask))[0], torch.utils._pytree.tree_leaves(expected)[0])


def test_a_default_that_is_not_a_literal_leaves_its_parameter_out_and_the_rest_keyword_only():
    class WithDtype(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, dtype=torch.float32, mask=None, scale=2.0):
            return self.fc(x.to(dtype)) * mask * scale

    x, mask = _data(7, 1)[0]
    model = WithDtype().eval()
    qmodel = lucid_fx.quantize(model, {"x": x, "mask": mask}, [{"x": x, "mask": m} for x, m in _data(1)], capture="export")
    assert str(inspect.signature(qmodel.forward)) == "(x, *, mask=None, scale=2.0)"
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 4 were given"):
        qmodel(x, torch.float32, mask)  # never mask read as dtype, nor dtype as mask
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'dtype'"):
        qmodel(x, dtype=torch.float32, mask=mask)
    with pytest.raises(TypeError, match=r"^forward: scale was left at its default \(2.0\)"):
        qmodel(x, mask=mask, scale=3.0)
    with torch.no_grad():
        error = (qmodel(x, mask=mask) - model(x, mask=mask)).pow(2).mean() / model(x, mask=mask).pow(2).mean()
    assert error < 1e-2


def test_a_captured_input_whose_default_is_not_a_literal_is_required_and_keyword_only_after_a_default():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, cache=None, scale=torch.tensor(1.0)):
            return self.fc(x) * scale

    x = torch.randn(2, 8)
    example = {"x": x, "scale": torch.tensor(0.5)}
    qmodel = lucid_fx.quantize(Scaled().eval(), example, [example], capture="export")
    assert str(inspect.signature(qmodel.forward)) == "(x, cache=None, *, scale)"
    assert torch.equal(qmodel(x, scale=torch.tensor(0.5)), qmodel(x=x, cache=None, scale=torch.tensor(0.5)))


def test_an_input_of_another_shape_than_captured_is_refused_by_name(with_cache):
    # torch.export fixes the graph to the example's shapes: another batch used to give a wrong answer
    # (the BERT-like family returned a batch of 2 for a batch of 1) or a bare broadcasting error.
    _, prepared, qmodel = with_cache
    x, mask = _data(8, 1)[0]
    message = (r"^forward: x has shape \(1, 8\), but prepare captured the model with torch.export on shape \(2, 8\), "
               r"which fixes the graph to it .*; call with that shape \(pad or split the batch\), or prepare again")
    for model in (prepared, qmodel):
        with pytest.raises(ValueError, match=message):
            model(x[:1], None, mask[:1])
    with pytest.raises(ValueError, match=r"^forward: mask has shape \(2, 4\)"):
        qmodel(x, None, mask[:, :4])
    with pytest.raises(ValueError, match="^calibrate: batch 0: " + message[1:]):
        lucid_fx.calibrate(prepared, [(x[:1], None, mask[:1])], progress=False)
    assert qmodel(x, None, mask).shape == (2, 8)


@pytest.mark.parametrize("shapes, message", [
    ([[2, 8]], r"the input shapes are not one list of sizes \(or None\) per input"),
    ([[2, 8], "2, 8"], r"the input shapes are not one list of sizes"),
    ([[2, 8], [2, -1]], r"the input shapes are not one list of sizes"),
], ids=["too-few", "code-as-shape", "negative"])
def test_load_refuses_crafted_input_shapes(with_cache, shapes, message):
    data, record = _saved(with_cache[2])
    assert record["shapes"] == [[2, 8], [2, 8]]
    record["shapes"] = shapes
    with pytest.raises(ValueError, match=message):
        _load(data)
