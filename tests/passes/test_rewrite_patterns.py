"""rewrite_patterns: an RMSNorm written out op by op (Llama's, casts and all) becomes one
``F.rms_norm`` node, named as the node it replaces, computing the same values; near misses stay."""

import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.node_refs import canonical
from lucid_fx.pipeline import PREPARE_PASSES, pass_name
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.remove_noops import remove_noops
from lucid_fx.passes.rewrite_patterns import rewrite_patterns
from lucid_fx.passes.trace_model import trace_model


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, as written there."""

    def __init__(self, hidden_size, eps=1e-6, weighted=True, dim=-1):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(hidden_size) + 0.5) if weighted else None
        self.variance_epsilon, self.dim = eps, dim

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(self.dim, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        out = hidden_states.to(input_dtype)
        return self.weight * out if self.weight is not None else out


def _rewritten(norm, x):
    gm = propagate_shapes(trace_model(norm.eval()).graph_module, (x,))
    gm = rewrite_patterns(remove_noops(canonicalize_ops(gm, lucid_fx.current_registry())))
    torch.testing.assert_close(gm(x), norm(x), rtol=1e-6, atol=1e-6)
    return [(n.name, canonical(n).op if n.op == "call_function" else n.op) for n in gm.graph.nodes], gm


def test_llama_rms_norm_is_one_op():
    x = torch.randn(2, 5, 16)
    nodes, gm = _rewritten(LlamaRMSNorm(16), x)
    assert nodes == [("hidden_states", "placeholder"), ("weight", "get_attr"), ("mul_1", "rms_norm"), ("output", "output")]
    node = next(n for n in gm.graph.nodes if n.name == "mul_1")
    assert node.target is torch.nn.functional.rms_norm and node.args[1:] == ((16,), node.args[2], 1e-6)
    assert node.meta[_meta.TENSOR_META].shape == x.shape


def test_without_weight():
    nodes, _ = _rewritten(LlamaRMSNorm(16, weighted=False), torch.randn(3, 16))
    assert [op for _, op in nodes] == ["placeholder", "rms_norm", "output"]


def test_a_mean_over_another_dim_is_not_an_rms_norm():
    nodes, _ = _rewritten(LlamaRMSNorm(16, dim=0), torch.randn(16, 16))
    assert "rms_norm" not in [op for _, op in nodes] and "rsqrt" in [op for _, op in nodes]


def test_in_the_prepare_pipeline_after_removal():
    names = [pass_name(p) for p in PREPARE_PASSES]
    assert names.index("canonicalize_ops") < names.index("remove_noops") < names.index("rewrite_patterns") < names.index("fuse_patterns")


class ClipHead(nn.Module):
    """CLIP's features, normalised by hand, and near misses: an L1 norm, a norm without keepdim (broadcast over rows)."""

    def __init__(self):
        super().__init__()
        self.img, self.txt = nn.Linear(16, 8), nn.Linear(12, 8)

    def forward(self, a, b):
        i, t = self.img(a), self.txt(b)
        i = i / i.norm(dim=1, keepdim=True)
        t = t / torch.norm(t, dim=-1, keepdim=True)
        return 10.0 * i @ t.t(), i / i.norm(p=1, dim=1, keepdim=True), t / t.norm()


def test_a_hand_written_l2_normalisation_is_f_normalize():
    torch.manual_seed(0)
    model = ClipHead().eval()
    inputs = (torch.randn(4, 16), torch.randn(5, 12))
    prepared = lucid_fx.prepare(model, example_inputs=inputs)
    ops = {n.name: canonical(n) for n in prepared.graph.nodes if _meta.OP in n.meta}
    assert [(ops[n].op, ops[n].args["dim"]) for n in ("truediv", "truediv_1")] == [("normalize", 1), ("normalize", -1)]
    assert [ops[n].op for n in ("truediv_2", "truediv_3")] == ["div", "div"]  # p=1; a norm of everything
    with torch.no_grad():
        for got, want in zip(prepared(*inputs), model(*inputs)):
            assert torch.allclose(got, want, atol=1e-6)
    lucid_fx.calibrate(prepared, [inputs], progress=False)
    floats = lucid_fx.convert(prepared).lucid_fx_convert_report.float_ops
    assert "normalize runs in float where it pays" in floats["truediv"]  # was "no lowering rule for norm", then a declined div
