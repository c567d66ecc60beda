"""insert_observers: the observer calls and containers it adds, and the weight grid QAT trains on."""

import torch
from torch import nn

import lucid_fx.quantization as Q
from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.kernels import force_cpu_features, resolve_target
from lucid_fx.passes.analyze_ranges import analyze_ranges
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.choose_observers import choose_observers
from lucid_fx.passes.fuse_patterns import fuse_patterns
from lucid_fx.passes.insert_observers import insert_observers
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.trace_model import trace_model


def _decided(registry, model, mapping, x=None):
    x = torch.randn(2, 4) if x is None else x
    gm = trace_model(model).graph_module
    propagate_shapes(gm, (x,))
    for step in (canonicalize_ops, fuse_patterns, analyze_ranges):
        step(gm, registry)
    choose_observers(gm, registry, mapping)
    return gm, x


def test_observer_calls_follow_their_nodes_and_the_graph_computes_the_same(registry):
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh()).eval()
    gm, x = _decided(registry, model, Q.QConfigMapping().set_global(Q.minmax_qconfig))
    before = [n.name for n in gm.graph.nodes]
    expected = gm(x)
    insert_observers(gm)
    after = [n.name for n in gm.graph.nodes]
    assert before == ["input_1", "_0", "_1", "output"]
    assert after == ["input_1", "lucid_fx_observers_input_1", "_0", "lucid_fx_observers__0", "_1", "lucid_fx_observers__1", "output"]
    assert set(getattr(gm, OBSERVERS)) == {"input_1", "_0", "_1"} and set(getattr(gm, WEIGHT_OBSERVERS)) == {"0"}  # by module path
    assert type(getattr(gm, OBSERVERS)["_1"]).__name__ == "FixedQParamsObserver"  # tanh: a fixed [-1, 1] grid
    assert {n.name: n.meta.get(_meta.OBSERVER) for n in gm.graph.nodes if n.name in before} == {
        "input_1": "input_1", "_0": "_0", "_1": "_1", "output": None}
    assert torch.equal(gm(x), expected)  # observers watch, they do not change values


def test_qat_weights_are_fake_quantized_on_the_target_s_grid_for_each_layer(registry):
    # Without VNNI: [-64, 63] for the dense convolution and the linear, the full grid for the
    # depthwise convolution, whose kernels sum in 32 bits (Target.layer_weight_range).
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Conv2d(4, 4, 1), nn.Flatten(), nn.Linear(16, 3)).train()
    gm, _ = _decided(registry, model, Q.get_default_qat_qconfig_mapping(), torch.randn(2, 4, 4, 4))
    with force_cpu_features("avx2"):
        insert_observers(gm, qat=True, target=resolve_target("cpu"))
    grids = {key: (fake.quant_min, fake.quant_max) for key, fake in getattr(gm, WEIGHT_OBSERVERS).items()}
    assert all(isinstance(fake, Q.FakeQuantize) for fake in getattr(gm, WEIGHT_OBSERVERS).values())
    assert grids == {"0": (-128, 127), "1": (-64, 63), "3": (-64, 63)}
    assert isinstance(getattr(gm, OBSERVERS)["input_1"], Q.FakeQuantize)
