"""compare's hints (lucid_fx/_compare_hints.py): layer outputs whose channels spread too wide for one int8 grid,
and the transform that rebalances them."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx._compare_hints import HINT_BELOW_DB, SPREAD_HINT, channel_ranges
from lucid_fx.placement import Placement, Runs


def _depthwise_pair(amplify: bool) -> nn.Module:
    """conv, batch norm, ReLU, a depthwise conv whose channels' gains span three decades, ReLU, a 1x1 conv
    (docs/accuracy.md's example); ``amplify``: the 1x1 conv reads each channel in inverse proportion, so the small
    channels matter to the output as much as the large ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    with torch.no_grad():
        model[3].weight.mul_(torch.logspace(-2, 1, 8).reshape(8, 1, 1, 1))
        if amplify:
            model[5].weight.mul_(torch.logspace(2, -1, 8).reshape(1, 8, 1, 1))
    return model


def _data():
    torch.manual_seed(1)
    return [torch.randn(2, 3, 8, 8) for _ in range(4)]


def _compare(model, data):
    return lucid_fx.compare(model, lucid_fx.quantize(model, (data[0],), data, progress=False), data)


def test_a_spread_the_next_layer_reads_is_named_with_equalize_which_clears_it():
    model, data = _depthwise_pair(amplify=True), _data()
    before = _compare(model, data)
    row = before.by_node()["_4"]  # the depthwise conv's fused ReLU: the conv's channels
    assert before.output_sqnr_db < HINT_BELOW_DB and row.spread_of == "conv2d" and row.channel_spread > 1000
    (hint,) = before.hints()
    assert hint.startswith(f"_4 ({row.channel_spread:.0f}x): ") and "lucid_fx.equalize(model, example_inputs)" in hint
    assert str(before).splitlines()[-1] == "hint: " + hint
    equalized = lucid_fx.equalize(model, (data[0],))
    after = _compare(equalized, data)
    assert after.output_sqnr_db > before.output_sqnr_db + 20 and after.hints() == []
    assert max(r.channel_spread for r in after.rows if r.channel_spread is not None) < SPREAD_HINT


def test_a_spread_the_output_does_not_suffer_from_gives_no_hint():
    before = _compare(_depthwise_pair(amplify=False), _data())
    assert before.output_sqnr_db > HINT_BELOW_DB and before.by_node()["_4"].channel_spread > 1000
    assert before.hints() == [] and "hint:" not in str(before)


def test_a_norms_outlier_channels_are_named_with_smooth_quant():
    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)).eval()
    with torch.no_grad():
        block[0].weight[:2].mul_(300)
        block[1].weight[:, :2].div_(300)  # the linear reads every channel alike
    batches = [torch.randn(4, 16) for _ in range(4)]
    before = _compare(block, batches)
    (hint,) = before.hints()
    assert hint.startswith("_0 (") and "lucid_fx.smooth_quant(model, batches)" in hint
    assert before.by_node()["_0"].spread_of == "layer_norm"
    after = _compare(lucid_fx.smooth_quant(block, batches, alpha=0.5), batches)
    assert after.output_sqnr_db > 40 > 10 > before.output_sqnr_db and after.hints() == []


def test_many_spread_outputs_are_named_widest_first_up_to_the_limit():
    from lucid_fx.compare import Comparison, NodeError

    rows = [NodeError(f"c{i}", f"c{i}", "conv2d", "int8", 5.0, 1.0, 0.1, 10, "", 40.0 + i, "conv2d") for i in range(7)]
    rows.append(NodeError("n", "n", "layer_norm", "float", 5.0, 1.0, 0.1, 10, "", 50.0, "layer_norm"))
    rows.append(NodeError("narrow", "narrow", "conv2d", "int8", 5.0, 1.0, 0.1, 10, "", SPREAD_HINT - 1, "conv2d"))
    norm, conv = Comparison(rows, 10.0, 1).hints(limit=3)  # the remedy of the widest first
    assert conv.startswith("c6 (46x), c5 (45x), c4 (44x) and 4 more: ") and "equalize" in conv
    assert norm.startswith("n (50x): ") and "smooth_quant" in norm
    assert Comparison(rows, HINT_BELOW_DB, 1).hints() == []


@pytest.mark.parametrize("op, where, shape, expected", [
    ("conv2d", None, (2, 3, 4, 4), ("conv2d", 3)),  # NCHW: channels on dim 1
    ("relu", Placement(Runs.KERNEL, "conv2d+relu", ("c", "r")), (2, 3, 4, 4), ("conv2d", 3)),  # a fused group's conv
    ("linear", None, (2, 5, 6), ("linear", 6)),  # (batch, tokens, features): the last dim
    ("layer_norm", None, (5, 6), ("layer_norm", 6)),
    ("relu", Placement(Runs.KERNEL, "add+relu", ("a", "r")), (2, 3), ("", None)),  # no layer's channels
    ("conv2d", None, (7,), ("", None)),
])
def test_channel_ranges_take_the_channels_of_the_layer_that_made_the_value(op, where, shape, expected):
    value = torch.arange(float(torch.Size(shape).numel())).reshape(shape) - 3
    of, most = channel_ranges(op, where, value)
    assert (of, None if most is None else most.numel()) == expected
    if most is not None:
        dim = 1 if of == "conv2d" else value.dim() - 1
        assert torch.equal(most, value.abs().amax(dim=[d for d in range(value.dim()) if d != dim]))
