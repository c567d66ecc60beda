"""The checks at the lucid_fx::* op boundary: inputs the kernels cannot take are KernelInputErrors
naming the op, what is wrong and what to do (before oneDNN answers "could not create a primitive
descriptor", or returns garbage), and float values entering the int8 grid must be finite."""

import pytest
import torch
from torch import fx

from lucid_fx.kernels import checks, finite, use_onednn
from lucid_fx.kernels.checks import KernelInputError

ops = torch.ops.lucid_fx
U8 = torch.uint8


def codes(*shape, dtype=U8, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def weight(*shape):
    return torch.randint(-64, 64, shape, generator=torch.Generator().manual_seed(1), dtype=torch.int8), torch.full((shape[0],), 0.01)


QW, WS = weight(3, 8)
CW, CS = weight(8, 3, 3, 3)
GEOMETRY = ([1, 1], [1, 1], [1, 1], 1)


def linear(qx, qw=QW, ws=WS, bias=None):
    return ops.linear(qx, 0.1, 3, qw, ws, bias, 0.1, 0, "none", None)


def conv2d(qx, qw=CW, groups=1):
    return ops.conv2d(qx, 0.1, 3, qw, CS, None, [1, 1], [1, 1], [1, 1], groups, 0.1, 0, "none", None)


FEED_FLOAT = "a converted model takes float tensors and quantizes them itself"
# (call, the message it must give): each was a raw oneDNN error or a wrong result before.
CASES = {
    "linear int32 codes": (lambda: linear(codes(2, 8, dtype=torch.int32)),  # was "qlinear with mkldnn tensor: ..."
                           f"lucid_fx.linear: the input is torch.int32, and int8 kernels read uint8 or int8 codes; {FEED_FLOAT}"),
    "linear float input": (lambda: linear(torch.randn(2, 8)),
                           "lucid_fx.linear: the input is torch.float32, and int8 kernels read uint8 or int8 codes"),
    "linear wrong K": (lambda: linear(codes(2, 7)),  # was "could not create a primitive descriptor"
                       "lucid_fx.linear: the input's last dim has 7 features and the weight (3, 8) takes 8"),
    "linear float weight": (lambda: linear(codes(2, 8), qw=QW.float()),
                            "lucid_fx.linear: the weight is torch.float32, not int8 codes"),
    "linear too few scales": (lambda: linear(codes(2, 8), ws=WS[:2]),  # was silently wrong codes
                              "lucid_fx.linear: 2 weight scales for 3 output channels; pass one scale per output channel"),
    "linear bias length": (lambda: linear(codes(2, 8), bias=torch.zeros(5)),
                           "lucid_fx.linear: a bias of 5 values for 3 output channels"),
    "linear meta weight": (lambda: linear(codes(2, 8), qw=QW.to("meta")),  # was uninitialised memory as the result
                           "lucid_fx.linear: 1 of its 3 tensor inputs are on the meta device, which holds no data, and the "
                           "others on cpu; load real weights into the model"),
    "conv2d wrong channels": (lambda: conv2d(codes(1, 4, 8, 8)),  # was "could not create a primitive descriptor"
                              "lucid_fx.conv2d: the input has 4 channels and the layer takes 3; feed inputs laid out (N, C, H, W)"),
    "conv2d wrong rank": (lambda: conv2d(codes(3, 8, 8)),
                          "lucid_fx.conv2d: the input has shape (3, 8, 8), and this kernel takes a batched 4-D (N, C, H, W) input"),
    "conv2d int32 codes": (lambda: conv2d(codes(1, 3, 8, 8, dtype=torch.int32)),
                           "lucid_fx.conv2d: the input is torch.int32"),
    "conv2d meta weight": (lambda: conv2d(codes(1, 3, 8, 8), qw=CW.to("meta")),  # was zeros as the result
                           "lucid_fx.conv2d: 1 of its 3 tensor inputs are on the meta device"),
    "conv2d grouped channels": (lambda: conv2d(codes(1, 6, 8, 8), qw=CW, groups=3),
                                "lucid_fx.conv2d: the input has 6 channels and the layer takes 9"),
    "conv1d wrong channels": (lambda: ops.conv1d(codes(1, 4, 8), 0.1, 3, CW[:, :, 0], CS, None, [1], [1], [1], 1, 0.1, 0,
                                                 "none", None),
                              "lucid_fx.conv1d: the input has 4 channels and the layer takes 3; feed inputs laid out (N, C, L)"),
    "conv2d_add int32 residual": (lambda: ops.conv2d_add(codes(1, 3, 8, 8), 0.1, 3, CW, CS, None, *GEOMETRY,
                                                         codes(1, 8, 8, 8, dtype=torch.int32), 0.1, 0, 0.1, 0, "none", None),
                                  "lucid_fx.conv2d_add: the residual input is torch.int32"),
    "add int32": (lambda: ops.add(codes(2, 8, dtype=torch.int32), 0.1, 0, codes(2, 8), 0.1, 0, 0.1, 0, "none"),  # was int32 garbage
                  "lucid_fx.add: the input 0 is torch.int32"),
    "mul float": (lambda: ops.mul(codes(2, 8), 0.1, 0, torch.randn(2, 8), 0.1, 0, 0.1, 0, "none"),  # was TypeError (iinfo)
                  "lucid_fx.mul: the input 1 is torch.float32"),
    "matmul int32": (lambda: ops.matmul(codes(2, 8, dtype=torch.int32), 0.1, 0, codes(8, 2), 0.1, 0, 0.1, 0),
                     "lucid_fx.matmul: the input 0 is torch.int32"),
    "softmax int32": (lambda: ops.softmax(codes(2, 8, dtype=torch.int32), 0.1, 0, -1, 1 / 256, 0),
                      "lucid_fx.softmax: the input is torch.int32"),
    "masked_softmax int32 scores": (lambda: ops.masked_softmax(codes(2, 8, dtype=torch.int32), 0.1, 0, torch.zeros(2, 8, dtype=torch.bool),
                                                              float("-inf"), -1, 1 / 256, 0),
                                    "lucid_fx.masked_softmax: the scores tensor is torch.int32"),
    "softmax_matmul float values": (lambda: ops.softmax_matmul(codes(2, 8), 0.1, 0, None, None, torch.randn(8, 3), 0.1, 0, 0.1, 0),
                                    "lucid_fx.softmax_matmul: the values tensor is torch.float32"),
    "lut int32": (lambda: ops.lut(codes(2, 8, dtype=torch.int32), torch.zeros(256, dtype=U8)),
                  "lucid_fx.lut: the input is torch.int32"),
    "cat mixed": (lambda: ops.cat([codes(2, 8), codes(2, 8, dtype=torch.int32)], [0.1, 0.1], [0, 0], 0, 0.1, 0),
                  "lucid_fx.cat: the input 1 is torch.int32"),
    "avg_pool2d 2-D": (lambda: ops.avg_pool2d(codes(8, 8), 0.1, 0, [2, 2], [], [0, 0], False, True, 0.1, 0),
                       "lucid_fx.avg_pool2d: the input has shape (8, 8), and this kernel takes 3 or 4-D"),
    "adaptive_avg_pool2d int32": (lambda: ops.adaptive_avg_pool2d(codes(1, 3, 8, 8, dtype=torch.int32), 0.1, 0, [1, 1], 0.1, 0),
                                  "lucid_fx.adaptive_avg_pool2d: the input is torch.int32"),
    "mean int32": (lambda: ops.mean(codes(2, 8, dtype=torch.int32), 0.1, 0, [1], False, 0.1, 0),
                   "lucid_fx.mean: the input is torch.int32"),
    "max_pool2d float": (lambda: ops.max_pool2d(torch.randn(1, 3, 8, 8), [2, 2], [], [0, 0], [1, 1], False),
                         "lucid_fx.max_pool2d: the input is torch.float32"),
    "dequantize float": (lambda: ops.dequantize_per_tensor(torch.randn(3), 0.1, 0),  # was (x - zp) * scale of floats
                         "lucid_fx.dequantize_per_tensor: the codes are torch.float32, and dequantize reads integer codes"),
    "dequantize_per_channel float": (lambda: ops.dequantize_per_channel(torch.randn(3, 2), WS, torch.zeros(3, dtype=torch.int64), 0),
                                     "lucid_fx.dequantize_per_channel: the codes are torch.float32"),
    "quantize complex": (lambda: ops.quantize_per_tensor(torch.randn(3, dtype=torch.complex64), 0.1, 0, 0, 255, U8),  # was the real part, silently
                         "lucid_fx.quantize_per_tensor: the value is torch.complex64; the int8 grid holds real numbers"),
}


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "int_mm"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_input_the_kernel_cannot_take_is_named(name, onednn):
    call, message = CASES[name]
    with use_onednn(onednn), pytest.raises(KernelInputError) as err:
        call()
    assert str(err.value).startswith(message), str(err.value)
    assert isinstance(err.value, ValueError)


def test_good_inputs_pass_the_checks():
    assert linear(codes(2, 8)).shape == (2, 3)
    assert conv2d(codes(1, 3, 8, 8)).shape == (1, 8, 8, 8)
    assert ops.add(codes(2, 8), 0.1, 0, codes(2, 8, dtype=torch.int8), 0.1, 0, 0.1, 0, "none").dtype == U8  # mixed 8-bit grids are fine
    assert ops.dequantize_per_tensor(codes(3, dtype=torch.int32), 0.5, 1).dtype == torch.float32  # int32 codes dequantize


# --- non-finite values at the float-to-int8 boundary ------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_quantize_refuses_non_finite_values_and_counts_them(bad):
    x = torch.randn(4, 5)
    x[1, 2] = bad
    x[3, 0] = bad
    # Before: NaN became code 0 and inf code 255, finite numbers with no trace of the problem.
    with pytest.raises(KernelInputError) as err:
        ops.quantize_per_tensor(x, 0.1, 3, 0, 255, U8)
    assert str(err.value).startswith(
        "lucid_fx.quantize_per_tensor: the tensor cannot enter the int8 grid: it holds NaN or ±inf in 2 of its 20 elements"
    )
    assert "torch.nan_to_num" in str(err.value) and "QConfigMapping" in str(err.value)


def test_quantize_per_channel_refuses_non_finite_values():
    w = torch.randn(3, 4)
    w[0, 0] = float("nan")
    with pytest.raises(KernelInputError, match="quantize_per_channel: the tensor cannot enter the int8 grid: it holds NaN or ±inf in 1 of its 12 elements"):
        ops.quantize_per_channel(w, WS, torch.zeros(3, dtype=torch.int64), 0, -128, 127, torch.int8)


def test_finite_extremes_and_empty_tensors_pass():
    big = torch.tensor([3.0e38, -3.0e38, 0.0])  # finite, though a sum of them would overflow
    assert ops.quantize_per_tensor(big, 0.1, 3, 0, 255, U8).tolist() == [255, 0, 3]
    assert ops.quantize_per_tensor(torch.empty(0, 4), 0.1, 3, 0, 255, U8).shape == (0, 4)


def test_the_asynchronous_path_asserts_without_a_host_sync(monkeypatch):
    # CUDA runs the check as torch._assert_async (no host sync); on CPU that op raises at once,
    # so the CUDA branch's logic runs here when the check believes it is on a device.
    monkeypatch.setattr(checks, "is_async", lambda tensor: True)
    ops.quantize_per_tensor(torch.randn(8), 0.1, 3, 0, 255, U8)  # finite: the assert holds
    with pytest.raises(RuntimeError) as err:
        ops.quantize_per_tensor(torch.tensor([1.0, float("nan")]), 0.1, 3, 0, 255, U8)
    assert str(err.value) == (
        "lucid_fx.quantize_per_tensor: NaN or ±inf in the tensor; clean it (torch.nan_to_num) or keep that part float"
    )


def test_the_asynchronous_message_fits_cuda_s_buffer(monkeypatch):
    # torch's CUDA _assert_async copies the message into 256 bytes and refuses a longer one: a long
    # node name is cut, on a character boundary.
    node = fx.Graph().placeholder("x" * 300)
    node.meta["lucid_fx.source"] = "é" * 300
    monkeypatch.setattr(checks, "calling_node", lambda: node)
    message = finite._short_nonfinite_message("quantize_per_tensor", torch.zeros(1))
    assert message.startswith("lucid_fx.quantize_per_tensor: NaN or ±inf in the value of node 'éééé")
    assert 240 <= len(message.encode()) <= finite.ASYNC_MESSAGE_BYTES < 256
