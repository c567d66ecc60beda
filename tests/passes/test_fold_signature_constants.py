"""fold_signature_constants (passes/fold_signature_constants.py): what a program computes the same on
every call of its signature (from constants and input shapes) is computed once; what is written in
place, returned, random or a child module is left to run time; the program's values do not change."""

import pytest
import torch
from torch import fx, nn

import lucid_fx
from _bad_input import OptionalBias
from lucid_fx.passes.fold_signature_constants import fold_signature_constants
from lucid_fx.passes.lower_to_program import record_values
from lucid_fx.program import programs_of


def _folded(module, *inputs):
    gm = fx.symbolic_trace(module)
    out, values = record_values(gm, inputs)
    count = fold_signature_constants(gm, values)
    gm.recompile()
    return gm, out, count


def _calls(gm):
    return [n.target if isinstance(n.target, str) else n.target.__name__ for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


class Rotary(nn.Module):
    """Llama's cos/sin from positions: arange(seq) from the input's shape, a buffer, a matmul."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x):
        positions = torch.arange(x.shape[1]).float()
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + x * emb.sin()


def test_values_of_constants_and_input_shapes_are_computed_once():
    x = torch.randn(2, 5, 8)
    gm, out, count = _folded(Rotary(), x)
    assert count >= 6
    assert _calls(gm) == ["mul", "mul", "add"], gm.code  # arange, outer, cat, cos, sin: folded
    assert torch.equal(gm(x), out)


class Written(nn.Module):
    """A constant mask written in place with an input (Llama's causal mask merged with padding)."""

    def forward(self, x, pad):
        mask = torch.full((x.shape[1], x.shape[1]), -1e9).triu(1).clone()
        mask.copy_(mask.masked_fill(pad == 0, -1e9))
        return x @ mask


def test_what_an_in_place_op_writes_stays_at_run_time():
    x, pad = torch.randn(2, 4, 4), torch.ones(4, 4)
    gm, out, _ = _folded(Written(), x, pad)
    assert {"full", "triu", "clone", "copy_"} <= set(_calls(gm)), gm.code
    other = torch.zeros(4, 4)
    assert torch.equal(gm(x, pad), out)
    assert torch.equal(gm(x, other), Written()(x, other)), "a folded mask would keep the first call's writes"
    assert torch.equal(gm(x, pad), out)


class Returned(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.arange(6.0), requires_grad=False)  # traced as get_attr (a buffer is not)

    def forward(self, x):
        return x + 1, self.table.view(2, 3), torch.rand(x.shape[0]), torch.nn.functional.dropout(self.table * 1, 0.5)


def test_returned_views_random_ops_and_shape_only_values_are_not_folded():
    gm, out, _ = _folded(Returned(), torch.randn(3))
    calls = _calls(gm)
    assert "view" in calls and "rand" in calls and "dropout" in calls, gm.code
    first = gm(torch.randn(3))[1]
    assert first.data_ptr() == gm.table.data_ptr()  # a view of the parameter itself, as eager returns
    assert not torch.equal(gm(torch.randn(3))[2], gm(torch.randn(3))[2])  # new random numbers per call


def test_a_converted_llama_like_programs_rotary_tables_are_constants_and_its_values_unchanged():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.models.families import FAMILIES, as_batch
    from tests.models.measure import positional

    family = FAMILIES["llama"]
    model, (args, kwargs) = family.make_model(), family.example_inputs()
    prepared = lucid_fx.prepare(model, example_inputs=positional(model, (args, kwargs)))
    lucid_fx.calibrate(prepared, [as_batch(b) for b in family.calibration_batches(4)], progress=False)
    q = lucid_fx.convert(prepared)
    portable = q(*args, **kwargs)
    program_out = q(*args, **kwargs)
    (program,) = programs_of(q).values()
    names = [n.target for n in program.graph.nodes if n.op == "get_attr"]
    assert any(name.startswith("_folded_") for name in names)
    assert not any(n.op == "call_function" and getattr(n.target, "__name__", "") == "arange" for n in program.graph.nodes)
    assert torch.equal(program_out["logits"] if isinstance(program_out, dict) else program_out,
                       portable["logits"] if isinstance(portable, dict) else portable)


def test_a_concrete_arguments_guard_is_kept_through_prepare_and_convert():
    torch.manual_seed(0)
    model, data = OptionalBias().eval(), [torch.randn(4, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (data[0],), data, progress=False, concrete_args={"bias": None})
    bias = torch.full((8,), 100.0)
    # The guard torch.fx writes was dropped as dead code: a bias was ignored, the output 100 off without a word.
    for call in (lambda: qmodel(data[0], bias), lambda: qmodel(data[0], bias=bias)):
        with pytest.raises(AssertionError, match="^bias has been specialized to have value None but got another value$"):
            call()
    assert (qmodel(data[0]) - model(data[0])).abs().max() < 0.05
