"""Standalone batch norms (lucid_fx/rules/lowering_norm.py: lower_batch_norm): DenseNet's
``cat -> batch_norm -> relu -> conv`` runs as one table per channel on the codes, and the program
composes the cat's requantizations and the relu into those tables (rules/program_cpu_elementwise.py),
looked up straight from the cat's parts where the native kernels are loaded. Group norm and instance
norm (lower_group_norm): one ``lucid_fx.group_norm`` on the codes in their layout, a following table
lookup its tail in the program."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.explain import explain
from lucid_fx.kernels import native, native_elementwise, norms
from lucid_fx.kernels.library import op_name
from lucid_fx.quantization import get_default_qconfig_mapping
from _program import lowered
from models import _init_bn


class DenseLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.grow = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.norm, self.conv = nn.BatchNorm2d(12), nn.Conv2d(12, 6, 1)

    def forward(self, x):
        a = self.stem(x)
        features = torch.cat([a, self.grow(a)], 1)
        return self.conv(torch.relu(self.norm(features)))


def _model():
    torch.manual_seed(0)
    return _init_bn(DenseLayer()).eval()  # statistics that do something


def test_a_batch_norm_after_a_cat_runs_as_a_table_per_channel():
    model, x = _model(), torch.randn(2, 3, 12, 12)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    norm = next(n for n in prepared.graph.nodes if n.target == "norm")
    assert norm.meta[_meta.DECISION].kind.value == "statistics"
    lucid_fx.calibrate(prepared, [x, torch.randn_like(x), 2 * torch.randn_like(x)], progress=False)
    q = lucid_fx.convert(prepared)
    assert q.lucid_fx_convert_report.float_ops == {}
    assert [op_name(n) for n in q.graph.nodes].count("channel_lut") == 1
    y, expected = q(x), model(x)
    sqnr = 10 * torch.log10(expected.pow(2).mean() / (y - expected).pow(2).mean())
    assert sqnr > 30, f"{sqnr:.1f} dB"


def test_the_program_composes_the_cat_and_the_relu_into_the_tables_with_the_same_values():
    model, x = _model(), torch.randn(2, 3, 12, 12)
    q = lucid_fx.quantize(model, (x,), [x, torch.randn_like(x), 2 * torch.randn_like(x)])
    portable, program, targets = lowered(q, x)
    assert torch.equal(program(x), portable)
    calls = [getattr(t, "__name__", str(t)) for t in targets]
    assert "lut" not in calls, calls  # the relu and the cat's tables: composed
    if native.available():  # one pass over the cat's parts, without the cat (LUCID_FX_NATIVE=0 reruns the rest)
        assert calls.count("channel_lut_cat") == 1 and "cat" not in calls and "channel_lut" not in calls, calls
        assert native_elementwise.channel_lut_cat in targets
    else:
        assert calls.count("channel_lut") == 1 and calls.count("cat") == 1, calls


def _sqnr(want, got):
    return (10 * torch.log10(want.pow(2).mean() / (want - got).pow(2).mean())).item()


def _quantized(model, x, mapping=None, prepare_from=None):
    prepared = lucid_fx.prepare(model if prepare_from is None else prepare_from, mapping, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [torch.randn_like(x) for _ in range(4)], progress=False)
    return lucid_fx.convert(prepared)


class GroupNormBlock(nn.Module):  # a diffusion U-Net's resnet block: conv -> group norm -> SiLU -> conv, a skip
    def __init__(self, c=32):
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm(self.conv1(x))))


def test_a_group_norm_block_runs_in_int8_and_its_silu_is_the_norm_s_tail():
    torch.manual_seed(0)
    model, x = GroupNormBlock().eval(), torch.randn(2, 32, 16, 16)
    q = _quantized(model, x)
    assert [op_name(n) for n in q.graph.nodes].count("group_norm") == 1 and q.lucid_fx_convert_report.float_ops == {}
    with torch.no_grad():
        assert _sqnr(model(x), q(x)) >= 30
    portable, program, targets = lowered(q, x)
    assert torch.equal(program(x), portable)
    [norm] = [n for n in program.graph.nodes if n.target is norms.cpu_group_norm]
    (user,) = norm.users
    assert len(norm.args) == 10 and (user.target, user.kwargs) == ("contiguous", {"memory_format": torch.channels_last})
    silu = next(n for n in q.graph.nodes if op_name(n) == "lut")
    assert torch.equal(getattr(program, norm.args[9].target), getattr(q, silu.args[1].target))  # read in the norm's pass


class NormThenLookup(nn.Module):  # an int8 norm -> relu read as floats, or by a product of lookups
    def __init__(self, product=False):
        super().__init__()
        # a linear over the last dim gives the norm (N, C, L) codes laid out as the float model's (a Conv1d's are
        # (N, L, C) in memory: a float reader then restores them first, and its dequantize is no tail of the norm)
        self.lin, self.norm, self.product = nn.Linear(32, 32), nn.GroupNorm(2, 8), product
        self.up, self.out = nn.ConvTranspose1d(8, 4, 4, 2, 1), nn.Conv1d(8, 4, 1)  # (no int8 rule: up reads floats)

    def forward(self, x):
        y = F.relu(self.norm(self.lin(x)))
        return self.out(y * torch.sigmoid(self.lin(x))) if self.product else self.up(y)


@pytest.mark.parametrize("product", [False, True])
def test_a_lookup_joined_to_a_group_norm_is_not_read_as_a_table_by_later_rules(product):
    # the program node of a relu joined to the norm keeps the relu's name; a float consumer's dequantize (its floats
    # the norm's tail) or a product of two lookups once read its arguments as (codes, table): the program failed to build
    torch.manual_seed(0)
    model, x = NormThenLookup(product).eval(), torch.randn(2, 8, 32)
    q = _quantized(model, x)
    portable, program, targets = lowered(q, x)
    assert torch.equal(program(x), portable)
    [norm] = [n for n in program.graph.nodes if n.target is norms.cpu_group_norm]
    tail = getattr(program, norm.args[9].target)
    assert tail.dtype == (torch.uint8 if product else torch.float32)  # relu's codes, or their floats
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no program for this input signature"
        q(x), q(x)


@pytest.mark.parametrize("decomposed", [False, True])
def test_an_exported_group_norm_takes_the_same_kernel(decomposed):
    # torch.export records aten.group_norm, or native_group_norm(...)[0] once decomposed
    torch.manual_seed(0)
    model, x = GroupNormBlock().eval(), torch.randn(2, 32, 16, 16)
    exported = torch.export.export(model, (x,), strict=False)
    if decomposed:
        with warnings.catch_warnings():  # torch 2.13's run_decompositions copies a pytree LeafSpec it deprecates
            warnings.simplefilter("ignore", FutureWarning)
            exported = exported.run_decompositions()
    q = _quantized(model, x, prepare_from=exported)
    assert [op_name(n) for n in q.graph.nodes].count("group_norm") == 1 and q.lucid_fx_convert_report.float_ops == {}
    with torch.no_grad():
        assert _sqnr(model(x), q(x)) >= 30


class InstanceNormBlock(nn.Module):  # a style-transfer / CycleGAN block: reflect pad -> conv -> instance norm -> relu
    def __init__(self, norm):
        super().__init__()
        self.pad, self.conv, self.norm = nn.ReflectionPad2d(1), nn.Conv2d(8, 8, 3), norm

    def forward(self, x):
        return x + F.relu(self.norm(self.conv(self.pad(x))))


@pytest.mark.parametrize("norm", [lambda: nn.InstanceNorm2d(8), lambda: nn.InstanceNorm2d(8, affine=True)], ids=["plain", "affine"])
def test_an_instance_norm_is_the_group_norm_of_one_group_a_channel(norm):
    torch.manual_seed(0)
    model, x = InstanceNormBlock(norm()).eval(), torch.randn(2, 8, 12, 12)
    if model.norm.affine:
        model.norm.weight.data.uniform_(0.5, 1.5), model.norm.bias.data.uniform_(-0.5, 0.5)
    q = _quantized(model, x)
    [call] = [n for n in q.graph.nodes if op_name(n) == "group_norm"]
    assert call.args[3] == 8 and set(q.lucid_fx_convert_report.float_ops) == {"add"}  # (the sum ends the model)
    assert [op_name(n) for n in q.graph.nodes].count("quantize_per_tensor") == 1  # the reflect pad moves codes
    with torch.no_grad():
        assert _sqnr(model(x), q(x)) >= 28


def test_an_instance_norm_with_running_statistics_or_unbatched_input_stays_float_and_says_so():
    torch.manual_seed(0)
    tracked = nn.InstanceNorm2d(8, track_running_stats=True)
    tracked.running_mean.uniform_(-0.2, 0.2), tracked.running_var.uniform_(0.8, 1.2)
    model, x = InstanceNormBlock(tracked).eval(), torch.randn(2, 8, 12, 12)
    q = _quantized(model, x)
    assert "norm" in q.lucid_fx_convert_report.float_ops and "group_norm" not in [op_name(n) for n in q.graph.nodes]
    with torch.no_grad():
        assert _sqnr(model(x), q(x)) >= 28


class CosineHead(nn.Module):  # a cosine-similarity head: the L2 norm of the last dim, and one over channels
    def __init__(self):
        super().__init__()
        self.q, self.conv, self.out = nn.Linear(16, 32), nn.Conv2d(3, 8, 3), nn.Linear(32, 4)

    def forward(self, x, image):
        return self.out(F.normalize(self.q(x), dim=-1)), F.normalize(self.conv(image), dim=1).amax((2, 3))


def test_normalize_runs_in_float_where_it_pays_and_forced_is_an_rms_norm_of_the_codes():
    torch.manual_seed(0)
    model = CosineHead().eval()
    batches = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(s)), torch.randn(2, 3, 8, 8)) for s in range(6)]

    def converted(mapping=None):
        prepared = lucid_fx.prepare(model, mapping, example_inputs=batches[0])
        lucid_fx.calibrate(prepared, batches, progress=False)
        return prepared, lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)

    _, qmodel, _ = converted()
    floats = qmodel.lucid_fx_convert_report.float_ops
    assert floats["normalize"].startswith("input of quantized out (normalize runs in float where it pays")
    forced = get_default_qconfig_mapping().set_object_type("normalize", lucid_fx.quantization.default_qconfig)
    prepared, qmodel, reference = converted(forced)
    report = qmodel.lucid_fx_convert_report
    # the last dim's L2 norm: lucid_fx.rms_norm of weight 1/sqrt(32); over channels of an image: float, named
    assert report.lowered["normalize"] == "normalize" and report.float_ops["normalize_1"] == "lowering declined"
    (rms,) = [n for n in qmodel.graph.nodes if op_name(n) == "rms_norm"]
    assert torch.allclose(qmodel.get_buffer(rms.args[4].target), torch.full((32,), 32 ** -0.5))
    x = (torch.randn(64, 16, generator=torch.Generator().manual_seed(9)), torch.randn(2, 3, 8, 8))
    with torch.no_grad():
        (out, _), (ref, _) = qmodel(*x), reference(*x)  # the reference: F.normalize of the dequantized codes
    scale = prepared.lucid_fx_observers["out"].calculate_qparams()[0].item()
    assert (out - ref).abs().max().item() <= scale + 1e-6
    predicted = {k: (r["runs"], r["runs_why"]) for k, r in explain(prepared).by_node().items() if r["runs"]}
    assert predicted == {k: (p.runs.value, p.why) for k, p in report.placements.items()}
