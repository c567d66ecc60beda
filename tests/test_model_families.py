"""The family models of tests/models reproduce the structure they are named for (checked on the
aten ops torch.export captures), run in float, and the measuring harness reads the convert report."""

import collections
import sys
from pathlib import Path

import pytest
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.models` under a bare `pytest` too
from tests.models.families import BASELINES, FAMILIES  # noqa: E402
from tests.models.export_ops import aten_ops
from tests.models.measure import concrete_args, positional, run_lucid

# The ops that make each family what it is: the ones issue 14 is about.
SIGNATURE_OPS = {
    "bert": {"aten.layer_norm.default", "aten.gelu.default", "aten.rsub.Scalar", "aten.embedding.default", "aten.softmax.int"},
    "gpt2": {"aten.addmm.default", "aten.tanh.default", "aten.pow.Tensor_Scalar", "aten.where.self", "aten.split.Tensor"},
    "llama": {"aten.rsqrt.default", "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.silu.default", "aten.to.dtype",
              "aten.cat.default", "aten.neg.default", "aten.triu.default", "aten.masked_fill.Scalar"},
    "vit": {"aten.conv2d.default", "aten.cat.default", "aten.layer_norm.default", "aten.gelu.default"},
    "efficientnet": {"aten.silu.default", "aten.sigmoid.default", "aten.batch_norm.default", "aten.add_.Tensor"},
    "convnext": {"aten.layer_norm.default", "aten.permute.default", "aten.gelu.default", "aten.add_.Tensor"},
    "densenet": {"aten.batch_norm.default", "aten.avg_pool2d.default", "aten.cat.default", "aten.relu_.default"},
    "shufflenet": {"aten.chunk.default", "aten.transpose.int", "aten.cat.default", "aten.mean.dim"},
    "mobilenet_v2": {"aten.conv2d.default", "aten.batch_norm.default", "aten.hardtanh_.default", "aten.add.Tensor",
                     "aten.adaptive_avg_pool2d.default"},
    "unet": {"aten.conv_transpose2d.input", "aten.upsample_nearest2d.vec", "aten.upsample_bilinear2d.vec", "aten.cat.default"},
    "cyclegan": {"aten.pad.default", "aten.instance_norm.default", "aten.conv_transpose2d.input", "aten.tanh.default"},
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_exports_with_its_signature_ops(name):
    family = FAMILIES[name]
    model = family.make_model()
    args, kwargs = family.example_inputs()
    with torch.no_grad():
        expected = model(*args, **kwargs)
    ep = torch.export.export(model, args, kwargs, strict=False)
    ops = aten_ops(ep.module())
    assert SIGNATURE_OPS[name] <= set(ops), sorted(SIGNATURE_OPS[name] - set(ops))
    out = ep.module()(*args, **kwargs)
    for a, b in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(out)):
        torch.testing.assert_close(a, b)


def test_stochastic_depth_stays_one_opaque_call_under_fx():
    """As with torchvision's fx-wrapped stochastic_depth: the traced graph calls it, not its body."""
    from tests.models._common import stochastic_depth

    gm = torch.fx.symbolic_trace(FAMILIES["convnext"].make_model())
    assert collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")[stochastic_depth] == 4


def test_families_and_baselines_give_fresh_batches_on_other_seeds():
    for family in {**FAMILIES, **BASELINES}.values():
        first, second = family.calibration_batches(2)
        leaves = lambda b: [t for t in torch.utils._pytree.tree_leaves(b) if t.is_floating_point() or t.dtype == torch.long]  # noqa: E731
        assert any(not torch.equal(a, b) for a, b in zip(leaves(first), leaves(second)))


def test_keyword_inputs_map_to_positional_slots_and_concrete_args():
    model = FAMILIES["gpt2"].make_model()
    inputs = FAMILIES["gpt2"].example_inputs()
    ids, mask = inputs[1]["input_ids"], inputs[1]["attention_mask"]
    assert positional(model, inputs) == (ids, None, mask)  # past_key_values sits between them
    assert concrete_args(model, inputs) == {"past_key_values": None, "token_type_ids": None, "position_ids": None,
                                            "use_cache": None, "return_dict": None}


def test_measure_a_fully_traced_family():
    result = run_lucid(FAMILIES["shufflenet"], use_concrete=False)
    assert result["traced"] and not result["float_modules"]
    assert result["flops"] + result["folded_flops"] == result["torch_flops"] > 0  # what torch's counter counts (folded apart)
    assert result["int8_flops"] == result["flops"]
    assert result["sqnr"] > 35.0
