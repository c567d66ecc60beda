"""prepare's capture: torch.fx, torch.export, or "auto" (fx, then export where fx fails); an
ExportedProgram as input; the report saying which capture was used where; the transformers
families end to end."""

import io
import math
import warnings
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx.passes.export_model import ExportFailure

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.models` under a bare `pytest` too
from tests.models.families import FAMILIES  # noqa: E402
from tests.models.measure import model_flops  # noqa: E402
from tests.models.measure import _data, _sqnr_on  # noqa: E402


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).mean().item() / (reference - test).pow(2).mean().item())


class TinyEncoder(nn.Module):
    """A transformer encoder block called the transformers way (keywords, a padding mask) whose
    top level torch.fx cannot trace (a branch on an input's shape)."""

    def __init__(self, vocab=64, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        if input_ids.shape[1] > 128:  # fx: a Proxy's bool; export: a shape it knows
            raise ValueError("sequence too long")
        x = self.embed(input_ids)
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        mask = (1.0 - attention_mask[:, None, None, :].float()) * -1e4
        scores = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(d // self.heads) + mask
        attn = (scores.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(b, s, d)
        x = self.norm1(x + self.o(attn))
        x = self.norm2(x + self.down(F.gelu(self.up(x), approximate="tanh")))
        return {"last_hidden_state": x}


def tokens(seed, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def quantize(model, **options):
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(model, **options)
    lucid_fx.calibrate(prepared, [tokens(100 + i) for i in range(8)], progress=False)
    return prepared, lucid_fx.convert(prepared)


def held_out_sqnr(model, qmodel) -> float:
    with torch.no_grad():
        ref = torch.cat([model(**tokens(200 + i))["last_hidden_state"] for i in range(3)])
        out = torch.cat([qmodel(**tokens(200 + i))["last_hidden_state"] for i in range(3)])
    return sqnr(ref, out)


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return TinyEncoder().eval()


@pytest.fixture(scope="module")
def auto_quantized(encoder):
    return quantize(encoder, example_inputs=tokens(0))  # a dict: keyword inputs


def test_auto_captures_with_export_where_fx_fails_and_says_so(encoder, auto_quantized):
    prepared, qmodel = auto_quantized
    report = prepared.lucid_fx_report
    assert report.captures == {"": "export"} and report.float_modules == []
    assert "<root> -> export" in str(report)
    assert held_out_sqnr(encoder, qmodel) >= 25.0
    lowered = qmodel.lucid_fx_convert_report.lowered
    assert sum(1 for key in lowered.values() if key.startswith("linear")) >= 6, lowered


def test_fx_capture_keeps_the_root_float_and_names_why(encoder):
    prepared = lucid_fx.prepare(encoder, example_kwargs=tokens(0), capture="fx")
    captures = prepared.lucid_fx_report.captures
    assert captures[""].startswith("float (torch.fx: TraceError")
    assert captures["q"] == "fx" and not isinstance(prepared, fx.GraphModule)


def test_export_and_fx_captures_give_the_same_int8_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8), nn.Softmax(-1)).eval()
    data = [torch.randn(4, 16) for _ in range(4)]
    outs = {}
    for capture in ("fx", "export"):
        prepared = lucid_fx.prepare(model, example_inputs=(data[0],), capture=capture)
        assert prepared.lucid_fx_report.captures == {"": capture}
        lucid_fx.calibrate(prepared, data, progress=False)
        outs[capture] = lucid_fx.convert(prepared)(data[1])
    assert sqnr(model(data[1]), outs["export"]) >= 25.0
    torch.testing.assert_close(outs["export"], outs["fx"])  # the same rules fired: the same codes


def test_export_folds_batch_norm_into_the_conv_as_fx_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    model[1].running_mean.uniform_(-0.5, 0.5)
    model[1].running_var.uniform_(0.5, 2.0)
    data = [torch.randn(2, 3, 10, 10) for _ in range(4)]
    outs = {}
    for capture in ("fx", "export"):
        prepared = lucid_fx.prepare(model, example_inputs=(data[0],), capture=capture)
        lucid_fx.calibrate(prepared, data, progress=False)
        qmodel = lucid_fx.convert(prepared)
        assert sorted(qmodel.lucid_fx_convert_report.lowered.values()) == ["conv2d", "conv2d+relu"]  # the batch norm folded
        outs[capture] = qmodel(data[1])
    assert sqnr(model(data[1]), outs["export"]) >= 25.0
    torch.testing.assert_close(outs["export"], outs["fx"])


def test_an_exported_program_is_prepared_and_left_unchanged(encoder):
    ep = torch.export.export(encoder, (), tokens(0), strict=False)
    nodes_before = len(ep.graph.nodes)
    prepared, qmodel = quantize(ep)  # its own example inputs
    assert prepared.lucid_fx_report.captures == {"": "export"}
    assert held_out_sqnr(encoder, qmodel) >= 25.0
    assert len(ep.graph.nodes) == nodes_before
    torch.testing.assert_close(ep.module()(**tokens(1))["last_hidden_state"], encoder(**tokens(1))["last_hidden_state"])
    prepared, qmodel = quantize(ep.module(), example_kwargs=tokens(0))  # and its .module(), marked training
    assert held_out_sqnr(encoder, qmodel) >= 25.0


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # neither fx nor export can capture a branch on a value
            return self.lin(x)
        return self.lin(-x)


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale=None):
        if x.shape[0] > 1:  # fx cannot trace it; export can
            x = x * 2
        return self.lin(x) if scale is None else self.lin(x) * scale


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.shape, self.data = nn.Linear(8, 8), ShapeBranch(), DataDependent()

    def forward(self, x):
        return self.data(self.shape(self.first(x), scale=2.0))


def test_auto_exports_each_child_fx_cannot_trace_and_names_the_one_neither_captures():
    model = Parent().eval()
    x = torch.randn(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    captures = prepared.lucid_fx_report.captures
    assert captures[""] == "fx" and captures["shape"] == "export"
    assert captures["data"].startswith("float (torch.fx: TraceError")
    assert "torch.export cannot capture data (DataDependent)" in captures["data"]
    assert isinstance(prepared.shape, fx.GraphModule) and captures["data.lin"] == "fx"
    lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(4)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    assert sqnr(model(x), qmodel(x)) >= 25.0


class TorchEncoder(nn.Module):
    """torch's own transformer modules, as a user writes them: nn.TransformerEncoder (its layers' fast path
    branches on the input), and nn.MultiheadAttention called with a padding mask."""

    def __init__(self, dim=32):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.attn, self.head = nn.MultiheadAttention(dim, 4, batch_first=True), nn.Linear(dim, 3)

    def forward(self, x, padding):
        h = self.encoder(x, src_key_padding_mask=padding)
        a, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=False)
        return self.head(a + h)


def _torch_encoder_batch(seed):
    g = torch.Generator().manual_seed(seed)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 9:] = True
    return torch.randn(2, 12, 32, generator=g), padding


def test_torch_transformer_modules_are_traced_through_and_run_in_int8():
    torch.manual_seed(0)
    model = TorchEncoder().eval()
    prepared = lucid_fx.prepare(model, example_inputs=_torch_encoder_batch(0))
    assert prepared.lucid_fx_report.captures == {"": "fx", "encoder": "export", "attn": "export"}
    lucid_fx.calibrate(prepared, [_torch_encoder_batch(s) for s in range(8)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report
    assert report.int8_flop_share == 1.0 and "float leaf module" not in str(report)
    # 2 layers x (4 projections, 2 feed-forward linears, 2 attention matmuls), the second attention's 6, the head
    assert str(report).startswith("backend cpu: ") and int(str(report).split()[2]) >= 23
    with torch.no_grad():
        for seed in (100, 101):
            x, padding = _torch_encoder_batch(seed)
            assert sqnr(model(x, padding), qmodel(x, padding)) >= 30.0


class TorchDecoder(nn.Module):
    """nn.TransformerDecoder: causal self-attention, then cross-attention on a memory, whose query and
    key/value projections are pieces of one parameter (in_proj_weight split into rows)."""

    def __init__(self, dim=32):
        super().__init__()
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True), 1)

    def forward(self, tgt, memory):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.decoder(tgt, memory, tgt_mask=causal, tgt_is_causal=True)


def test_cross_attention_s_projections_cut_from_one_parameter_run_in_int8():
    torch.manual_seed(0)
    model = TorchDecoder().eval()
    batch = lambda seed: (torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(seed)),  # noqa: E731
                          torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(seed + 50)))
    prepared = lucid_fx.prepare(model, example_inputs=batch(0))
    lucid_fx.calibrate(prepared, [batch(s) for s in range(8)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report
    # the pieces of in_proj_weight were float linears ("lowering declined", 13% of FLOPs), their cuts float ops
    assert report.int8_flop_share == 1.0 and "getitem" not in str(report), str(report)
    with torch.no_grad():
        assert sqnr(model(*batch(100)), qmodel(*batch(100))) >= 30.0


def test_torch_transformer_modules_stay_float_leaves_under_fx_capture_or_when_asked():
    model, batch = TorchEncoder().eval(), _torch_encoder_batch(0)
    cases = [({"capture": "fx"}, "float module: {} ({}) at "),  # fx cannot trace them: named with the trace error
             ({"leaf_modules": [nn.TransformerEncoder, nn.MultiheadAttention]}, "float leaf module: {} (no lowering rule")]
    for options, line in cases:
        prepared = lucid_fx.prepare(model, example_inputs=batch, **options)
        lucid_fx.calibrate(prepared, [batch], progress=False)
        report = lucid_fx.convert(prepared).lucid_fx_convert_report
        for name, cls in (("encoder", "TransformerEncoder"), ("attn", "MultiheadAttention")):
            assert line.format(name, cls) in str(report), str(report)
        # their FLOPs are counted (the attention's fused fast path is off while prepare counts): the head alone is int8
        flops = {r.name: r.flops for r in report.float_regions}
        assert flops["attn"] == 2 * 2 * 12 * 32 * 32 * 4 + 2 * 2 * (2 * 12 * 12 * 32), flops  # 4 projections, 2 matmuls
        assert report.int8_flop_share < 0.01, str(report)


def test_forced_export_that_fails_names_the_module():
    with pytest.raises(ExportFailure, match=r"torch.export cannot capture <root> \(DataDependent\)"):
        lucid_fx.prepare(DataDependent().eval(), example_inputs=(torch.randn(2, 8),), capture="export")


def test_capture_values_are_checked():
    with pytest.raises(ValueError, match=r"capture='torchscript'; use one of 'auto', 'fx', 'export'"):
        lucid_fx.prepare(nn.Linear(2, 2).eval(), example_inputs=(torch.randn(1, 2),), capture="torchscript")


def test_an_exported_int8_model_saves_and_loads_with_its_call_structure(encoder, auto_quantized):
    _, qmodel = auto_quantized
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    out = loaded(**tokens(5))
    assert isinstance(out, dict) and list(out) == ["last_hidden_state"]
    torch.testing.assert_close(out["last_hidden_state"], qmodel(**tokens(5))["last_hidden_state"])
    positional = loaded(tokens(5)["input_ids"], tokens(5)["attention_mask"])  # by position too
    torch.testing.assert_close(positional["last_hidden_state"], out["last_hidden_state"])


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_transformers_families_convert_through_auto(name):
    family = FAMILIES[name]
    model = family.make_model()
    args, kwargs = family.example_inputs()
    prepared = lucid_fx.prepare(model, example_inputs=tuple(args), example_kwargs=dict(kwargs))
    report = prepared.lucid_fx_report
    assert report.captures == {"": "export"} and report.float_modules == []  # llama's root and layers included
    batches, held_out = _data(family)
    lucid_fx.calibrate(prepared, [b[1] or b[0] for b in batches], progress=False)
    qmodel = lucid_fx.convert(prepared)
    assert _sqnr_on(model, qmodel, held_out) >= 25.0
    convert_report = qmodel.lucid_fx_convert_report
    assert convert_report.int8_flop_share >= 0.95 and not convert_report.float_modules
    # the report's FLOPs, counted on the exported graph, are torch's own count of the float model
    assert convert_report.total_flops == pytest.approx(model_flops(model, *family.example_inputs()), rel=0.01)


def test_compare_measures_an_exported_model_node_by_node(encoder, auto_quantized):
    _, qmodel = auto_quantized
    batches = [(tokens(300 + i)["input_ids"], tokens(300 + i)["attention_mask"]) for i in range(2)]
    result = lucid_fx.compare(encoder, qmodel, batches)  # the float model is exported the way prepare did
    assert result.output_sqnr_db >= 25.0
    # a linear fused with its gelu is measured at the gelu
    linears = [row for row in result.rows if row.op in ("linear", "gelu")]
    assert len(linears) >= 6 and all(row.domain == "int8" and row.sqnr_db > 20 for row in linears), linears


def _records_with(data, key):
    if isinstance(data, dict):
        if key in data:
            yield data
        for value in data.values():
            yield from _records_with(value, key)
    elif isinstance(data, list):
        for value in data:
            yield from _records_with(value, key)


def test_load_refuses_a_pytree_spec_that_does_not_fit_the_graph(auto_quantized):
    _, qmodel = auto_quantized
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    data = torch.load(buffer, weights_only=True)
    graph = next(_records_with(data, "pytree"))
    import torch.utils._pytree as pytree

    graph["pytree"][0] = pytree.treespec_dumps(pytree.tree_structure(((), {"input_ids": 0})))  # one input, not two
    tampered = io.BytesIO()
    torch.save(data, tampered)
    tampered.seek(0)
    with pytest.raises(ValueError, match=r"the pytree spec does not fit the graph \(1 inputs for 2 placeholders"):
        lucid_fx.load(tampered)
    graph["pytree"][0] = '[1, {"type": "os.system", "context": "null", "children_spec": []}]'  # a name, never imported
    tampered = io.BytesIO()
    torch.save(data, tampered)
    tampered.seek(0)
    with pytest.raises(ValueError, match=r"unreadable pytree spec"):
        lucid_fx.load(tampered)


def test_an_exported_model_prepares_and_converts_without_a_warning():
    # torch 2.13 warns about its own pytree internals when torch.export's call specs are deep-copied
    # (convert copies the prepared model): nothing a user can act on, so convert does not show it.
    torch.manual_seed(0)
    model = TinyEncoder().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared, qmodel = quantize(model, example_inputs=tokens(0))
    assert prepared.lucid_fx_report.captures[""] == "export"
    assert held_out_sqnr(model, qmodel) >= 25


class TwoInputs(nn.Module):
    """A model torch.fx traces whose forward takes two inputs and a keyword with a default."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, y, scale=2.0):
        return self.fc(x) * scale + y


def _two_inputs():
    torch.manual_seed(0)
    batches = [{"x": torch.randn(4, 8), "y": torch.randn(4, 4)} for _ in range(4)]
    return TwoInputs().eval(), batches


@pytest.mark.parametrize("how", ["dict", "kwargs", "mixed"])
def test_keyword_example_inputs_bind_to_a_traced_forwards_parameters(how):
    model, batches = _two_inputs()
    first = batches[0]
    given = {"dict": {"example_inputs": first}, "kwargs": {"example_kwargs": first},
             "mixed": {"example_inputs": (first["x"],), "example_kwargs": {"y": first["y"]}}}[how]
    prepared = lucid_fx.prepare(model, **given)
    assert prepared.lucid_fx_report.captures == {"": "fx"}
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    # The shapes were recorded on the keyword inputs: the linear's FLOPs are counted (none were before).
    assert "int8 FLOPs: 100.0% of 256 FLOP" in str(qmodel.lucid_fx_convert_report)
    for batch in batches:
        assert sqnr(model(**batch), qmodel(**batch)) > 35
    assert torch.equal(qmodel(**first), qmodel(first["x"], first["y"]))


def test_keyword_example_inputs_that_do_not_fit_forward_name_the_parameter():
    model, batches = _two_inputs()
    x, y = batches[0]["x"], batches[0]["y"]
    cases = [({"example_inputs": {"x": x}}, "TwoInputs.forward(x, y, scale) needs 'y', which the example inputs do not give"),
             ({"example_inputs": {"x": x, "y": y, "z": y}}, "has no parameter 'z' (keyword inputs: x, y, z)"),
             ({"example_inputs": (x,), "example_kwargs": {"x": x, "y": y}}, "got 'x' by position and by name")]
    for given, message in cases:
        with pytest.raises(TypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            lucid_fx.prepare(model, **given)


class DataBranch(nn.Module):
    """A branch on a value: torch.fx cannot trace the root, torch.export cannot capture it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def test_a_capture_that_fails_prints_nothing_and_the_report_says_why(capsys):
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(DataBranch().eval(), example_inputs=(torch.randn(4, 16),))
    out, err = capsys.readouterr()
    # torch.export logged a warning and printed the partial graph to stderr twice (27 lines each time)
    assert (out, err) == ("", "")
    captured = prepared.lucid_fx_report.captures
    assert captured[""].startswith("float (torch.fx: TraceError: symbolically traced variables cannot be used as inputs "
                                   "to control flow; torch.export cannot capture <root> (DataBranch): "
                                   "GuardOnDataDependentSymNode")
    assert (captured["a"], captured["b"]) == ("fx", "fx")
