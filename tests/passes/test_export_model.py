"""export_model: torch.export capture -> a GraphModule of torch-level calls, called like the model."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.passes.export_model import ExportFailure, export_model, flat_inputs
from lucid_fx.passes.rewrite_aten import is_aten


class Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32) / 4)

    @torch.no_grad()  # as transformers' rotary embeddings: export wraps it in set_grad_enabled
    def forward(self, x):
        return torch.cos(x[..., :4] * self.inv_freq)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.rotary = Rotary()

    def forward(self, x, scale=None):
        y = self.norm(self.proj(x))
        if scale is not None:
            y = y * scale
        return {"out": y, "angle": self.rotary(x)}


def test_export_gives_torch_level_calls_called_like_the_model():
    model = Block().eval()
    x = torch.randn(2, 3, 8)
    gm = export_model(model, (x,), {"scale": torch.tensor(2.0)})
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert not any(is_aten(n.target) for n in calls)
    assert {F.layer_norm, torch.cos} <= {n.target for n in calls}
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["proj"]  # restore_modules: nn.Linear again
    assert not any("wrap" in str(n.target) for n in calls)  # the no_grad body is inlined
    assert [n.op for n in gm.graph.nodes][:2] == ["placeholder", "placeholder"]
    assert not gm.training
    out = gm(x, scale=torch.tensor(2.0))
    expected = model(x, scale=torch.tensor(2.0))
    assert isinstance(out, dict) and sorted(out) == ["angle", "out"]
    torch.testing.assert_close(out["out"], expected["out"])
    torch.testing.assert_close(out["angle"], expected["angle"])
    assert len(flat_inputs(gm, (x,), {"scale": torch.tensor(2.0)})) == 2


def test_module_paths_come_from_the_export_module_stack():
    gm = export_model(Block().eval(), (torch.randn(2, 3, 8),))
    paths = {n.target: n.meta[_meta.MODULE_PATH] for n in gm.graph.nodes if n.op in ("call_function", "call_module")}
    assert paths["proj"] == "proj" and paths[F.layer_norm] == "norm" and paths[torch.cos] == "rotary"
    weights = {n.target: n.meta[_meta.MODULE_PATH] for n in gm.graph.nodes if n.op == "get_attr"}
    assert weights["norm.weight"] == "norm"


def test_an_exported_program_and_its_module_are_taken_as_they_are():
    model = Block().eval()
    x = torch.randn(2, 3, 8)
    ep = torch.export.export(model, (x,))
    for given in (ep, ep.module()):
        gm = export_model(given)
        torch.testing.assert_close(gm(x)["out"], model(x)["out"])
        assert not any(is_aten(n.target) for n in gm.graph.nodes if n.op == "call_function")


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a value: torch.export cannot capture it
            return x * 2
        return x


def test_a_module_torch_export_cannot_capture_is_named():
    with pytest.raises(ExportFailure, match=r"torch.export cannot capture encoder.layer \(DataDependent\)"):
        export_model(DataDependent(), (torch.randn(2),), path="encoder.layer")


def test_a_program_exported_in_training_mode_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).train()
    with pytest.raises(ValueError, match=r"exported in training mode .*dropout.*call model.eval\(\) before torch.export"):
        export_model(model, (torch.randn(2, 4),))


def test_the_input_guard_is_removed():
    ep = torch.export.export(Block().eval(), (torch.randn(2, 3, 8),))
    assert any(n.target == "_guards_fn" for n in ep.module().graph.nodes)  # torch's input guard
    gm = export_model(ep)
    assert not any(n.target == "_guards_fn" for n in gm.graph.nodes) and not hasattr(gm, "_guards_fn")
    assert isinstance(gm, fx.GraphModule)
