"""A model written like a large library's (optional arguments, validation, dict outputs, a
ModuleList of layers) comes out partly quantized instead of failing."""

import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
import lucid_fx.quantization as Q


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / x.shape[-1] ** 0.5
        probs = F.softmax(scores + mask, dim=-1)
        return self.o(probs @ self.v(x))


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn, self.norm, self.ff = Attention(d), nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x, mask):
        return self.norm(x + torch.tanh(self.ff(self.attn(x, mask))))


class LibraryEncoder(nn.Module):
    """Argument handling in the style of large model libraries: proxies break it."""

    def __init__(self, vocab=50, d=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, 4)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, return_dict=None):
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("pass input_ids or inputs_embeds, not both")
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if attention_mask is None:
            attention_mask = torch.ones(hidden.shape[:2])
        mask = (1.0 - attention_mask[:, None, :]) * -1e4
        states = []
        for layer in self.layers:
            hidden = layer(hidden, mask)
            states.append(hidden)
        logits = self.head(hidden[:, 0])
        return {"logits": logits, "hidden_states": tuple(states)} if return_dict is not False else logits


def _ids():
    torch.manual_seed(0)
    return torch.randint(0, 50, (2, 7))


def test_library_model_is_partly_quantized_and_exact():
    # torch.fx alone (capture="auto" would export the top level: test_auto_exports_the_whole_model)
    model = LibraryEncoder().eval()
    ids = _ids()
    prepared = lucid_fx.prepare(model, example_inputs=(ids,), capture="fx")
    assert [u.path for u in prepared.lucid_fx_report.float_modules] == ["", "layers"]
    # the glue stays the user's Python; the layers inside are graphs with observers
    layer = prepared.layers[0]
    assert isinstance(layer, fx.GraphModule)
    assert isinstance(layer.lucid_fx_observers["softmax"], Q.FixedQParamsObserver)
    assert isinstance(layer.lucid_fx_observers["tanh"], Q.FixedQParamsObserver)
    assert isinstance(prepared.head, fx.GraphModule)
    lucid_fx.calibrate(prepared, [(_ids(),) for _ in range(2)], progress=False)
    out, ref = prepared(ids), model(ids)
    assert torch.equal(out["logits"], ref["logits"])
    rows = lucid_fx.explain(prepared).by_node()
    assert rows["layers.0.softmax"]["kind"] == "fixed"
    assert rows["layers.1.attn_q"]["kind"] == "statistics"


def test_concrete_args_trace_the_whole_model():
    model = LibraryEncoder().eval()
    ids = _ids()
    prepared = lucid_fx.prepare(
        model,
        example_inputs=(ids,),
        concrete_args={"attention_mask": None, "inputs_embeds": None, "return_dict": None},
    )
    assert isinstance(prepared, fx.GraphModule)
    assert prepared.lucid_fx_report.float_modules == []
    rows = lucid_fx.explain(prepared).by_node()
    assert rows["input_ids"]["kind"] == "none"  # token ids stay integers
    assert rows["layers_0_attn_q"]["kind"] == "statistics"
    softmax_rows = [r for r in rows.values() if r["op"] == "softmax"]
    assert len(softmax_rows) == 2 and all(r["kind"] == "fixed" for r in softmax_rows)
    assert torch.equal(prepared(ids)["logits"], model(ids)["logits"])


def test_example_inputs_do_not_reach_the_observers():
    model = LibraryEncoder().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(_ids(),), capture="fx")
    # shapes reached the layers inside the ModuleList (captured from one float run) ...
    node = next(n for n in prepared.layers[1].graph.nodes if n.name == "softmax")
    assert tuple(node.meta["tensor_meta"].shape) == (2, 7, 7)
    # ... but no observer was fed by that run: nothing has been calibrated yet
    assert not prepared.head.lucid_fx_observers["linear"].has_data
    assert not prepared.layers[0].lucid_fx_observers["attn_q"].has_data


def test_auto_exports_the_whole_model_fx_cannot_trace():
    model = LibraryEncoder().eval()
    ids = _ids()
    prepared = lucid_fx.prepare(model, example_inputs=(ids,))
    assert prepared.lucid_fx_report.captures == {"": "export"} and prepared.lucid_fx_report.float_modules == []
    assert isinstance(prepared, fx.GraphModule)
    rows = lucid_fx.explain(prepared).by_node()
    softmax_rows = [r for r in rows.values() if r["op"] == "softmax"]
    assert len(softmax_rows) == 2 and all(r["kind"] == "fixed" for r in softmax_rows)
    assert torch.equal(prepared(ids)["logits"], model(ids)["logits"])
