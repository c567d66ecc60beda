"""Where a torch.export capture keeps torch.export's own call (``forward(*args)``, positional-only
parameters, an ``ExportedProgram`` given to prepare), its inputs are still checked for what the
graph was fixed to (lucid_fx/_forward_signature.py, ``SignatureCodeGen`` with ``params=None``):
each used to give a batch of 2 for a batch of 1, or the captured value's answer for another value,
silently."""

import inspect
import io

import pytest
import torch
from torch import nn

import lucid_fx
from tests.test_forward_signature import _load, _saved

SHAPE_MESSAGE = (r"^forward: {} has shape \(1, 16\), but prepare captured the model with torch.export on shape \(2, 16\), "
                 r"which fixes the graph to it .*; call with that shape \(pad or split the batch\), or prepare again with dynamic_shapes=\"auto\"")


class Star(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, *xs):
        return self.fc(xs[0] + xs[1]).reshape(2, -1)  # torch.export keeps the 2, whatever the batch


class PositionalOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, flag=True, /):
        return self.fc(x).reshape(2, -1) * (2.0 if flag else 1.0)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, scale: float = 1.0):
        return self.fc(x).reshape(2, -1) * scale


def _batches(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, generator=g) for _ in range(n)]


def _sqnr(reference, got):
    return 10 * torch.log10(reference.pow(2).mean() / (reference - got).pow(2).mean()).item()


def test_star_args_keep_torch_exports_call_and_check_each_input_shape():
    torch.manual_seed(0)
    model = Star().eval()
    a, b = _batches(1, 2)
    prepared = lucid_fx.prepare(model, example_inputs=(a, b), capture="export")
    lucid_fx.calibrate(prepared, [(a, b)] + list(zip(_batches(2, 16), _batches(9, 16))), progress=False)
    qmodel = lucid_fx.convert(prepared)
    assert str(inspect.signature(qmodel.forward)) == "(xs_0, xs_1)"
    with torch.no_grad():
        assert _sqnr(model(a, b), qmodel(a, b)) > 20  # held out: an outlier past the calibrated range is clipped
    for m in (prepared, qmodel):
        with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("xs_0")):
            m(a[:1], b[:1])
        with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("xs_1")):
            m(a, b[:1])
    with pytest.raises(ValueError, match=r"^calibrate: batch 1: forward: xs_0 has shape \(1, 16\)"):
        lucid_fx.calibrate(prepared, [(a, b), (a[:1], b[:1])], progress=False)


def test_positional_only_parameters_keep_torch_exports_call_and_its_checks():
    x = _batches(3, 1)[0]
    qmodel = lucid_fx.quantize(PositionalOnly().eval(), (x,), [(y,) for y in _batches(4)], capture="export")
    assert str(inspect.signature(qmodel.forward)) == "(x)"
    with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("x")):
        qmodel(x[:1])
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 3 were given"):
        qmodel(x, False)  # flag was left at its default: the graph has no input for it
    assert qmodel(x).shape == (2, 16)


def test_a_refused_input_prints_nothing_and_keeps_its_traceback(capfd):
    """torch.fx prints the generated code to stderr, and drops the traceback, for an exception raised
    in generated code: the checks raise from lucid_fx._forward_signature.refuse instead."""
    x = _batches(3, 1)[0]
    prepared = lucid_fx.prepare(Scaled().eval(), example_inputs=(x,), capture="export")
    lucid_fx.calibrate(prepared, _batches(4), progress=False)
    for model in (prepared, lucid_fx.convert(prepared)):
        capfd.readouterr()
        with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("x")) as info:
            model(x[:1])
        assert capfd.readouterr().err == ""
        assert info.traceback[-1].name == "refuse" and any("eval_with_key" in str(e.path) for e in info.traceback)


@pytest.fixture(scope="module", params=["ExportedProgram", "module()"])
def from_exported(request):
    torch.manual_seed(0)
    model = Scaled().eval()
    x = _batches(5, 1)[0]
    ep = torch.export.export(model, (x,), {"scale": 2.0})
    source = ep if request.param == "ExportedProgram" else ep.module()
    prepared = lucid_fx.prepare(source, example_inputs=(x,), example_kwargs={"scale": 2.0})
    lucid_fx.calibrate(prepared, [(y, 2.0) for y in _batches(6, 16)], progress=False)
    return model, prepared, lucid_fx.convert(prepared)


def test_an_exported_program_keeps_its_guards_on_shapes_and_values(from_exported):
    model, prepared, qmodel = from_exported
    x = _batches(7, 1)[0]
    with torch.no_grad():
        expected = model(x, scale=2.0)
    assert _sqnr(expected, qmodel(x, scale=2.0)) > 20
    assert torch.equal(qmodel(x, scale=2.0), qmodel(x, 2.0))
    assert torch.equal(qmodel(x, scale=2.0), qmodel(x, scale=2))  # 2 is the captured 2.0
    for m in (prepared, qmodel):
        with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("x")):
            m(x[:1], scale=2.0)
        with pytest.raises(TypeError, match=r"^forward: scale was 2.0 when prepare captured the model with torch.export, "
                                            r"which fixes the graph for that value; call with scale=2.0"):
            m(x, scale=3.0)
        with pytest.raises(TypeError, match=r"^forward: scale was 2.0"):
            m(x, scale=True)


def test_save_load_and_pickling_keep_torch_exports_call_with_its_checks(from_exported):
    _, _, qmodel = from_exported
    x = _batches(8, 1)[0]
    data, record = _saved(qmodel)
    assert record == {"params": None, "shapes": [[2, 16], None], "fixed": {"scale": 2.0}}
    buffer = io.BytesIO()
    torch.save(qmodel, buffer)
    buffer.seek(0)
    with pytest.warns(FutureWarning, match="LeafSpec"):  # torch's own, unpickling a pytree spec
        pickled = torch.load(buffer, weights_only=False)
    for loaded in (_load(data), pickled):
        assert str(inspect.signature(loaded.forward)) == "(x, scale)"
        assert torch.equal(loaded(x, scale=2.0), qmodel(x, scale=2.0))
        with pytest.raises(TypeError, match=r"^forward: scale was 2.0"):
            loaded(x, scale=3.0)
        with pytest.raises(ValueError, match=SHAPE_MESSAGE.format("x")):
            loaded(x[:1], scale=2.0)


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(fixed={"scale": [2.0]}), r"the fixed input values are not literals of the graph's inputs"),
    (lambda r: r.update(fixed={"os.system('x')": 1}), r"the fixed input values are not literals of the graph's inputs"),
    (lambda r: r.pop("fixed"), r"malformed forward signature record"),
    (lambda r: r.update(shapes=[[2, 16]]), r"the input shapes are not one list of sizes"),
], ids=["list-value", "not-an-input", "no-fixed", "too-few-shapes"])
def test_load_refuses_a_crafted_record_for_torch_exports_call(from_exported, edit, message):
    data, record = _saved(from_exported[2])
    edit(record)
    with pytest.raises(ValueError, match=message):
        _load(data)

