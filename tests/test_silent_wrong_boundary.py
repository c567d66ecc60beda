"""Issue 11, section 2, on converted models: NaN/±inf at the float-to-int8 boundaries, activation
qparams and load_state_dict, and inputs the kernels cannot take. Each case was a wrong number or a
raw error before; each now gives the float answer within int8 error or a clear error naming the node."""

import copy
import io

import pytest
import torch
from torch import fx, nn

import lucid_fx
from lucid_fx._activation_qparams import BUFFER, scales
from lucid_fx.kernels import quantize
from lucid_fx.kernels.checks import KernelInputError

MODES = {"int8": False, "reference": True}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def batches(scale=1.0, seed=0, n=8, shape=(16, 8)):
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(shape, generator=g) for _ in range(n)]


def calibrated(model, data, example=None):
    prepared = lucid_fx.prepare(model, example_inputs=(data[0] if example is None else example,))
    lucid_fx.calibrate(prepared, data, progress=False)
    return prepared


class AcosNet(nn.Module):
    """acos runs in float before the int8 layer (no int8 rule: log, now a table of its input's codes, was the
    example): an input past 1 makes NaN inside the model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.acos(x))


# --- NaN and ±inf at inference: raise at every float-to-int8 boundary -------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_naming_the_value(mode, bad):
    qmodel = lucid_fx.convert(calibrated(mlp(), batches()), reference=MODES[mode])
    x = torch.randn(2, 8)
    x[0, 3] = x[1, 5] = bad
    # Before: int8 and reference both returned finite numbers (NaN read as code 0, inf as 255) where
    # the float model gives NaN and inf.
    with pytest.raises(KernelInputError) as err:
        qmodel(x)
    assert str(err.value).startswith(
        "lucid_fx.quantize_per_tensor: the value of node 'input_1' (quantized by node 'quantize_per_tensor' of the "
        "converted model) cannot enter the int8 grid: it holds NaN or ±inf in 2 of its 16 elements"
    )
    assert "torch.nan_to_num" in str(err.value) and "set_module_name" in str(err.value)


@pytest.mark.parametrize("mode", MODES)
def test_nan_made_inside_the_model_is_caught_where_it_enters_int8(mode):
    data = [torch.rand(16, 8) - 0.5 for _ in range(6)]
    prepared = calibrated(AcosNet().eval(), data)
    assert lucid_fx.convert(prepared).lucid_fx_convert_report.float_ops == {"acos": "no lowering rule for acos"}
    qmodel = lucid_fx.convert(prepared, reference=MODES[mode])
    x = data[0][:2].clone()
    x[0, 0] = 2.0  # acos gives NaN
    with pytest.raises(KernelInputError, match=r"^lucid_fx.quantize_per_tensor: the value of node 'acos' \(quantized by "):
        qmodel(x)
    with pytest.raises(KernelInputError, match="the value of node 'acos'"):
        fx.Interpreter(qmodel).run(x)  # compare and other node-by-node runs name it too


def test_finite_inputs_get_the_same_codes_with_and_without_the_check(monkeypatch, sqnr_db):
    model = mlp()
    qmodel = lucid_fx.convert(calibrated(model, batches()))
    x = batches(seed=9, n=1, shape=(64, 8))[0]
    with torch.no_grad():
        checked, expected = qmodel(x), model(x)
        monkeypatch.setattr(quantize, "codes_need_clamp", lambda codes, quant_min, quant_max, value: True)
        unchecked = qmodel(x)
    assert torch.equal(checked, unchecked)
    assert sqnr_db(expected, checked) >= 30


# --- activation qparams are state, and load_state_dict refuses another calibration ------------


def two_calibrations(reference=False):
    model = mlp()
    a = lucid_fx.convert(calibrated(model, batches(1.0)), reference=reference)
    b = lucid_fx.convert(calibrated(model, batches(3.0)), reference=reference)
    return model, a, b


@pytest.mark.parametrize("mode", MODES)
def test_activation_qparams_are_in_the_state_dict_as_the_code_uses_them(mode):
    _, a, _ = two_calibrations(MODES[mode])
    rows = a.state_dict()[BUFFER]
    quantize = next(n for n in a.graph.nodes if n.target is torch.ops.lucid_fx.quantize_per_tensor)
    scale, zp, qmin, qmax, _ = quantize.args[1:]
    coded = [n for n in a.graph.nodes if "lucid_fx.qparams" in n.meta]
    assert rows.dtype == torch.int64 and rows.shape == (len(coded), 4) and len(coded) >= 2
    row = coded.index(quantize)
    assert scales(rows)[row].item() == scale and rows[row, 1:].tolist() == [zp, qmin, qmax]  # the literals, exactly
    assert [scales(rows)[i].item() for i in range(len(coded))] == [n.meta["lucid_fx.qparams"][0] for n in coded]


@pytest.mark.parametrize("mode", MODES)
def test_load_state_dict_from_another_calibration_is_refused(mode):
    model, a, b = two_calibrations(MODES[mode])
    x = batches(seed=7, n=1, shape=(256, 8))[0]
    with torch.no_grad():
        before = a(x)
        # What an unguarded load did: "All keys matched", and the model still ran a's activation grids
        # (its code), with b's state: here the output stays a's, not b's.
        mixed = copy.deepcopy(a)
        mixed._load_state_dict_pre_hooks.clear()
        assert str(mixed.load_state_dict(b.state_dict())) == "<All keys matched successfully>"
        assert torch.equal(mixed(x), before) and not torch.equal(mixed(x), b(x))
    with pytest.raises(ValueError) as err:
        a.load_state_dict(b.state_dict())
    message = str(err.value)
    assert message.startswith(
        "load_state_dict: the state was converted from another calibration: node 'quantize_per_tensor' (the value of "
        "'input_1') has scale "
    )
    scale_a, scale_b = scales(a.state_dict()[BUFFER])[0].item(), scales(b.state_dict()[BUFFER])[0].item()
    assert f"scale {scale_a:.8g}" in message and f"scale {scale_b:.8g}" in message and scale_a != scale_b
    assert "convert from the same calibration" in message and "lucid_fx.save / lucid_fx.load" in message
    with torch.no_grad():
        assert torch.equal(a(x), before)  # nothing was loaded


def test_a_state_of_another_shape_is_refused():
    _, a, _ = two_calibrations()
    state = a.state_dict()
    state[BUFFER] = state[BUFFER][:1]
    with pytest.raises(ValueError, match=r"'_lucid_activation_qparams' has shape \(1, 4\), this converted model \(\d+, 4\)"):
        a.load_state_dict(state)


def test_the_same_calibration_loads_and_keeps_working():
    model = mlp()
    prepared = calibrated(model, batches())
    a, b = lucid_fx.convert(prepared), lucid_fx.convert(prepared)
    x = torch.randn(4, 8)
    assert str(a.load_state_dict(b.state_dict())) == "<All keys matched successfully>"
    assert torch.equal(a(x), b(x))


def test_the_guard_survives_deepcopy_save_load_to_and_nesting():
    _, a, b = two_calibrations()
    x = torch.randn(4, 8)
    buffer = io.BytesIO()
    lucid_fx.save(a, buffer)  # the guard is lucid_fx's own hook: saving is not refused for it
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    assert torch.equal(loaded(x), a(x)) and torch.equal(loaded.state_dict()[BUFFER], a.state_dict()[BUFFER])
    for copy_of_a in (copy.deepcopy(a), loaded, copy.deepcopy(a).to("cpu"), copy.deepcopy(a).half()):
        with pytest.raises(ValueError, match="converted from another calibration"):
            copy_of_a.load_state_dict(b.state_dict())
    # .half() casts floating buffers: the scales, kept by their bits, are not rounded by it.
    assert torch.equal(copy.deepcopy(a).half().state_dict()[BUFFER], a.state_dict()[BUFFER])
    outer, other = nn.Sequential(copy.deepcopy(a)), nn.Sequential(b)
    with pytest.raises(ValueError, match=r"converted from another calibration of '0': node 'quantize_per_tensor'"):
        outer.load_state_dict(other.state_dict())


# --- inputs the kernels cannot take: named at the node, or at convert ------------------------


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4)).eval()


def test_wrong_channel_count_names_the_conv_node():
    qmodel = lucid_fx.convert(calibrated(conv_net(), batches(shape=(2, 3, 8, 8))))
    # Before: "could not create a primitive descriptor for the convolution forward propagation primitive".
    with pytest.raises(KernelInputError) as err:
        qmodel(torch.randn(2, 4, 8, 8))
    assert str(err.value) == (
        "lucid_fx.conv2d at node 'conv2d' (computing '_1'): the input has 4 channels and the layer takes 3; "
        "feed inputs laid out (N, C, H, W) with the channel count the float model takes"
    )


@pytest.mark.parametrize("mode", MODES)
def test_complex_input_names_the_boundary(mode):
    qmodel = lucid_fx.convert(calibrated(mlp(), batches()), reference=MODES[mode])
    # Before: the imaginary part was dropped (a warning from torch) and an answer came back.
    with pytest.raises(KernelInputError, match=r"^lucid_fx.quantize_per_tensor at node 'quantize_per_tensor' \(computing "
                       r"'input_1'\): the value is torch.complex64; the int8 grid holds real numbers"):
        qmodel(torch.randn(2, 8, dtype=torch.complex64))


def test_weight_on_meta_is_refused_at_convert():
    prepared = calibrated(mlp(), batches())
    prepared.get_submodule("2").weight = nn.Parameter(torch.empty(4, 16, device="meta"))
    # Before: RuntimeError "Tensor.item() cannot be called on meta tensors" from inside an observer.
    with pytest.raises(ValueError) as err:
        lucid_fx.convert(prepared)
    assert str(err.value).startswith(
        "convert: parameter '2.weight' (read by node '_2') is on the meta device, so it holds no values to quantize"
    )


def test_int8_weight_moved_to_meta_after_convert_names_the_node():
    qmodel = lucid_fx.convert(calibrated(mlp(), batches()))
    qmodel._lucid_2_qweight = qmodel._lucid_2_qweight.to("meta")
    # Before: the kernel's shape-only meta path ran and returned uninitialised memory as the answer.
    with pytest.raises(KernelInputError, match=r"^lucid_fx.linear at node 'linear_1' \(computing '_2'\): 1 of its 4 tensor "
                       "inputs are on the meta device"):
        qmodel(torch.randn(2, 8))
