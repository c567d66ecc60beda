"""quantize(..., precision="measured"): candidates tagged at prepare, regions grouped, each group
timed int8 against float and kept float only when at least as accurate and within the tie."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx import _meta, measured_precision
from lucid_fx.measured_precision import _groups, prefers_float
from lucid_fx.placement import Runs
from lucid_fx.quantization import default_qconfig, get_default_qconfig_mapping


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.qkv, self.proj, self.fc = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = torch.matmul(F.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1), v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc(F.gelu(x))


def _data(n: int = 6):
    torch.manual_seed(0)
    return [torch.randn(2, 8, 32) for _ in range(n)]


def _model(layers: int = 1):
    torch.manual_seed(0)
    return nn.Sequential(*[Attention() for _ in range(layers)]).eval()


def _tags(prepared):
    return {n.name: n.meta[_meta.MEASURED] for n in prepared.graph.nodes if _meta.MEASURED in n.meta}


@pytest.mark.parametrize(
    "int8_ms, float_ms, int8_db, float_db, tie, expected",
    [
        (10.0, 9.0, 40.0, 45.0, 0.03, True),  # faster and more accurate
        (10.0, 10.3, 40.0, 45.0, 0.03, True),  # more accurate and 3% slower: within the tie
        (10.0, 10.4, 40.0, 45.0, 0.03, False),  # more accurate but 4% slower
        (10.0, 10.3, 40.0, 45.0, 0.0, False),  # no tie
        (10.0, 9.0, 40.0, 39.8, 0.03, False),  # faster but less accurate
        (10.0, 9.0, 40.0, 39.95, 0.03, True),  # 10% faster, and as accurate within 0.1 dB
        (10.0, 9.8, 40.0, 40.0, 0.03, False),  # as accurate, 2% faster: within the tie, noise
        (10.0, 10.2, 40.0, 40.05, 0.03, False),  # as accurate within 0.1 dB, and slower: the tie is for accuracy only
        (10.0, 10.0, 40.0, 40.0, 0.03, False),  # equal on both: int8 stays
    ],
)
def test_the_rule_keeps_float_when_more_accurate_within_the_tie_or_as_accurate_and_faster_beyond_it(int8_ms, float_ms, int8_db, float_db, tie, expected):
    assert prefers_float(int8_ms, float_ms, int8_db, float_db, tie) is expected


def test_prepare_tags_the_attention_core_and_the_elementwise_tail_never_a_linear():
    model, data = _model(), _data()
    tags = _tags(lucid_fx.prepare(model, None, (data[0],)))
    assert tags == {"matmul": "attention", "mul": "elementwise", "softmax": "attention", "matmul_1": "attention",
                    "gelu": "elementwise"}


def test_a_qconfig_that_names_an_op_forces_it_int8_and_takes_it_out_of_the_choice():
    model, data = _model(), _data()
    mapping = get_default_qconfig_mapping().set_object_type(F.softmax, default_qconfig)
    tags = _tags(lucid_fx.prepare(model, mapping, (data[0],)))
    assert "softmax" not in tags and "matmul" in tags


def test_a_matmul_with_a_parameter_is_no_candidate():
    class WithParameter(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return torch.sigmoid(torch.matmul(x, self.w))

    tags = _tags(lucid_fx.prepare(WithParameter().eval(), None, (torch.randn(4, 8),)))
    assert tags == {"sigmoid": "elementwise"}


def test_like_regions_form_one_group_and_code_moves_between_candidates_join_their_region():
    model, data = _model(layers=2), _data()
    groups = _groups(lucid_fx.prepare(model, None, (data[0],)))
    # attention (matmul, scale, softmax, matmul): both layers in one group; the gelus in another
    assert [(ops, len(regions)) for ops, regions in groups] == [("matmul+mul+softmax+matmul", 2), ("gelu", 2)]
    assert groups[0][1][1] == ["matmul_2", "mul_1", "softmax_1", "matmul_3"]

    class MovedBetween(nn.Module):
        def forward(self, x):
            return torch.sigmoid(torch.tanh(x).transpose(0, 1))

    (ops, regions), = _groups(lucid_fx.prepare(MovedBetween().eval(), None, (torch.randn(4, 8),)))
    assert regions == [["tanh", "transpose", "sigmoid"]]


def _measured(monkeypatch, timings, **options):
    """quantize(precision="measured") with paired_ms answering ``timings`` in turn (the rule is what is
    under test here, not this machine's speed)."""
    answers = iter(timings)
    monkeypatch.setattr(measured_precision, "paired_ms", lambda first, second, batch: next(answers))
    data = _data()
    return lucid_fx.quantize(_model(), (data[0],), data[:4], precision="measured", held_out_data=data[4:], **options)


def test_a_group_measured_faster_in_float_runs_float_and_says_why(monkeypatch):
    qmodel = _measured(monkeypatch, [(2.0, 1.5), (1.5, 1.0)])
    report = qmodel.lucid_fx_precision
    assert [(c.ops, c.runs) for c in report.choices] == [("matmul+mul+softmax+matmul", "float"), ("gelu", "float")]
    assert report.float_nodes == ["matmul", "mul", "softmax", "matmul_1", "gelu"]
    assert (report.int8_ms, report.chosen_ms) == (1.5, 1.0)  # the pair of the round that chose the last float group
    first = report.choices[0]
    assert first.float_db >= first.int8_db - 0.1 and report.chosen_db == report.choices[1].float_db
    convert_report = qmodel.lucid_fx_convert_report
    for name in report.float_nodes:
        placement = convert_report.placements[name]
        assert placement.runs is Runs.FLOAT
        assert "1.5 against 2 ms a call" in placement.why or "1 against 1.5 ms a call" in placement.why
    assert "_0_qkv" in convert_report.lowered and "_0_fc" in convert_report.lowered
    with torch.no_grad():
        held_out = _data()[4:]
        reference = torch.cat([_model()(x) for x in held_out])
        got = torch.cat([qmodel(x) for x in held_out])
    noise = (reference - got).pow(2).mean()
    assert 10 * math.log10(reference.pow(2).mean() / noise) == pytest.approx(report.chosen_db, abs=0.05)


def test_a_group_measured_slower_in_float_stays_int8(monkeypatch):
    qmodel = _measured(monkeypatch, [(1.0, 1.2), (1.0, 1.031)])
    report = qmodel.lucid_fx_precision
    assert [c.runs for c in report.choices] == ["int8", "int8"] and report.float_nodes == []
    lowered = qmodel.lucid_fx_convert_report.lowered
    assert {"matmul", "softmax", "matmul_1", "gelu"} <= set(lowered)
    assert "int8: gelu x1" in str(report) and "float 1.03 ms" in str(report)


def test_groups_past_the_round_budget_stay_int8_and_say_so(monkeypatch):
    qmodel = _measured(monkeypatch, [(2.0, 1.0)], max_rounds=2)
    runs = [c.runs for c in qmodel.lucid_fx_precision.choices]
    assert runs == ["float", "int8 (not measured: past max_rounds)"]
    assert "gelu" in qmodel.lucid_fx_convert_report.lowered
    report = _measured(monkeypatch, [], max_rounds=1).lucid_fx_precision  # one round: the all-int8 model only
    assert [c.runs for c in report.choices] == ["int8 (not measured: past max_rounds)"] * 2
    assert str(report).splitlines()[0] == f"precision measured: 0 node(s) float; {report.int8_db:.1f} dB (all int8: {report.int8_db:.1f} dB; tie 3%)"


def test_on_this_machine_the_choice_follows_the_rule_on_what_was_measured():
    data = _data(8)
    qmodel = lucid_fx.quantize(_model(), (data[0],), data[:6], precision="measured", held_out_data=data[6:])
    report = qmodel.lucid_fx_precision
    assert len(report.choices) == 2
    for c in report.choices:
        assert all(math.isfinite(v) and v > 0 for v in (c.int8_ms, c.float_ms, c.int8_db, c.float_db))
        assert (c.runs == "float") is prefers_float(c.int8_ms, c.float_ms, c.int8_db, c.float_db, report.tie)
    floats = set(qmodel.lucid_fx_convert_report.float_ops)
    assert {n for c in report.choices if c.runs == "float" for n in c.nodes} <= floats


def test_bad_precision_options_are_named():
    data = _data()
    with pytest.raises(ValueError, match="precision must be 'int8' or 'measured', got 'fast'"):
        lucid_fx.quantize(_model(), (data[0],), data, precision="fast")
    with pytest.raises(ValueError, match="takes neither target_sqnr_db nor reference=True"):
        lucid_fx.quantize(_model(), (data[0],), data, precision="measured", target_sqnr_db=30)
    with pytest.raises(ValueError, match="precision='measured' needs held-out data"):
        lucid_fx.quantize(_model(), (data[0],), data[:1], precision="measured")
    with pytest.raises(ValueError, match="precision_tie must be a fraction >= 0"):
        lucid_fx.quantize(_model(), (data[0],), data, precision="measured", precision_tie=-0.1)


def test_explain_names_the_candidates_and_their_region_kind():
    data = _data()
    explanation = lucid_fx.explain(lucid_fx.prepare(_model(), None, (data[0],)))
    rows = explanation.by_node()
    assert (rows["softmax"]["measured"], rows["gelu"]["measured"], rows["_0_qkv"]["measured"]) == ("attention", "elementwise", "")
    line = next(line for line in str(explanation).splitlines() if line.startswith("softmax "))
    assert "[precision='measured' may run it float: attention region]" in line


class MaskedAttention(nn.Module):
    """BERT's attention core: the padding mask is added before the softmax (a fused masked softmax)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.matmul(q, k.transpose(-2, -1)) / 4.0 + (1.0 - mask[:, None, :]) * -10000.0
        return self.proj(torch.matmul(F.softmax(scores, dim=-1), v))


def test_a_masked_softmax_joins_its_region_and_runs_float_with_it(monkeypatch):
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    mask = torch.ones(2, 8)
    mask[1, 5:] = 0
    batches = [(torch.randn(2, 8, 32), mask) for _ in range(6)]
    prepared = lucid_fx.prepare(model, None, batches[0])
    (ops, regions), = _groups(prepared)
    assert ops == "matmul+div+softmax+matmul" and regions == [["matmul", "truediv", "softmax", "matmul_1"]]
    fused = {n.name: n.meta.get(_meta.FUSED_INTO) for n in prepared.graph.nodes}
    assert fused["softmax"] == "softmax" and list(fused.values()).count("softmax") == 2  # the mask's add and the softmax
    monkeypatch.setattr(measured_precision, "paired_ms", lambda first, second, batch: (2.0, 1.0))
    qmodel = lucid_fx.quantize(model, batches[0], batches[:4], precision="measured", held_out_data=batches[4:])
    report = qmodel.lucid_fx_precision
    assert report.choices[0].runs == "float"
    placements = qmodel.lucid_fx_convert_report.placements
    assert all(placements[name].runs is Runs.FLOAT for name in regions[0] if name in placements)
    assert "proj" in qmodel.lucid_fx_convert_report.lowered
    with torch.no_grad():
        reference = torch.cat([model(*b) for b in batches[4:]])
        got = torch.cat([qmodel(*b) for b in batches[4:]])
    measured = 10 * math.log10(reference.pow(2).mean() / (reference - got).pow(2).mean())
    assert measured == pytest.approx(report.chosen_db, abs=0.05) and measured > 30


def test_a_model_without_candidates_is_quantized_as_with_int8_and_says_so():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    data = [torch.randn(8, 16) for _ in range(6)]
    measured = lucid_fx.quantize(model, (data[0],), data[:4], precision="measured", held_out_data=data[4:])
    plain = lucid_fx.quantize(model, (data[0],), data[:4])
    assert str(measured.lucid_fx_precision) == "precision measured: no candidate regions, so every op runs as with precision='int8'"
    with torch.no_grad():
        assert torch.equal(measured(data[5]), plain(data[5]))


class Untraceable(nn.Module):
    """A top level torch.fx cannot trace (control flow on a value): prepared child by child."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Attention()

    def forward(self, x):
        if x.sum() > 1e9:
            return x
        return self.block(x)


def test_a_model_prepared_in_parts_names_its_nodes_by_module_path(monkeypatch):
    torch.manual_seed(0)
    model, data = Untraceable().eval(), _data()
    monkeypatch.setattr(measured_precision, "paired_ms", lambda first, second, batch: (2.0, 1.0))
    qmodel = lucid_fx.quantize(model, (data[0],), data[:4], precision="measured", held_out_data=data[4:], capture="fx")
    report = qmodel.lucid_fx_precision
    assert [(c.ops, c.runs) for c in report.choices] == [("matmul+mul+softmax+matmul", "float"), ("gelu", "float")]
    assert report.float_nodes == ["block.matmul", "block.mul", "block.softmax", "block.matmul_1", "block.gelu"]
    placements = qmodel.lucid_fx_convert_report.placements
    assert all(placements[name].runs is Runs.FLOAT for name in report.float_nodes)
    assert qmodel.lucid_fx_convert_report.lowered["block.qkv"] == "linear"


class KeywordAttention(nn.Module):
    """Called by keyword, with a default between its inputs (GPT-2's ``past_key_values``): torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Attention()

    def forward(self, x, cache=None, scale=None):
        return self.block(x) * scale


def test_keyword_batches_drive_the_search_and_compare(monkeypatch):
    torch.manual_seed(0)
    model = KeywordAttention().eval()
    batches = [{"x": torch.randn(2, 8, 32), "scale": torch.rand(2, 8, 32) + 0.5} for _ in range(6)]
    monkeypatch.setattr(measured_precision, "paired_ms", lambda first, second, batch: (2.0, 1.0) if "x" in batch else None)
    qmodel = lucid_fx.quantize(model, batches[0], batches[:4], precision="measured", held_out_data=batches[4:],
                               capture="export")
    report = qmodel.lucid_fx_precision
    choices = {c.ops: c for c in report.choices}
    assert list(choices) == ["matmul+mul+softmax+matmul", "gelu", "mul"]  # the last, the product with scale
    assert choices["gelu"].runs == choices["mul"].runs == "float"  # about 10 dB more accurate in float
    # The attention core measures within 0.1 dB int8 against float (34.6-34.9 dB each, by CPU kind): the
    # rule's verdict on the figures measured with these batches, whichever way they fall.
    core = choices["matmul+mul+softmax+matmul"]
    assert abs(core.float_db - core.int8_db) < 0.5
    float_wins = measured_precision.prefers_float(core.int8_ms, core.float_ms, core.int8_db, core.float_db, report.tie)
    assert core.runs == ("float" if float_wins else "int8")
    with torch.no_grad():
        reference = torch.cat([model(**b) for b in batches[4:]])
        got = torch.cat([qmodel(**b) for b in batches[4:]])
    measured = 10 * math.log10(reference.pow(2).mean() / (reference - got).pow(2).mean())
    assert measured == pytest.approx(report.chosen_db, abs=0.05) and measured > 30
    assert lucid_fx.compare(model, qmodel, batches[4:]).output_sqnr_db == pytest.approx(measured, abs=0.05)


def test_the_reason_says_which_half_of_the_rule_chose_float():
    faster = measured_precision.PrecisionChoice(["softmax"], "softmax", 1, int8_ms=2.0, float_ms=1.5, int8_db=40.0, float_db=40.05)
    accurate = measured_precision.PrecisionChoice(["gelu"], "gelu", 1, int8_ms=2.0, float_ms=2.04, int8_db=40.0, float_db=43.0)
    assert faster.why(0.03) == ("runs in float, measured as accurate and over 3% faster: 1.5 against 2 ms a call, "
                                "40.0 against 40.0 dB (precision='measured')")
    assert accurate.why(0.03).startswith("runs in float, measured more accurate and at most 3% slower: 2.04 against 2 ms")
