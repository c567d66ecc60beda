"""Ops that move or select codes (lucid_fx/rules/lowering_shared.py): the global max pools and max reductions a
text CNN or a classifier head writes run on the codes as a max of them, and explain agrees with convert."""

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.explain import explain


class MaxOverTime(nn.Module):
    """A text CNN's max over time, in the three ways such code writes it, and a 2-d global max pool module."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv1d(8, 16, k) for k in (3, 4, 5)])
        self.conv2d, self.pool = nn.Conv2d(8, 16, 3), nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        a = F.relu(self.convs[0](x))
        a = F.max_pool1d(a, a.size(2)).squeeze(2)  # Kim's CNN: a window the length of the sequence
        b = F.adaptive_max_pool1d(F.relu(self.convs[1](x)), 1).squeeze(-1)
        c = F.relu(self.convs[2](x)).amax(-1)
        d = self.pool(self.conv2d(x.unsqueeze(-1).expand(-1, -1, -1, 6))).flatten(1)
        return torch.stack([a, b, c, d])


def _converted(model_class, make, n=6):
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(model_class().eval(), example_inputs=(make(0),))
    lucid_fx.calibrate(prepared, [make(s) for s in range(n)], progress=False)
    return prepared, lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)


def _runs(explained):
    return {name: (row["runs"], row["runs_why"]) for name, row in explained.by_node().items() if row["runs"]}


def test_global_max_pools_are_a_max_of_the_codes_code_for_code_the_reference(sqnr_db):
    def make(seed):
        return torch.randn(4, 8, 20, generator=torch.Generator().manual_seed(seed))

    prepared, qmodel, reference = _converted(MaxOverTime, make)
    placed = qmodel.lucid_fx_convert_report.placements
    for name in ("max_pool1d", "adaptive_max_pool1d", "amax", "pool"):
        assert placed[name].runs.value == "shared codes", (name, placed[name])
    calls = [n for n in qmodel.graph.nodes if n.target == "amax"]
    assert [n.args[1] for n in calls] == [[-1], [-1], -1, [-2, -1]]
    x = make(9)
    with torch.no_grad():
        out, ref, fp32 = qmodel(x), reference(x), prepared(x)
    assert torch.equal(out, ref)  # the max of the codes is the code of the max: no rounding of its own
    assert sqnr_db(fp32, out) > 30
    assert _runs(explain(prepared)) == {k: (p.runs.value, p.why) for k, p in placed.items()}


class Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.grid, self.indices = nn.AdaptiveMaxPool2d((3, 3)), nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        h = self.conv(x)
        pooled, where = self.indices(h)
        return self.grid(h), F.max_pool1d(h.flatten(2), h.size(2)), pooled, where


def test_pools_of_unequal_windows_indices_or_another_computed_window_stay_float_and_explain_says_so():
    def make(seed):
        return torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(seed))

    prepared, qmodel, _ = _converted(Pools, make)
    floats = qmodel.lucid_fx_convert_report.float_ops
    # a 3x3 grid of a 10x10 map (windows of 3 and 4), a window of h.size(2) = 10 over a length of 100; a pool with
    # indices is a tuple: its values' item runs in float
    assert floats == {"grid": "lowering declined", "max_pool1d": "lowering declined",
                      "getitem": "item 0 of indices's output: taken as indices gives it, in float"}
    assert _runs(explain(prepared)) == {k: (p.runs.value, p.why) for k, p in qmodel.lucid_fx_convert_report.placements.items()}


class Patches(nn.Module):
    """im2col written with F.unfold (torch has no uint8 im2col): patches of a ViT-style embedding, overlapping
    padded windows with nn.Unfold, and dilated windows (declined: float)."""

    def __init__(self):
        super().__init__()
        self.conv, self.unfold = nn.Conv2d(3, 8, 1), nn.Unfold(3, padding=1, stride=2)
        self.embed, self.local, self.dilated = nn.Linear(8 * 16, 16), nn.Linear(8 * 9, 16), nn.Linear(8 * 9, 16)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        a = self.embed(F.unfold(h, 4, stride=4).transpose(1, 2))  # (2, 16, 16)
        b = self.local(self.unfold(h).transpose(1, 2))  # (2, 64, 16)
        c = self.dilated(F.unfold(h, 3, dilation=2).transpose(1, 2))  # (2, 144, 16)
        return torch.cat([a, b, c], 1)


def test_unfold_windows_are_views_of_the_codes(sqnr_db):
    make = lambda s: torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    prepared, qmodel, reference = _converted(Patches, make)
    placed = qmodel.lucid_fx_convert_report.placements
    assert [placed[n].why for n in ("unfold", "unfold_1")] == ["shared", "shared"]  # was "no lowering rule for unfold"
    assert placed["unfold_2"].runs.value == "float" and placed["unfold_2"].why == "lowering declined"
    x = make(50)
    with torch.no_grad():
        assert sqnr_db(reference(x), qmodel(x)) > 45  # the windows of the same codes: the reference's values
        assert sqnr_db(prepared(x), qmodel(x)) > 30
    runs = _runs(explain(prepared))
    assert runs["unfold"] == ("shared codes", "shared") and runs["unfold_2"] == ("float", "lowering declined")
