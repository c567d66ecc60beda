"""Dynamic shapes through torch.export captures (lucid_fx/_capture.py): an ExportedProgram exported
with ``dynamic_shapes``, and ``prepare(..., dynamic_shapes=)`` for prepare's own capture, give a
model that runs every shape the capture allows, through convert, save and load; the static dims
and the rank are still checked."""

import inspect

import pytest
import torch
from torch import nn

import lucid_fx
from tests.models import bert, llama
from tests.test_export_call_checks import _sqnr
from tests.test_forward_signature import _load, _saved


def _tokens(shape, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.long)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _quantized(family, **options):
    model = family.make_model()
    _, example = family.example_inputs()
    prepared = lucid_fx.prepare(options.pop("source", model), example_kwargs=example, **options)
    lucid_fx.calibrate(prepared, [k for _, k in family.calibration_batches(4)], progress=False)
    return model, lucid_fx.convert(prepared)


def _check_shapes(model, qmodel, vocab, key, shapes=((1, 8), (4, 32), (3, 5))):
    for i, shape in enumerate(shapes):
        inputs = _tokens(shape, i, vocab)
        with torch.no_grad():
            expected = model(**inputs)[key]
        got = qmodel(**inputs)[key]
        assert got.shape == expected.shape and _sqnr(expected, got) > 25, (shape, _sqnr(expected, got))


def test_an_exported_program_with_dynamic_shapes_runs_every_shape_it_allows():
    model = bert.make_model()
    _, example = bert.example_inputs()
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", min=2, max=bert.MAX_POSITIONS)
    ep = torch.export.export(model, (), example, strict=False,
                             dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}})
    _, qmodel = _quantized(bert, source=ep)
    report = qmodel.lucid_fx_convert_report
    assert report.int8_flop_share == 1.0
    assert [r for r in report.float_regions if r.kind == "op"] == []  # x.size(d), x[:, :n], x[:, 0] are rewritten too
    _check_shapes(model, qmodel, bert.VOCAB, "last_hidden_state")
    data, record = _saved(qmodel)
    assert record["shapes"] == [[None, None], [None, None]]
    loaded, inputs = _load(data), _tokens((3, 5), 9, bert.VOCAB)
    assert torch.equal(loaded(**inputs)["last_hidden_state"], qmodel(**inputs)["last_hidden_state"])
    with pytest.raises(ValueError, match=r"^forward: input_ids has shape \(3, 5, 1\), but prepare captured the model with "
                                         r"torch.export on shape \(any, any\)"):
        qmodel(input_ids=inputs["input_ids"][..., None], attention_mask=inputs["attention_mask"])


@pytest.mark.parametrize("family, key", [(bert, "last_hidden_state"), (llama, "logits")], ids=["bert", "llama"])
def test_prepare_with_dynamic_shapes_auto_runs_other_batches_and_lengths(family, key):
    model, qmodel = _quantized(family, dynamic_shapes="auto")
    assert qmodel.lucid_fx_convert_report.int8_flop_share == 1.0
    _check_shapes(model, qmodel, family.VOCAB, key)


def test_prepare_takes_torch_exports_dict_and_checks_the_static_dims():
    seq = torch.export.Dim("seq", min=2, max=bert.MAX_POSITIONS)  # the batch stays the example's 2
    model, qmodel = _quantized(bert, capture="export", dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    _check_shapes(model, qmodel, bert.VOCAB, "last_hidden_state", shapes=((2, 8), (2, 40)))
    with pytest.raises(ValueError, match=r"^forward: input_ids has shape \(3, 8\), but prepare captured the model with "
                                         r"torch.export on shape \(2, any\)"):
        qmodel(**_tokens((3, 8), 0, bert.VOCAB))


def test_dynamic_shapes_auto_for_a_forward_with_star_args():
    class Star(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, *xs):
            return self.fc(xs[0] + xs[1])

    model, g = Star().eval(), torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 16, generator=g), torch.randn(2, 16, generator=g)
    qmodel = lucid_fx.quantize(model, (a, b), [(a, b)], capture="export", dynamic_shapes="auto")
    assert str(inspect.signature(qmodel.forward)) == "(xs_0, xs_1)"
    x, y = torch.randn(5, 16, generator=g).clamp(-2, 2), torch.randn(5, 16, generator=g).clamp(-2, 2)
    with torch.no_grad():
        assert _sqnr(model(x, y), qmodel(x, y)) > 20


def test_dynamic_shapes_is_refused_where_it_cannot_apply():
    model = bert.make_model()
    _, example = bert.example_inputs()
    with pytest.raises(TypeError, match=r"^prepare: dynamic_shapes=\(\{0: 'batch'\},\); pass \"auto\" or a dict by "
                                        r"forward's parameter names"):
        lucid_fx.prepare(model, example_kwargs=example, dynamic_shapes=({0: "batch"},))
    ep = torch.export.export(model, (), example, strict=False)
    with pytest.raises(ValueError, match=r"^prepare: dynamic_shapes is for a model prepare exports; an ExportedProgram "
                                         r"has the shapes it was exported with"):
        lucid_fx.prepare(ep, dynamic_shapes="auto")


def test_a_dynamic_capture_pickles_saves_and_loads():
    # GPT-2's causal bias buffer sliced by a dynamic length: unpickling re-traces forward, and fx's
    # default tracer read the buffer as a tensor that a slice of a proxy cannot index
    import io

    from tests.models import gpt2

    _, qmodel = _quantized(gpt2, dynamic_shapes="auto")
    inputs = _tokens((3, 7), 5, gpt2.VOCAB)
    expected = qmodel(**inputs)["logits"]
    buffer = io.BytesIO()
    torch.save(qmodel, buffer)
    buffer.seek(0)
    with pytest.warns(FutureWarning, match="LeafSpec"):  # torch's own, unpickling a pytree spec
        pickled = torch.load(buffer, weights_only=False)
    data, _ = _saved(qmodel)
    for loaded in (pickled, _load(data)):
        assert torch.equal(loaded(**inputs)["logits"], expected)
        assert loaded(**_tokens((2, 11), 6, gpt2.VOCAB))["logits"].shape == (2, 11, gpt2.VOCAB)


def test_a_dim_the_models_code_fixes_under_auto_is_checked_and_named():
    # Dim.AUTO lets torch.export fix a dim the code loops over (transformers' Mamba scan: `for i in
    # range(seq_len)`); it stays a symbol with a known value. Unchecked, another length failed deep
    # in the graph (IndexError: index 9 is out of bounds for dimension 2 with size 9).
    class Scan(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h, outs = torch.zeros_like(x[:, 0]), []
            for t in range(x.shape[1]):
                h = torch.tanh(self.fc(x[:, t]) + h)
                outs.append(h)
            return torch.stack(outs, 1)

    torch.manual_seed(0)
    model, g = Scan().eval(), torch.Generator().manual_seed(0)
    data = [torch.randn(2, 5, 8, generator=g) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],), capture="export", dynamic_shapes="auto")
    lucid_fx.calibrate(prepared, [(x,) for x in data], progress=False)
    qmodel = lucid_fx.convert(prepared)
    x = torch.randn(3, 5, 8, generator=g)  # another batch: the batch dim stayed dynamic
    with torch.no_grad():
        assert _sqnr(model(x), qmodel(x)) > 20  # 23.1 measured: five tanh steps, each requantized
    message = (r"^forward: x has shape \(3, 7, 8\), but prepare captured the model with torch.export on shape "
               r"\(any, 5, 8\): the graph is dynamic in the dims shown as 'any' and fixed to the example's size in "
               r"dim 1, 2 \(not marked dynamic, or fixed by the model's code: a Python loop or branch over a size "
               r"fixes it\); call with those sizes \(pad or split\), or prepare again on the sizes you need$")
    for m in (prepared, qmodel):
        with pytest.raises(ValueError, match=message):
            m(torch.randn(3, 7, 8))
    data, record = _saved(qmodel)
    assert record["shapes"] == [[None, 5, 8]]
    with pytest.raises(ValueError, match=message):
        _load(data)(torch.randn(3, 7, 8))


class _EncoderUnderATracedRoot(nn.Module):
    """A root torch.fx traces around a child it cannot (torch's encoder layer: captured with torch.export)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def test_dynamic_shapes_auto_reaches_a_child_captured_with_torch_export():
    torch.manual_seed(0)
    model = _EncoderUnderATracedRoot().eval()
    data = [torch.randn(4, 10, 32) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data, progress=False, dynamic_shapes="auto")
    # The child's capture was fixed to (4, 10, 32): another shape was refused, telling the user to pass "auto".
    for shape in ((2, 7, 32), (4, 10, 32), (8, 10, 32)):  # (far shorter sequences than calibration's clip)
        x = torch.randn(shape)
        assert _sqnr(model(x), qmodel(x)) > 25, shape
