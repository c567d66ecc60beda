"""lucid_fx/rules/observers.py, the observer rule table (the observers themselves are
tests/quantization/test_observers.py): what decides an order-based choice, a mixture of experts'
router picking experts, is computed in float, unless a QConfig names it."""

import math
import sys
from pathlib import Path

import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.quantization import default_qconfig, get_default_qconfig_mapping
from lucid_fx.rules.observers import DecisionKind

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from mixture_of_experts import MixtureOfExperts  # noqa: E402

WHY = "decides a top-k/sort choice (a router picking experts): int8 rounding would flip which rows it picks"


def _sqnr(reference, test) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / (reference - test).pow(2).mean().item())


def _converted(model, mapping=None):
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(64, 64, generator=g) for _ in range(6)]
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return prepared, lucid_fx.convert(prepared)


def test_a_router_that_picks_experts_runs_in_float():
    torch.manual_seed(0)
    model = MixtureOfExperts(64).eval()
    prepared, qmodel = _converted(model)
    decisions = {n.name: n.meta[_meta.DECISION] for n in prepared.graph.nodes if _meta.DECISION in n.meta}
    assert decisions["router"].kind is DecisionKind.FLOAT and decisions["router"].reason == WHY
    assert decisions["softmax"].kind is DecisionKind.FLOAT  # its probabilities too: top-k reads them
    assert decisions["x"].kind is DecisionKind.STATISTICS  # the tokens also go to the experts: int8
    assert qmodel.lucid_fx_convert_report.float_ops["router"] == WHY
    # A QConfig that names the router and its softmax keeps them int8, and flips experts: 10 dB worse
    forced = get_default_qconfig_mapping().set_module_name("router", default_qconfig).set_object_type(torch.softmax, default_qconfig)
    _, int8_router = _converted(model, forced)
    assert "router" not in int8_router.lucid_fx_convert_report.float_ops
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fp32, kept, flipped = model(x), qmodel(x), int8_router(x)
    assert _sqnr(fp32, kept) > 22 and _sqnr(fp32, kept) > _sqnr(fp32, flipped) + 5  # 25.9 against 14.4 measured


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        logits = self.head(x)
        return logits, logits.argmax(-1)


def test_logits_that_are_also_returned_stay_int8():
    """Only a value whose every use ends in the choice: logits the model also returns are int8."""
    prepared = lucid_fx.prepare(Classifier().eval(), example_inputs=(torch.randn(4, 16),))
    head = next(n for n in prepared.graph.nodes if n.name == "head")
    assert head.meta[_meta.DECISION].kind is DecisionKind.STATISTICS


def test_a_long_chain_into_a_choice_is_found_in_one_pass():
    """3000 ops that lead only to a top-k: all of them, found without recursion (a recursive walk
    over users stopped at Python's recursion limit, ~1000 nodes deep)."""
    from torch import fx

    from lucid_fx.rules.choices import choice_only_nodes

    class Chain(nn.Module):
        def forward(self, x):
            for _ in range(3000):
                x = torch.relu(x)
            return torch.topk(x, 2).indices

    gm = fx.symbolic_trace(Chain())
    lucid_fx.passes.canonicalize_ops.canonicalize_ops(gm, lucid_fx.current_registry())
    relus = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.relu]
    found = choice_only_nodes(gm.graph)
    assert len(relus) == 3000 and all(relu in found for relu in relus)


class ConvThenNorm(nn.Module):
    """ConvNeXt's block head: a depthwise convolution, a permute to channels-last, LayerNorm, a linear;
    ``direct`` drops the permute (a norm over W), ``residual`` adds the input before the permute, and
    ``shared`` lets the convolution's output be read twice."""

    def __init__(self, direct=False, residual=False, shared=False):
        super().__init__()
        self.direct, self.residual, self.shared = direct, residual, shared
        self.conv = nn.Conv2d(16, 16, 7, padding=3, groups=16)
        self.norm = nn.LayerNorm(8 if direct else 16)
        self.fc = nn.Linear(8 if direct else 16, 32)

    def forward(self, x):
        y = self.conv(x)
        y = y + x if self.residual else y
        z = self.fc(self.norm(y if self.direct else y.permute(0, 2, 3, 1)))
        return z + y.sum() if self.shared else z


def _converted_images(model):
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(2, 16, 8, 8, generator=g) for _ in range(6)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches[:4], progress=False)
    return lucid_fx.convert(prepared), batches[4:]


def test_a_norm_that_reads_a_convolution_s_codes_through_a_permute_runs_int8():
    # The convolution's output is codes either way (convert gives a kernel's float result only to a
    # dequantize that reads it directly): the int8 norm reads the same codes in one pass.
    from lucid_fx.kernels import norms
    from lucid_fx.program import programs_of

    torch.manual_seed(0)
    model = ConvThenNorm().eval()
    qmodel, held_out = _converted_images(model)
    targets = [n.target for n in qmodel.graph.nodes if n.op == "call_function"]
    assert torch.ops.lucid_fx.layer_norm in targets and "norm" not in qmodel.lucid_fx_convert_report.float_ops
    x = held_out[0]
    portable, again = qmodel(x), qmodel(x)  # the portable graph, then the program, whose norm is the CPU kernel itself
    program = next(p for p in programs_of(qmodel).values() if p is not None)
    assert norms.cpu_layer_norm in [n.target for n in program.graph.nodes] and torch.equal(portable, again)
    with torch.no_grad():
        assert _sqnr(model(x), again) >= 30


def test_a_norm_that_reads_float_or_shared_values_stays_float():
    # Read directly, the convolution gives its float result; a residual sum and a value read twice
    # are not one kernel's codes: the norm keeps float input there (docs/convert.md#float-where-it-pays).
    for options in ({"direct": True}, {"residual": True}, {"shared": True}):
        torch.manual_seed(0)
        qmodel, _ = _converted_images(ConvThenNorm(**options).eval())
        targets = [n.target for n in qmodel.graph.nodes if n.op == "call_function"]
        assert torch.ops.lucid_fx.layer_norm not in targets, options
        assert "runs in float where it pays" in qmodel.lucid_fx_convert_report.float_ops["norm"], options


class AttentionThenFeedForward(nn.Module):
    """nn.MultiheadAttention inside a parent: its ``(output, weights)`` tuple is read by item."""

    def __init__(self, d=32):
        super().__init__()
        self.att, self.ff = nn.MultiheadAttention(d, 4, batch_first=True), nn.Linear(d, d)

    def forward(self, x):
        x = x + self.att(x, x, x, need_weights=False)[0]
        return self.ff(x)


def test_an_item_of_a_module_s_output_tuple_is_taken_as_the_module_gives_it():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 8, 32, generator=g) for _ in range(6)]
    torch.manual_seed(0)
    model = AttentionThenFeedForward().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    why = "item 0 of att's output: taken as att gives it, in float"
    assert report.float_ops["getitem"] == f"input of quantized add ({why})"  # was "no lowering rule for getitem"
    assert not [r for r in report.float_regions if r.kind == "op"], report.float_regions
    assert report.int8_flop_share == 1.0


class MaskedEmbedding(nn.Module):
    """DeBERTa's ``output * input_mask.to(output.dtype)``: an integer mask cast to float, then multiplied in."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.proj = nn.Embedding(50, 16), nn.Linear(16, 16)

    def forward(self, ids, mask):
        x = self.embed(ids)
        return self.proj(x * mask.unsqueeze(-1).to(x.dtype))


def test_a_cast_of_integers_to_float_runs_as_written_and_is_quantized_where_read():
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 50, (2, 6), generator=g), (torch.rand(2, 6, generator=g) > 0.3).long()) for _ in range(6)]
    torch.manual_seed(0)
    model = MaskedEmbedding().eval()
    prepared = lucid_fx.prepare(model, example_inputs=batches[0])
    cast = next(n for n in prepared.graph.nodes if n.target == "to")
    decision = cast.meta[_meta.DECISION]  # kept float, observed for the int8 mul that reads it
    assert decision.kind is DecisionKind.STATISTICS and decision.keep_float
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report
    why = "a cast of unsqueeze's int64 values to float: runs as written, quantized where an int8 op reads it"
    assert report.float_ops[cast.name] == f"input of quantized mul ({why})"  # was "no lowering rule for to"
    assert not [r for r in report.float_regions if r.kind == "op"], report.float_regions
    ids, mask = batches[0]
    with torch.no_grad():
        reference = model(ids, mask)
    assert 10 * torch.log10(reference.pow(2).mean() / (qmodel(ids, mask) - reference).pow(2).mean()) > 30


class FirstState(nn.Module):
    """A GRU whose first state is torch.zeros(x.shape[1], ...): a float tensor made from a size alone."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.rnn(x, torch.zeros(1, x.shape[1], 16))
        return self.fc(y[-1])


def test_a_tensor_made_from_no_float_input_is_kept_not_a_float_op():
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(5, 2, 8, generator=g) for _ in range(4)]
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(FirstState().eval(), example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    why = "a tensor made from no float input (sizes, numbers, masks): runs as written, quantized where an int8 op reads it"
    assert report.float_ops["zeros"] == why  # was "float op: zeros (no observer rule quantizes this op)"
    assert not [r for r in report.float_regions if r.kind == "op"], report.float_regions
    assert report.int8_flop_share == 1.0
