"""Lowering rules: which int8 kernel a canonical op becomes."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from _program import graph_until
from lucid_fx.explain import explain
from lucid_fx.rules import lowering_gate
from lucid_fx.rules.lowering import SUM_OF_PRODUCTS_WHY


class Pool1d(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)
        self.functional = functional

    def forward(self, x):
        y = self.conv(x)
        return F.max_pool1d(y, 2) if self.functional else self.pool(y)


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
def test_max_pool1d_runs_on_codes(functional):
    # Regression (found by tests/test_fuzz.py): max_pool1d ran torch's own op on uint8 codes,
    # which has no uint8 kernel ("max_pool1d_impl" not implemented for 'Byte').
    torch.manual_seed(0)
    model = Pool1d(functional).eval()
    batches = [torch.randn(2, 2, 11) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    kernels = [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
    assert kernels == ["quantize_per_tensor", "conv2d", "max_pool2d", "dequantize_per_tensor"]  # a conv1d of height 1
    x = batches[1]
    out, ref = qmodel(x), lucid_fx.convert(prepared, reference=True)(x)
    assert out.shape == model(x).shape == (2, 4, 4 if functional else 5)
    # Max-pooling codes is exact: outputs stay on the conv's output grid, one step from the reference.
    scale, zp = (v.item() for v in prepared.lucid_fx_observers["conv"].calculate_qparams())
    codes = out / scale + zp
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert (out - ref).abs().max() <= scale + 1e-6


class Interleaved(nn.Module):
    """GPT-J's rotary tables: each value repeated along the last dim, between two linears here."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.a(x).repeat_interleave(2, dim=-1))


def test_repeat_interleave_moves_codes(sqnr_db):
    torch.manual_seed(0)
    model, batches = Interleaved().eval(), [torch.randn(4, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    calls = [getattr(n.target, "__name__", n.target) for n in qmodel.graph.nodes if n.op in ("call_function", "call_method")]
    assert calls == ["quantize_per_tensor", "linear", "repeat_interleave", "linear"], calls  # no float island
    assert "0 ops in float" in str(qmodel.lucid_fx_convert_report)
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 30


class Shuffled(nn.Module):
    """conv -> a shuffle of its codes -> conv (super-resolution's sub-pixel convolution, ShuffleNet's channel
    shuffle, nn.MultiheadAttention's unflatten under torch.export)."""

    def __init__(self, shuffle: nn.Module, channels_after: int):
        super().__init__()
        self.a, self.shuffle, self.b = nn.Conv2d(3, 8, 3, padding=1), shuffle, nn.Conv2d(channels_after, 4, 1)

    def forward(self, x):
        return self.b(self.shuffle(self.a(x)))


class Unflattened(nn.Module):
    def forward(self, x):
        return x.unflatten(1, (2, 4)).flatten(1, 2)


@pytest.mark.parametrize("shuffle,channels_after,call", [
    (nn.PixelShuffle(2), 2, "shuffle"),  # the module, called on the codes
    (nn.PixelUnshuffle(2), 32, "shuffle"),
    (nn.ChannelShuffle(2), 8, "shuffle"),
    (Unflattened(), 8, "unflatten"),
])
def test_shuffles_move_codes(sqnr_db, shuffle, channels_after, call):
    torch.manual_seed(0)
    model, batches = Shuffled(shuffle, channels_after).eval(), [torch.randn(1, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    calls = [getattr(n.target, "__name__", n.target) for n in qmodel.graph.nodes if n.op.startswith("call_")]
    assert call in calls and "dequantize_per_tensor" not in calls, calls  # on the codes, no float island
    assert "0 ops in float" in str(qmodel.lucid_fx_convert_report)
    with torch.no_grad():
        x = torch.randn(1, 3, 8, 8)
        assert sqnr_db(model(x), qmodel(x)) > 30


class Upsampled(nn.Module):
    """conv -> upsample -> conv (an FPN's top-down path, a U-Net's decoder), or the upsample last (a segmentation head)."""

    def __init__(self, mode: str, module: bool = False, last: bool = False):
        super().__init__()
        self.a, self.b, self.mode, self.last = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 4, 1), mode, last
        corners = None if mode.startswith("nearest") else False
        self.up = nn.Upsample(scale_factor=2, mode=mode, align_corners=corners) if module else None

    def forward(self, x):
        y = self.a(x)
        if self.last:
            y = self.b(y)
        y = self.up(y) if self.up is not None else F.interpolate(y, scale_factor=2, mode=self.mode)
        return y if self.last else self.b(y)


@pytest.mark.parametrize("mode,module", [("nearest", False), ("nearest", True), ("bilinear", False), ("bilinear", True)])
def test_upsampling_runs_on_the_codes(sqnr_db, mode, module):
    torch.manual_seed(0)
    model, batches = Upsampled(mode, module).eval(), [torch.randn(1, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    calls = [getattr(n.target, "__name__", n.target) for n in qmodel.graph.nodes if n.op.startswith("call_")]
    assert ("up" if module else "interpolate") in calls and "dequantize_per_tensor" not in calls, calls
    assert ("quantize_per_tensor" in calls[1:]) == (mode == "bilinear"), calls  # bilinear's average rounded to the grid
    assert "0 ops in float" in str(qmodel.lucid_fx_convert_report)
    with torch.no_grad():
        x = torch.randn(1, 3, 8, 8)
        assert sqnr_db(model(x), qmodel(x)) > 30
    if mode == "bilinear":  # the codes are quantize's of the float result on the input's grid, within float rounding
        node = next(n for n in qmodel.graph.nodes if n.op.startswith("call_") and (n.target in ("up",) or n.target is F.interpolate))
        codes = {}
        hook = torch.fx.Interpreter(qmodel)
        hook.run_node = lambda n, run=hook.run_node: codes.setdefault(n.name, run(n))
        hook.run(x)
        before, after = codes[node.args[0].args[0].name], codes[next(iter(node.users)).name]
        want = F.interpolate(before.float(), scale_factor=2, mode="bilinear", align_corners=False).round()
        assert (after.float() - want).abs().max() == 0


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_a_final_upsampling_runs_in_float_on_the_kernel_s_float_result(mode):
    torch.manual_seed(0)
    model, batches = Upsampled(mode, last=True).eval(), [torch.randn(1, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    report = str(qmodel.lucid_fx_convert_report)
    assert "kept float: interpolate (shared runs in float: nothing reads its codes" in report, report
    conv = [n for n in qmodel.graph.nodes if n.target is torch.ops.lucid_fx.conv2d][-1]
    assert conv.args[13] == torch.float32  # the head gives its float result, with no rounding onto a grid


def test_bicubic_upsampling_overshoots_its_input_and_stays_float():
    torch.manual_seed(0)
    model, batches = Upsampled("bicubic").eval(), [torch.randn(1, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    assert "float op: interpolate (no lowering rule for interpolate)" in str(qmodel.lucid_fx_convert_report)


class Decoder(nn.Module):
    """A U-Net decoder step: a transposed convolution upsampling the coarse codes, concatenated with the skip."""

    def __init__(self, up: nn.Module, functional: bool = False):
        super().__init__()
        self.down, self.up, self.fuse, self.functional = nn.Conv2d(3, 8, 3, stride=2, padding=1), up, nn.Conv2d(6 + 3, 4, 1), functional

    def forward(self, x):
        coarse = self.down(x)
        if self.functional:
            fine = F.conv_transpose2d(coarse, self.up.weight, self.up.bias, stride=self.up.stride)
        else:
            fine = self.up(coarse)
        return self.fuse(torch.cat([fine, x], 1))


@pytest.mark.parametrize("k,functional", [(2, False), (2, True), (4, False)])
def test_a_transposed_convolution_of_kernel_equal_to_stride_is_an_int8_1x1_convolution(sqnr_db, k, functional):
    torch.manual_seed(0)
    size = 8 if k == 2 else 16
    model = Decoder(nn.ConvTranspose2d(8, 6, k, stride=k), functional).eval()
    if k == 4:  # coarse is size / 2: a 4x upsampling overshoots; the down path halves again to match
        model.down = nn.Conv2d(3, 8, 3, stride=4, padding=1).eval()
    batches = [torch.randn(2, 3, size, size) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    convs = [n for n in qmodel.graph.nodes if n.target is torch.ops.lucid_fx.conv2d]
    up = next(n for n in convs if n.args[3].op == "get_attr" and getattr(qmodel, n.args[3].target).shape == (6 * k * k, 8, 1, 1))
    assert next(iter(up.users)).target is F.pixel_shuffle and next(iter(up.users)).args[1] == k
    report = qmodel.lucid_fx_convert_report
    assert "0 ops in float" in str(report) and report.int8_flop_share == 1.0, str(report)
    assert report.flops["conv_transpose2d" if functional else "up"] == 2 * (2 * 8 * (size // k) ** 2) * 6 * k * k  # each input value times its (6, k, k) block
    with torch.no_grad():
        x = torch.randn(2, 3, size, size)
        assert sqnr_db(model(x), qmodel(x)) > 30


@pytest.mark.parametrize("k,s,p,op,groups", [(4, 2, 1, 0, 1), (4, 2, 1, 1, 1), (6, 3, 2, 1, 1), (4, 2, 0, 0, 1), (2, 1, 0, 0, 1),
                                              (3, 2, 1, 1, 1), (3, 2, 0, 0, 1), (5, 2, 2, 1, 1), (1, 2, 0, 0, 1), (4, 2, 1, 0, 2),
                                              (3, 2, 1, 1, 8)])
def test_a_transposed_convolution_is_one_int8_convolution_of_its_phases(sqnr_db, k, s, p, op, groups):
    # a GAN generator's / an FCN decoder's ConvTranspose2d(4, stride=2, padding=1): s * s phases, each a plain
    # convolution with a (k / s)-tap kernel, in one lucid_fx.conv2d; pixel_shuffle interleaves them, the padding
    # crops. An autoencoder's 3x3 stride-2 one (output padding 1) is the same with its kernel extended by zero
    # taps to 4x4, the extra positions cropped; grouped (depthwise too) keeps its groups.
    torch.manual_seed(0)
    cout = 8 if groups == 8 else 6
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, cout, k, s, p, op, groups=groups),
                          nn.Conv2d(cout, 4, 1)).eval()
    batches = [torch.randn(2, 3, 7, 6) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    report = qmodel.lucid_fx_convert_report
    assert "0 ops in float" in str(report) and report.int8_flop_share == 1.0, str(report)
    phases = [n for n in qmodel.graph.nodes if n.target is torch.ops.lucid_fx.conv2d][1]
    taps = -(-k // s)  # the kernel extended to a multiple of the stride, in phases
    assert getattr(qmodel, phases.args[3].target).shape == (cout * s * s, 8 // groups, taps, taps)
    assert phases.args[7] == [taps - 1, taps - 1] and phases.args[9] == groups
    assert next(iter(phases.users)).target is F.pixel_shuffle
    with torch.no_grad():
        x = torch.randn(2, 3, 7, 6)
        want = model(x)
        got = qmodel(x)
        assert got.shape == want.shape and sqnr_db(want, got) > 30


@pytest.mark.parametrize("geometry,int8", [(dict(kernel_size=4, stride=2, padding=1), True),
                                           (dict(kernel_size=3, stride=2, padding=1, output_padding=1), True),
                                           (dict(kernel_size=2, stride=2, groups=2), True),
                                           (dict(kernel_size=3, stride=2, dilation=2), False),
                                           (dict(kernel_size=4, stride=2, output_padding=1), False)])
def test_explain_predicts_where_a_transposed_convolution_runs(geometry, int8):
    from lucid_fx.placement import placements

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 6, **geometry), nn.Conv2d(6, 4, 1)).eval()
    batches = [torch.randn(1, 3, 6, 6) for _ in range(2)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    predicted = str(placements(prepared)["_1"])
    assert predicted == str(placements(lucid_fx.convert(prepared))["_1"])
    assert predicted == ("int8 kernel (conv_transpose2d)" if int8 else "float (lowering declined)"), predicted


def test_a_batch_norm_after_a_transposed_convolution_is_not_folded_into_its_weight(sqnr_db):
    # a DCGAN generator's ConvTranspose2d -> BatchNorm2d -> ReLU: the weight's output channels are its dim 1, so a
    # conv's fold (scaling dim 0) would scale the input channels; the batch norm runs as its own int8 table instead
    torch.manual_seed(0)
    up = nn.Sequential(nn.ConvTranspose2d(8, 6, 2, stride=2), nn.BatchNorm2d(6), nn.ReLU())
    up[1].running_mean.uniform_(-1, 1), up[1].running_var.uniform_(0.5, 2), up[1].weight.data.uniform_(0.5, 2)
    model, batches = Decoder(up).eval(), [torch.randn(2, 3, 8, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the program builds: relu(batch norm) -> cat is one table per channel, then cat
        x = torch.randn(2, 3, 8, 8)
        assert sqnr_db(model(x), qmodel(x)) > 30


@pytest.mark.parametrize("geometry", [dict(kernel_size=3, stride=2, dilation=2), dict(kernel_size=4, stride=2, output_padding=1),
                                      dict(kernel_size=3, stride=(2, 1))])
def test_a_dilated_or_uncropped_transposed_convolution_stays_float_and_says_so(geometry):
    # dilation, unequal strides, and an output padding past the padding and the extra taps (the end the crop takes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ConvTranspose2d(8, 6, **geometry), nn.Conv2d(6, 4, 1)).eval()
    batches = [torch.randn(1, 3, 8, 8) for _ in range(2)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    assert "kept float: _1 (lowering declined" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)
    with torch.no_grad():
        x = torch.randn(1, 3, 8, 8)
        assert torch.allclose(qmodel(x), model(x), atol=0.15)


@pytest.mark.parametrize("make,decomposed", [(lambda: Upsampled("nearest"), False), (lambda: Upsampled("bilinear", module=True), False),
                                             (lambda: Decoder(nn.ConvTranspose2d(8, 6, 2, stride=2)), False),
                                             (lambda: Decoder(nn.ConvTranspose2d(8, 6, 2, stride=2)), True)],
                         ids=["nearest", "bilinear", "transposed", "transposed-core-aten"])
def test_torch_export_s_upsampling_and_transposed_convolution_take_the_same_rules(sqnr_db, make, decomposed):
    # aten's upsample_nearest2d / upsample_bilinear2d and convolution(transposed=True) (an ExportedProgram run to
    # core aten) were float under torch.export
    torch.manual_seed(0)
    model, batches = make().eval(), [torch.randn(2, 3, 8, 8) for _ in range(4)]
    source = model
    if decomposed:
        with warnings.catch_warnings():  # torch 2.13's run_decompositions copies a pytree spec it deprecates
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
            source = torch.export.export(model, (batches[0],)).run_decompositions()
    prepared = lucid_fx.prepare(source, example_inputs=(batches[0],), capture="export")
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    assert "0 ops in float" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)
    with torch.no_grad():
        x = torch.randn(2, 3, 8, 8)
        assert sqnr_db(model(x), qmodel(x)) > 30


class Padded(nn.Module):
    """conv -> F.pad to a multiple of 4 (Swin's window padding, sizes from the shape) -> conv."""

    def __init__(self, mode: str, value=None):
        super().__init__()
        self.a, self.b, self.mode, self.value = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3), mode, value

    def forward(self, x):
        y = self.a(x)
        extra = {"value": self.value} if self.value is not None else {}
        return self.b(F.pad(y, (0, (4 - y.shape[-1] % 4) % 4, 1, 1), mode=self.mode, **extra))


@pytest.mark.parametrize("mode,value", [("constant", None), ("constant", 0.0), ("reflect", None), ("replicate", None), ("circular", None)])
def test_padding_moves_codes_and_pads_zeros_with_the_zero_point(sqnr_db, mode, value):
    torch.manual_seed(0)
    model, batches = Padded(mode, value).eval(), [torch.randn(2, 3, 9, 9) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    assert "0 ops in float" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)
    pad = next(n for n in qmodel.graph.nodes if n.target is F.pad)
    conv = pad.args[0].args[0] if pad.args[0].op == "call_method" else pad.args[0]  # through a layout call, if any
    if mode == "constant":  # the real 0 is the input grid's zero point
        assert pad.kwargs["value"] == conv.args[11]
    with torch.no_grad():
        x = torch.randn(2, 3, 9, 9)
        assert sqnr_db(model(x), qmodel(x)) > 28


def test_padding_with_another_value_stays_float():
    torch.manual_seed(0)
    model, batches = Padded("constant", 0.5).eval(), [torch.randn(2, 3, 9, 9) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    assert "float op: pad (no lowering rule for pad)" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)


class Rolled(nn.Module):
    """Swin's shifted windows: torch.roll of a block's codes, and a flip, between two linears."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.roll(self.a(x), shifts=(-2, 1), dims=(1, 2)).flip(1))


def test_roll_and_flip_move_codes(sqnr_db):
    torch.manual_seed(0)
    model, batches = Rolled().eval(), [torch.randn(2, 6, 8) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    calls = [getattr(n.target, "__name__", n.target) for n in qmodel.graph.nodes if n.op.startswith("call_")]
    assert calls == ["quantize_per_tensor", "linear", "roll", "flip", "linear"], calls
    with torch.no_grad():
        x = torch.randn(2, 6, 8)
        assert sqnr_db(model(x), qmodel(x)) > 30


def test_functional_max_pool2d_uses_the_int16_kernel():
    # F.max_pool2d passes dilation/ceil_mode/return_indices by keyword; the rule used to decline
    # any keyword beyond the first three and run torch's slow uint8 max-pool instead.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return F.max_pool2d(self.conv(x), 2, ceil_mode=True)

    torch.manual_seed(0)
    model = Net().eval()
    batches = [torch.randn(1, 3, 9, 9) for _ in range(2)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    pools = [n.target for n in qmodel.graph.nodes if "max_pool" in str(n.target)]
    assert pools == [torch.ops.lucid_fx.max_pool2d]
    out, ref = qmodel(batches[1]), lucid_fx.convert(prepared, reference=True)(batches[1])
    assert out.shape == (1, 4, 4, 4)  # ceil_mode kept: 7 -> 4
    scale = prepared.lucid_fx_observers["conv"].calculate_qparams()[0].item()
    assert (out - ref).abs().max() <= scale + 1e-6


class Scaled(nn.Module):
    """``fc(x)`` then one multiplication or division by a number."""

    def __init__(self, op):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.op = op

    def forward(self, x):
        return self.op(self.fc(x))


def _converted(op, batches):
    torch.manual_seed(0)
    model = Scaled(op).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return prepared, lucid_fx.convert(prepared)


@pytest.mark.parametrize(
    "op, factor",
    [(lambda y: y * 0.125, 0.125), (lambda y: 3 * y, 3.0), (lambda y: y / 4, 0.25), (lambda y: y.mul(0.5), 0.5),
     (lambda y: y / torch.full([], 4.0), 0.25), (lambda y: torch.full([], 0.5) * y, 0.5)],
    ids=["x*c", "c*x", "x/c", "x.mul(c)", "x/full(c)", "full(c)*x"],  # GPT-2's scores / torch.full([], d ** 0.5)
)
def test_scaling_by_a_positive_number_rescales_the_grid(op, factor):
    # x * c for c > 0 is the same codes on the grid (scale * c, zero_point): no table, no rounding.
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    _, plain = _converted(lambda y: y, batches)
    prepared, qmodel = _converted(op, batches)
    kernels = [str(n.target) for n in qmodel.graph.nodes if n.op in ("call_function", "call_method")]
    assert kernels == ["lucid_fx.quantize_per_tensor", "lucid_fx.linear", "view_as",
                       "lucid_fx.dequantize_per_tensor"]
    (rescaled,) = [n for n in qmodel.graph.nodes if n.target == "view_as"]
    fc_scale, fc_zp = (v.item() for v in prepared.lucid_fx_observers["fc"].calculate_qparams())
    scale, zp, _ = rescaled.meta["lucid_fx.qparams"]
    assert zp == fc_zp and scale == pytest.approx(fc_scale * factor, rel=1e-7)
    x = torch.randn(32, 8)
    # Exactly the unscaled int8 result times c (float32 rounding of the scale aside). The plain model's
    # linear gives its float result (nothing reads its codes), so round it onto the linear's grid first.
    codes = torch.ops.lucid_fx.quantize_per_tensor(plain(x), fc_scale, int(fc_zp), 0, 255, torch.uint8)
    on_grid = torch.ops.lucid_fx.dequantize_per_tensor(codes, fc_scale, int(fc_zp))
    torch.testing.assert_close(qmodel(x), on_grid * factor, rtol=1e-6, atol=1e-7)
    assert qmodel.lucid_fx_convert_report.lowered == {"fc": "linear", rescaled.meta["lucid_fx.source"]: "div" if factor == 0.25 else "mul"}


@pytest.mark.parametrize(
    "op", [lambda y: y * -2.0, lambda y: torch.div(y, 2, rounding_mode="floor"), lambda y: y * 0.0],
    ids=["negative", "floor-divide", "zero"],
)
def test_other_scalings_keep_their_own_grid(op):
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    _, qmodel = _converted(op, batches)
    assert not [n for n in qmodel.graph.nodes if n.target == "view_as"]
    # They are tables (256 entries computed from the op) instead.
    assert [n.target for n in qmodel.graph.nodes].count(torch.ops.lucid_fx.lut) == 1


def test_a_fixed_grid_that_differs_is_kept():
    # A FixedQParamsObserver's grid is a promise: a rescale that would leave it falls back to a table.
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    torch.manual_seed(0)
    model = Scaled(lambda y: y * 0.5).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    (key,) = [k for k in prepared.lucid_fx_observers if k != "fc" and k != "x"]
    prepared.lucid_fx_observers[key] = lucid_fx.quantization.FixedQParamsObserver(scale=1 / 64, zero_point=100)
    qmodel = lucid_fx.convert(prepared)
    assert not [n for n in qmodel.graph.nodes if n.target == "view_as"]
    (table,) = [n for n in qmodel.graph.nodes if n.target == torch.ops.lucid_fx.lut]
    assert table.meta["lucid_fx.qparams"][:2] == (1 / 64, 100)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gelu_after_a_linear_is_its_post_op_in_either_form(approximate, sqnr_db):
    # a transformer's MLP: gelu(fc1(x)) computed in float inside fc1's kernel, so fc1's result needs no grid
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(approximate), torch.nn.Linear(128, 32)).eval()
    batches = [torch.randn(16, 32) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    linears = [n.args[8] for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.linear"]
    assert linears == ["gelu" if approximate == "none" else "gelu_tanh", "none"]
    assert not [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.lut"]
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 30


@pytest.mark.parametrize("act", ["hardswish", "silu"])
def test_an_activation_after_a_weighted_op_is_its_kernels_post_op(act, sqnr_db):
    # hardswish/silu(bn(conv(x))) and act(linear(x)): one kernel that applies act in float before it
    # requantizes (oneDNN's post-op), not a kernel, a requantize and a table.
    Act = {"hardswish": torch.nn.Hardswish, "silu": torch.nn.SiLU}[act]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), Act(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 16), Act()).eval()
    model[1].running_mean.uniform_(-0.5, 0.5), model[1].running_var.uniform_(0.5, 2)
    batches = [torch.randn(4, 3, 6, 6) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches)
    calls = [(str(n.target), n.args) for n in qmodel.graph.nodes if n.op == "call_function"]
    post_ops = {name: args[12 if name.endswith("conv2d") else 8] for name, args in calls if name.endswith(("conv2d", "linear"))}
    assert post_ops == {"lucid_fx.conv2d": act, "lucid_fx.linear": act}
    assert not any(name.endswith("lut") for name, _ in calls)
    with torch.no_grad():
        x = torch.randn(4, 3, 6, 6)
        assert sqnr_db(model(x), qmodel(x)) > 30


class _Gate(torch.nn.Module):
    """out(act(fc(x))): fc's result read by the activation alone (or also by ``also``), whose codes out reads."""

    def __init__(self, act, gain: float = 1.0, also: bool = False):
        super().__init__()
        self.fc, self.act, self.also, self.out = torch.nn.Linear(32, 64), act, also, torch.nn.Linear(64, 8)
        with torch.no_grad():
            self.fc.weight.mul_(gain), self.fc.bias.mul_(gain)

    def forward(self, x):
        y = self.fc(x)
        return self.out(self.act(y) + y if self.also else self.act(y))


def _gate_model(act, gain=1.0, also=False):
    torch.manual_seed(0)
    model = _Gate(act, gain, also).eval()
    batches = [torch.randn(16, 32) * 3 for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return model, prepared, lucid_fx.convert(prepared)


def _rounded(reference):
    """The values a reference model rounds, in graph order."""
    return [n.meta["lucid_fx.source"] for n in reference.graph.nodes if str(n.target) == "lucid_fx.quantize_per_tensor"]


def _linears(qmodel):
    return [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.linear"][:-1]  # not out


@pytest.mark.parametrize("act", ["tanh", "sigmoid"])
def test_a_gate_after_a_linear_is_its_post_op_one_rounding_fewer(act, monkeypatch):
    fn = {"tanh": torch.tanh, "sigmoid": torch.sigmoid}[act]
    model, prepared, qmodel = _gate_model(fn)
    (linear,) = _linears(qmodel)
    # oneDNN has tanh and no sigmoid: sigmoid(y) on its fixed grid 1/256 is tanh(y / 2) on the grid (1/128, 128)
    assert linear.args[8] == "tanh" and linear.args[6:8] == ((2 / 256, 128) if act == "tanh" else (1 / 128, 128))
    scales, bias = getattr(qmodel, linear.args[4].target), getattr(qmodel, linear.args[5].target)
    halve = 0.5 if act == "sigmoid" else 1.0  # exact in float: the product halves with them
    assert torch.equal(scales, getattr(qmodel, "_lucid_fc_wscale") * halve) and torch.equal(bias, model.fc.bias * halve)
    assert not [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.lut"]
    report = qmodel.lucid_fx_convert_report
    assert report.lowered["fc"].startswith(f"linear, its result read by {act} inside the kernel")
    # reference mode rounds what the kernels round: x and the activation's result, not fc's (nor out's float result)
    reference = lucid_fx.convert(prepared, reference=True)
    assert _rounded(reference) == ["x", act]
    x = [torch.randn(16, 32) * 3]
    fused_db = lucid_fx.compare(model, qmodel, x).by_node()[act].sqnr_db  # the activation's own codes
    monkeypatch.setattr(lowering_gate, "gate_after_linear", lambda *args: False)
    unfused = lucid_fx.convert(prepared)
    assert [n.args[8] for n in _linears(unfused)] == ["none"]
    assert _rounded(lucid_fx.convert(prepared, reference=True)) == ["x", "fc", act]
    unfused_db = lucid_fx.compare(model, unfused, x).by_node()[act].sqnr_db
    print(f"fused {fused_db:.1f} dB, unfused {unfused_db:.1f} dB")
    assert fused_db > unfused_db + 1


def test_a_sigmoid_on_a_narrowed_grid_is_the_linears_float_post_op():
    # small pre-activations: the sigmoid's grid narrows to what the linear's grid reaches, and keeps it
    model, prepared, qmodel = _gate_model(torch.sigmoid, gain=0.01)
    (linear,) = _linears(qmodel)
    assert linear.args[8] == "sigmoid" and linear.args[6] < 1 / 256 / 1.5  # no tanh grid matches a narrowed one
    x = torch.randn(16, 32) * 3
    fused = torch.fx.GraphModule(qmodel, graph_until(qmodel.graph, linear))  # the fused linear's codes
    with torch.no_grad():
        got = torch.ops.lucid_fx.dequantize_per_tensor(fused(x), linear.args[6], linear.args[7])
        assert (got - torch.sigmoid(model.fc(x))).abs().max() <= linear.args[6]  # within a step of the narrowed grid



def test_a_linear_read_by_its_gate_and_another_op_keeps_its_codes():
    model, prepared, qmodel = _gate_model(torch.tanh, also=True)
    assert [n.args[8] for n in _linears(qmodel)] == ["none"]
    assert [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.lut"]


@pytest.mark.parametrize("conv,sizes,shape", [
    (lambda p: nn.Conv2d(8, 8, 5, padding=p, groups=8), 2, (2, 8, 12, 12)),  # ConvMixer's depthwise
    (lambda p: nn.Conv2d(8, 6, 3, padding=p, dilation=2), 2, (2, 8, 12, 12)),
    (lambda p: nn.Conv2d(8, 6, (3, 5), padding=p), (1, 2), (2, 8, 12, 12)),
    (lambda p: nn.Conv1d(8, 6, 7, padding=p), 3, (2, 8, 20)),
], ids=["depthwise", "dilated", "rectangular", "1d"])
def test_same_padding_is_lowered_as_its_sizes(conv, sizes, shape, sqnr_db):
    # padding="same" declined (a string, no sizes): a ConvMixer-style block's depthwise convolutions ran float; now the
    # same int8 convolution as the model written with the sizes, code for code
    def model(padding):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(8, 8, 1) if len(shape) == 4 else nn.Conv1d(8, 8, 1), conv(padding)).eval()

    batches = [torch.randn(shape) for _ in range(4)]
    named, sized = (lucid_fx.quantize(model(p), (batches[0],), batches, progress=False) for p in ("same", sizes))
    assert named.lucid_fx_convert_report.float_ops == {} and named.lucid_fx_convert_report.int8_flop_share == 1.0
    with torch.no_grad():
        x = torch.randn(shape)
        assert torch.equal(named(x), sized(x)) and sqnr_db(model("same")(x), named(x)) > 25


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's own, on the float model's calls
def test_uneven_same_padding_stays_float_and_says_so():
    # an even kernel's "same" padding puts the extra row on the far side, which the kernel's symmetric padding cannot
    torch.manual_seed(0)
    from lucid_fx.placement import placements

    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.Conv2d(8, 6, 4, padding="same")).eval()
    batches = [torch.randn(2, 8, 10, 10) for _ in range(2)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    assert str(placements(prepared)["_1"]) == "float (lowering declined)"  # explain predicts it (it said int8)
    qmodel = lucid_fx.convert(prepared)
    assert "kept float: _1 (lowering declined" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)


@pytest.mark.parametrize("pad,on_codes", [(nn.ZeroPad2d(1), True), (nn.ReflectionPad2d(1), True), (nn.ReplicationPad2d((1, 2, 0, 1)), True),
                                          (nn.CircularPad2d(1), True), (nn.ConstantPad2d(1, 0.5), False)],
                         ids=["zero", "reflect", "replicate", "circular", "constant-0.5"])
def test_padding_modules_move_codes(pad, on_codes, sqnr_db):
    # nn.ZeroPad2d & co. were float leaves; as F.pad they move codes (zeros are the zero point); another constant
    # is no code of the grid and stays float, named
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), pad, nn.Conv2d(8, 4, 3)).eval()
    batches = [torch.randn(2, 3, 10, 10) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    assert qmodel.lucid_fx_convert_report.float_ops == ({} if on_codes else {"_1": "no lowering rule for pad"})
    if on_codes:
        [moved] = [n for n in qmodel.graph.nodes if n.target is F.pad]
        modes = {nn.ZeroPad2d: "constant", nn.ReflectionPad2d: "reflect", nn.ReplicationPad2d: "replicate", nn.CircularPad2d: "circular"}
        assert moved.args[1:3] == (tuple(pad.padding), modes[type(pad)])
        conv = next(n for n in qmodel.graph.nodes if n.target is torch.ops.lucid_fx.conv2d)
        assert moved.kwargs.get("value") == (conv.args[11] if isinstance(pad, nn.ZeroPad2d) else None)  # the real 0's code
    with torch.no_grad():
        x = torch.randn(2, 3, 10, 10)
        assert sqnr_db(model(x), qmodel(x)) > 30


class Sums(nn.Module):
    """Sum pooling of a convolution's codes, and attention pooling's weighted sum (a sum of products: float)."""

    def __init__(self):
        super().__init__()
        self.conv, self.att, self.head = nn.Conv2d(3, 8, 3), nn.Linear(8, 1), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        pooled = h.sum((2, 3)) / 100  # (2, 8)
        seq = torch.tanh(h.flatten(2).transpose(1, 2))  # (2, 196, 8)
        w = torch.softmax(self.att(seq), dim=1)
        return self.head(pooled + (w * seq).sum(1))


def test_a_sum_is_a_mean_on_a_finer_grid_and_a_sum_of_products_stays_float(sqnr_db):
    make = lambda s: torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(s))  # noqa: E731
    torch.manual_seed(0)
    model = Sums().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(make(0),))
    lucid_fx.calibrate(prepared, [make(s) for s in range(6)], progress=False)
    qmodel, reference = lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)
    placed = qmodel.lucid_fx_convert_report.placements
    assert placed["sum_1"].why == "sum" and placed["sum_1"].runs.value == "int8 kernel"  # was "no lowering rule for sum"
    assert placed["sum_2"].runs.value == "float" and placed["sum_2"].why == SUM_OF_PRODUCTS_WHY
    predicted = {name: (row["runs"], row["runs_why"]) for name, row in explain(prepared).by_node().items()}
    assert predicted["sum_1"] == ("int8 kernel", "sum") and predicted["sum_2"] == ("float", SUM_OF_PRODUCTS_WHY)
    x = make(50)
    with torch.no_grad():
        assert sqnr_db(reference(x), qmodel(x)) > 40
        assert sqnr_db(model(x), qmodel(x)) > 30


class WholeReductions(nn.Module):
    """Means and sums of every element (no dim, or dim=[] as torch takes it): GRU states' h.mean(), a loss-like head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return torch.stack([h.mean(), h.sum() / 100, h.sum(dim=[]) / 100])


def test_a_mean_or_sum_of_every_element_runs_on_codes(sqnr_db):
    # Convert declined them ("lowering declined": no dim to reduce) while explain predicted an int8 mean.
    make = lambda s: torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s))  # noqa: E731
    torch.manual_seed(1)
    model = WholeReductions().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(make(0),))
    lucid_fx.calibrate(prepared, [make(s) for s in range(4)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    placed = qmodel.lucid_fx_convert_report.placements
    assert [(placed[n].runs.value, placed[n].why) for n in ("mean", "sum_1", "sum_2")] == [("int8 kernel", "mean"), ("int8 kernel", "sum"),
                                                                                         ("int8 kernel", "sum")]
    predicted = {name: (row["runs"], row["runs_why"]) for name, row in explain(prepared).by_node().items()}
    assert all(predicted[n] == (placed[n].runs.value, placed[n].why) for n in ("mean", "sum_1", "sum_2"))
    x = make(9)
    with torch.no_grad():
        want, got = model(x), qmodel(x)
        assert sqnr_db(want, got) > 35 and torch.allclose(got[1], got[2])  # the two sums are one value
