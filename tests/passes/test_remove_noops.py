"""remove_noops: no-op casts, eval-mode dropout and stochastic depth, identity and contiguous() of a
contiguous tensor leave the graph before observers are chosen; real changes stay."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.remove_noops import remove_noops
from lucid_fx.passes.trace_model import trace_model
from tests.models._common import StochasticDepth, stochastic_depth

torch.fx.wrap("stochastic_depth")  # as torchvision wraps it: one opaque call in the graph of this file's models


class Wrap(nn.Module):
    """fc -> ``body`` -> relu, so each no-op sits between two quantized ops."""

    def __init__(self, body):
        super().__init__()
        self.fc, self.body, self.extra = nn.Linear(8, 8), body, nn.ModuleDict({"drop": nn.Dropout(0.3), "id": nn.Identity(),
                                                                           "sd": StochasticDepth(0.2, "row")})

    def forward(self, x):
        return F.relu(self.body(self, self.fc(x)))


def _removed(body, x=None):
    """The node names of the traced graph before and after remove_noops, and what it recorded."""
    model = Wrap(body).eval()
    x = torch.randn(4, 8) if x is None else x
    gm = propagate_shapes(trace_model(model).graph_module, (x,))
    gm = canonicalize_ops(gm, lucid_fx.current_registry())
    before = [n.name for n in gm.graph.nodes]
    expected = model(x)
    gm = remove_noops(gm)
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)  # the graph computes what the model does
    return before, [n.name for n in gm.graph.nodes], gm.meta[_meta.REMOVED]


CASES = {
    "to_own_dtype": (lambda self, y: y.to(y.dtype), "to", "cast to float32"),
    "to_float32": (lambda self, y: y.to(torch.float32), "to", "cast to float32"),
    "float": (lambda self, y: y.float(), "float_1", "cast to float32"),
    "type_as": (lambda self, y: y.type_as(y), "type_as", "cast to float32"),
    "contiguous": (lambda self, y: y.contiguous(), "contiguous", "contiguous() of a contiguous"),
    "F.dropout_eval": (lambda self, y: F.dropout(y, 0.5, training=False), "dropout", "dropout in eval mode"),
    "nn.Dropout": (lambda self, y: self.extra["drop"](y), "extra_drop", "dropout in eval mode"),
    "nn.Identity": (lambda self, y: self.extra["id"](y), "extra_id", "nn.Identity"),
    "stochastic_depth_fn": (lambda self, y: stochastic_depth(y, 0.2, "row", False), "stochastic_depth", "stochastic depth"),
    "StochasticDepth": (lambda self, y: self.extra["sd"](y), "stochastic_depth", "stochastic depth"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kind_of_noop_is_removed(case):
    body, name, reason = CASES[case]
    before, after, removed = _removed(body)
    assert name in before and name not in after
    assert removed[name].startswith(reason)
    assert [n for n in after if n not in ("x", "fc", "relu", "output")] == [n for n in after if n.startswith("getattr")] == []


def test_real_changes_stay():
    # a real cast there and back (float64, then .float() of a float64)
    _, after, removed = _removed(lambda self, y: y.to(torch.float64).sum(-1).float())
    assert {"to", "float_1"} <= set(after) and removed == {}
    # the copy a later view needs
    _, after, removed = _removed(lambda self, y: y.t().contiguous().view(-1).view(4, 8))
    assert "contiguous" in after and removed == {}
    # dropout with p=0 is a no-op even in training
    _, after, removed = _removed(lambda self, y: F.dropout(y, 0.0, training=True))
    assert "dropout" not in after and removed == {"dropout": "dropout in eval mode (or p=0) returns its input"}


def test_training_dropout_stays():
    model = Wrap(lambda self, y: F.dropout(y, 0.5, training=True)).eval()
    gm = canonicalize_ops(trace_model(model).graph_module, lucid_fx.current_registry())
    assert "dropout" in [n.name for n in remove_noops(gm).graph.nodes] and gm.meta[_meta.REMOVED] == {}


def test_prepare_observes_nothing_for_a_removed_node():
    model = Wrap(lambda self, y: self.extra["drop"](self.extra["sd"](y.float()))).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(4, 8),))
    assert set(prepared.lucid_fx_observers.keys()) == {"x", "relu"}  # fc+relu is one group
    prepared(torch.randn(4, 8))
    converted = lucid_fx.convert(prepared)
    assert converted.lucid_fx_convert_report.float_ops == {}


class ToDevice(nn.Module):
    """Mistral's rotary path: a buffer cast to the input's device (aten.to.device under torch.export)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return F.relu(self.fc(x) * self.scale.to(x.device, torch.float32))


def test_a_cast_to_the_device_torch_export_recorded_is_removed():
    x = torch.randn(4, 8)
    prepared = lucid_fx.prepare(ToDevice().eval(), example_inputs=(x,), capture="export")
    removed = prepared.meta[_meta.REMOVED]
    assert list(removed.values()) == ["cast to float32, which it already is"], removed
    assert not any(n.target in ("to", torch.ops.aten.to.device) for n in prepared.graph.nodes)
    prepared(x)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    assert [r.why for r in report.float_regions if r.kind == "op" and "no lowering rule" in r.why] == []


def test_a_cast_to_a_device_stays_where_no_device_was_recorded():
    # torch.fx records no device: x.to("cpu") may move a tensor, so it stays
    _, after, removed = _removed(lambda self, y: y.to("cpu"))
    assert "to" in after and removed == {}
