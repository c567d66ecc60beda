"""quantize_dynamic's LSTM, GRU and RNN (lucid_fx/dynamic_rnn.py): accuracy against fp32 and against
torch.ao.quantization.quantize_dynamic (oracle in tests only), every input form torch takes (batch_first,
unbatched, PackedSequence, given states), the native and torch routes, state_dict and save/load, errors."""

import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx import _dynamic_recurrent
from lucid_fx.kernels import native, recurrent

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.ao's eager API announces its migration on import
    from torch.ao.quantization import quantize_dynamic as ao_quantize_dynamic

TANH, RELU = {"nonlinearity": "tanh"}, {"nonlinearity": "relu"}
KINDS = {"LSTM": (nn.LSTM, Q.DynamicQuantizedLSTM, {}), "GRU": (nn.GRU, Q.DynamicQuantizedGRU, {}),
         "RNN_TANH": (nn.RNN, Q.DynamicQuantizedRNN, TANH), "RNN_RELU": (nn.RNN, Q.DynamicQuantizedRNN, RELU)}


def _rnn(kind, seed=0, **options):
    torch.manual_seed(seed)
    cls, _, extra = KINDS[kind]
    return cls(16, 32, **extra, **options).eval()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("options", [{}, {"num_layers": 2, "bidirectional": True}, {"bias": False}],
                         ids=["one layer", "two layers both ways", "no bias"])
def test_accuracy_against_fp32_and_torch_ao(sqnr_db, kind, options):
    model = nn.Sequential(_rnn(kind, **options))  # torch.ao swaps children only
    x = torch.randn(25, 4, 16)
    ours = Q.quantize_dynamic(model)
    assert type(ours[0]) is KINDS[kind][1]
    with torch.no_grad():
        (fp32, fp32_h), (mine, mine_h) = (_output_and_h(m(x)) for m in (model, ours))
    assert mine.shape == fp32.shape and sqnr_db(fp32_h, mine_h) > 34
    if not options.get("bias", True) or kind.startswith("RNN"):  # torch.ao refuses a layer without bias ("mod.bias
        assert sqnr_db(fp32, mine) > 34  # must be True") and has no dynamic nn.RNN
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = ao_quantize_dynamic(model, {KINDS[kind][0]}, dtype=torch.qint8)
    with torch.no_grad():
        theirs, _ = _output_and_h(oracle(x))
    print(f"{kind} {options}: ours {sqnr_db(fp32, mine):.1f} dB, torch.ao {sqnr_db(fp32, theirs):.1f} dB")
    # Measured: 40.9-43.4 dB ours against torch.ao's 36.0-40.9 on these (per-row weights, an 8-bit state).
    assert sqnr_db(fp32, mine) > 34 and sqnr_db(fp32, mine) > sqnr_db(fp32, theirs)


def _output_and_h(result):
    output, state = result
    return output, state[0] if isinstance(state, tuple) else state


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_input_forms_match_the_float_layer(sqnr_db, kind):
    model = _rnn(kind, 1, batch_first=True)
    layer = Q.quantize_dynamic(model)
    x = torch.randn(3, 12, 16)
    h0 = torch.rand(1, 3, 32) - 0.5
    hx = (h0, torch.randn(1, 3, 32)) if kind == "LSTM" else h0
    with torch.no_grad():
        (want, want_state), (got, got_state) = model(x, hx), layer(x, hx)
        assert got.shape == (3, 12, 32) and sqnr_db(want, got) > 34  # batch_first in and out
        for a, b in zip(*(s if kind == "LSTM" else (s,) for s in (want_state, got_state))):
            assert a.shape == b.shape and sqnr_db(a, b) > 34
        unbatched = (h0[:, 0], hx[1][:, 0]) if kind == "LSTM" else h0[:, 0]
        one, _ = layer(x[0], unbatched)  # (T, I) with (layers, hidden) states: one sequence
        assert one.shape == (12, 32) and sqnr_db(model(x[0], unbatched)[0], one) > 34
        double, _ = layer(x.double(), hx if kind != "LSTM" else tuple(s.double() for s in hx))
        assert double.dtype == torch.float64 and sqnr_db(want.double(), double) > 34


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_packed_sequence_returns_states_in_the_callers_order(sqnr_db, kind):
    model = _rnn(kind, 2, num_layers=2, bidirectional=True)
    layer = Q.quantize_dynamic(model)
    lengths = torch.tensor([5, 9, 2, 7])  # not sorted: pack_padded_sequence sorts and keeps the order
    padded = torch.randn(9, 4, 16)
    packed = pack_padded_sequence(padded, lengths, enforce_sorted=False)
    h0 = torch.rand(4, 4, 32) - 0.5
    hx = (h0, torch.zeros(4, 4, 32)) if kind == "LSTM" else h0
    with torch.no_grad():
        (want, want_state), (got, got_state) = model(packed, hx), layer(packed, hx)
    want_h, got_h = (want_state[0], got_state[0]) if kind == "LSTM" else (want_state, got_state)
    assert torch.equal(got.batch_sizes, want.batch_sizes) and torch.equal(got.unsorted_indices, want.unsorted_indices)
    assert sqnr_db(pad_packed_sequence(want)[0], pad_packed_sequence(got)[0]) > 34
    for b in range(4):  # each sequence's final state where the caller put it: a wrong order is noise
        assert sqnr_db(want_h[:, b], got_h[:, b]) > 30


def _require_native() -> None:
    """Skip without the native kernels, but fail under .ci/run (LUCID_FX_REQUIRE_TOOLS=1) unless they were turned
    off on purpose (LUCID_FX_NATIVE=0, as the every-CPU-kind run does): both routes must run there."""
    if not native.available():
        if os.environ.get("LUCID_FX_REQUIRE_TOOLS") == "1" and os.environ.get("LUCID_FX_NATIVE", "1") != "0":
            pytest.fail(f"LUCID_FX_REQUIRE_TOOLS=1 but the native kernels did not build: {native.status()}")
        pytest.skip(f"native kernels: {native.status()}")


def test_the_native_and_torch_routes_agree(monkeypatch):
    _require_native()
    model = _rnn("LSTM", 3, num_layers=2)
    layer = Q.quantize_dynamic(model)
    x = torch.randn(20, 2, 16)
    with torch.no_grad():
        native_route = layer(x)[0]
        monkeypatch.setattr(recurrent, "_function", lambda kernel, dtype: None)  # as without the native kernels
        torch_route = layer(x)[0]
    # Their sigmoid and tanh differ by a few ulp: a state code may round the other way near a tie.
    assert float((torch_route - native_route).abs().max()) < 5e-3
    assert float((torch_route - native_route).abs().mean()) < 1e-4


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")  # the float model's
@pytest.mark.parametrize("options", [{}, {"num_layers": 2, "bidirectional": True, "batch_first": True}],
                         ids=["one layer", "two layers both ways"])
def test_a_projected_lstm_runs_int8_with_its_state_shapes(sqnr_db, options):
    # proj_size: h = W_hr (o * tanh(c)) is (.., proj_size), c (.., hidden_size). W_hr's product runs in int8, h and
    # o * tanh(c) each on its step's tight grid (measured 38.6 and 43.7 dB here; on the grid of [-1, 1] 32.6, 29.8).
    torch.manual_seed(12)
    model = nn.LSTM(16, 32, proj_size=12, **options).eval()
    layer = Q.quantize_dynamic(model)
    assert type(layer) is Q.DynamicQuantizedLSTM and layer.weight_hr_codes_l0.shape == (12, 32)
    assert "proj_size=12" in repr(layer) and "bias_hr_l0" not in layer.state_dict()
    layers = 2 * options.get("num_layers", 1) if options.get("bidirectional") else 1
    x = torch.randn(3, 20, 16) if options.get("batch_first") else torch.randn(20, 3, 16)
    hx = (torch.rand(layers, 3, 12) - 0.5, torch.randn(layers, 3, 32))
    with torch.no_grad():
        for state in (None, hx):
            (want, (want_h, want_c)), (got, (got_h, got_c)) = model(x, state), layer(x, state)
            assert got.shape == want.shape and got_h.shape == want_h.shape == (layers, 3, 12) and got_c.shape == (layers, 3, 32)
            assert sqnr_db(want, got) > 34 and sqnr_db(want_h, got_h) > 34 and sqnr_db(want_c, got_c) > 34
        twin = Q.DynamicQuantizedLSTM(16, 32, proj_size=12, **options)
        twin.load_state_dict(layer.state_dict())
        assert torch.equal(twin(x)[0], layer(x)[0])


def test_a_relu_rnn_s_state_past_one_keeps_its_grid_step_by_step(sqnr_db):
    # A relu RNN's state has no bound: here it grows past 2. Each step's grid covers it (max(1, |h|)); the
    # fixed grid of [-1, 1] the tanh cells use would clip it.
    torch.manual_seed(11)
    model = nn.RNN(8, 16, nonlinearity="relu").eval()
    with torch.no_grad():
        model.weight_hh_l0.copy_(torch.eye(16) * 0.6 + torch.randn(16, 16) * 0.02)
        model.bias_ih_l0.fill_(0.5)
    layer = Q.quantize_dynamic(model)
    x = torch.rand(30, 2, 8)
    with torch.no_grad():
        (want, want_h), (got, got_h) = model(x), layer(x)
    print(f"relu RNN: state up to {float(want.amax()):.2f}, {sqnr_db(want, got):.1f} dB")
    assert float(want.amax()) > 2 and sqnr_db(want, got) > 30 and sqnr_db(want_h, got_h) > 30  # 35.5 dB (AVX512-VNNI)
    assert repr(layer) == "DynamicQuantizedRNN(8, 16, activation=quint8, nonlinearity='relu')"


def test_weights_are_per_row_int8_and_the_state_grid_is_fixed():
    model = _rnn("GRU", 4)
    layer = Q.quantize_dynamic(model)
    codes = layer.weight_hh_codes_l0
    assert codes.dtype == torch.int8 and codes.shape == (96, 32)
    # per row: each row's largest weight lands on the grid's edge
    scale = layer.weight_hh_scale_l0
    torch.testing.assert_close(codes.float() * scale[:, None], model.weight_hh_l0.detach(), atol=float(scale.max()) / 2 + 1e-7, rtol=0)
    assert int(codes.abs().amax(1).min()) >= 63
    assert recurrent.state_grid(None) == (1 / 127, 127.0)
    assert "32, 32, activation=quint8" not in repr(layer) and repr(layer) == "DynamicQuantizedGRU(16, 32, activation=quint8)"


def test_state_dict_round_trip_refreshes_the_packed_weights():
    first, second = Q.quantize_dynamic(_rnn("LSTM", 5)), Q.quantize_dynamic(_rnn("LSTM", 6))
    x = torch.randn(10, 2, 16)
    with torch.no_grad():
        before = second(x)[0]  # packs second's own weights
        second.load_state_dict(first.state_dict())
        assert torch.equal(second(x)[0], first(x)[0]) and not torch.equal(before, first(x)[0])
    assert {"weight_ih_codes_l0", "weight_hh_scale_l0", "bias_hh_l0"} <= set(first.state_dict())


def test_save_and_load(tmp_path):
    model = nn.Sequential(nn.Embedding(50, 16), _rnn("GRU", 7, batch_first=True, bidirectional=True))
    qmodel = Q.quantize_dynamic(model)
    tokens = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        before = qmodel(tokens)[0]  # a model that has run (its packed weights built) saves as one that has not
    lucid_fx.save(qmodel, tmp_path / "rnn.pt")
    loaded = lucid_fx.load(tmp_path / "rnn.pt")
    with torch.no_grad():
        assert type(loaded[1]) is Q.DynamicQuantizedGRU and torch.equal(loaded(tokens)[0], before)


class Stack(nn.Module):
    """A projected LSTM, a relu RNN and a relu RNNCell: what each keeps beyond its buffers (proj_size, nonlinearity)."""

    def __init__(self):
        super().__init__()
        self.lstm, self.rnn = nn.LSTM(8, 16, proj_size=4, num_layers=2), nn.RNN(4, 8, nonlinearity="relu")
        self.cell = nn.RNNCell(8, 8, nonlinearity="relu")

    def forward(self, x):
        y, _ = self.lstm(x)
        z, h = self.rnn(y)
        return self.cell(z[-1], h[0])


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_save_and_load_keep_proj_size_and_nonlinearity(tmp_path):
    torch.manual_seed(13)
    qmodel = Q.quantize_dynamic(Stack().eval())
    x = torch.randn(5, 2, 8)
    with torch.no_grad():
        before = qmodel(x)
    lucid_fx.save(qmodel, tmp_path / "stack.pt", allow=[Stack])
    loaded = lucid_fx.load(tmp_path / "stack.pt", allow=[Stack])
    assert (loaded.lstm.proj_size, loaded.rnn.nonlinearity, loaded.cell.nonlinearity) == (4, "relu", "relu")
    with torch.no_grad():
        assert torch.equal(loaded(x), before)


def test_selection_keeps_what_is_asked_float():
    model = nn.Sequential(_rnn("LSTM"), _rnn("GRU"))
    names = lambda m: [type(c).__name__ for c in m]  # noqa: E731
    assert names(Q.quantize_dynamic(model)) == ["DynamicQuantizedLSTM", "DynamicQuantizedGRU"]
    assert names(Q.quantize_dynamic(model, {nn.GRU})) == ["LSTM", "DynamicQuantizedGRU"]
    assert names(Q.quantize_dynamic(model, {nn.LSTM: Q.default_dynamic_qconfig, "0": None})) == ["LSTM", "GRU"]
    assert names(model) == ["LSTM", "GRU"]  # the input is untouched


def test_bad_inputs_are_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LSTM(4, 16)))
    kept = Q.quantize_dynamic(model, {nn.Linear: Q.default_dynamic_qconfig, nn.LSTM: Q.default_dynamic_qconfig, "1.0": None})
    assert type(kept[0]) is Q.DynamicQuantizedLinear and type(kept[1][0]) is nn.LSTM  # a name's None keeps it float
    with pytest.raises(ValueError, match=r"proj_size must be in \[0, hidden_size\), got 16 with hidden_size 16"):
        Q.DynamicQuantizedLSTM(4, 16, proj_size=16)
    four_bits = Q.QConfig(Q.PlaceholderObserver.with_args(qdtype=Q.QDtype("quint4", 4, False, 0, 15, torch.uint8)),
                          Q.default_dynamic_qconfig.weight)
    with pytest.raises(ValueError, match=r"quantize_dynamic: activations are quantized to quint8 or qint8, the QConfig asks for"):
        Q.quantize_dynamic(nn.Sequential(nn.GRU(4, 8)), {nn.GRU: four_bits})
    lstm = Q.quantize_dynamic(nn.LSTM(4, 8))
    with pytest.raises(ValueError, match=r"DynamicQuantizedLSTM: input has 3 features \(last dim\), the layer expects 4"):
        lstm(torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match=r"DynamicQuantizedLSTM: hx must be a pair \(h_0, c_0\)"):
        lstm(torch.randn(5, 2, 4), torch.zeros(1, 2, 8))
    with pytest.raises(ValueError, match=r"expected a hidden state of shape \(1, 2, 8\), got \(1, 3, 8\)"):
        lstm(torch.randn(5, 2, 4), (torch.zeros(1, 3, 8), torch.zeros(1, 3, 8)))
    with pytest.raises(ValueError, match="DynamicQuantizedLSTM: the initial state holds inf or nan"):
        lstm(torch.randn(5, 2, 4), (torch.full((1, 2, 8), float("nan")), torch.zeros(1, 2, 8)))
    with pytest.raises(ValueError, match="DynamicQuantizedLSTM: the input holds inf or nan"):
        lstm(torch.full((5, 2, 4), float("inf")))
    gru = Q.quantize_dynamic(nn.GRU(4, 8))
    with pytest.raises(ValueError, match="DynamicQuantizedGRU: hx must be one tensor h_0"):
        gru(torch.randn(5, 2, 4), (torch.zeros(1, 2, 8),))
    with pytest.raises(ValueError, match=r"expects an input of 2 \(unbatched\) or 3 dims, got shape \(4,\)"):
        gru(torch.randn(4))


CELLS = {"LSTM": (nn.LSTMCell, Q.DynamicQuantizedLSTMCell, {}), "GRU": (nn.GRUCell, Q.DynamicQuantizedGRUCell, {}),
         "RNN_TANH": (nn.RNNCell, Q.DynamicQuantizedRNNCell, TANH), "RNN_RELU": (nn.RNNCell, Q.DynamicQuantizedRNNCell, RELU)}


def _cell(kind, *sizes):
    cls, _, extra = CELLS[kind]
    return cls(*sizes, **extra).eval()


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_a_cell_in_a_decoding_loop_follows_the_float_cell(sqnr_db, kind):
    # A seq2seq decoder's loop: the caller carries the state from step to step.
    torch.manual_seed(8)
    cell = _cell(kind, 16, 32)
    model = nn.Sequential(cell)
    ours = Q.quantize_dynamic(model)[0]
    assert type(ours) is CELLS[kind][1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = ao_quantize_dynamic(model, {CELLS[kind][0]}, dtype=torch.qint8)[0]
    xs = torch.randn(20, 3, 16)

    def decode(step):
        state, hs = None, []
        for x in xs:
            state = step(x, state)
            hs.append(state[0] if kind == "LSTM" else state)
        return torch.stack(hs)

    with torch.no_grad():
        fp32, mine, theirs = decode(cell), decode(ours), decode(oracle)
    print(f"{kind} cell: ours {sqnr_db(fp32, mine):.1f} dB, torch.ao {sqnr_db(fp32, theirs):.1f} dB")
    assert sqnr_db(fp32, mine) > 34 and sqnr_db(fp32, mine) > sqnr_db(fp32, theirs)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_a_cell_takes_a_state_past_one_and_an_unbatched_input(sqnr_db, kind):
    torch.manual_seed(9)
    cell = _cell(kind, 8, 16)
    ours = Q.quantize_dynamic(cell)
    x, h = torch.randn(4, 8), torch.randn(4, 16) * 3  # a state the caller made, past [-1, 1]: the grid covers it
    hx = (h, torch.randn(4, 16)) if kind == "LSTM" else h
    with torch.no_grad():
        want, got = cell(x, hx), ours(x, hx)
        for a, b in zip(*((want, got) if kind == "LSTM" else ((want,), (got,)))):  # h (and c)
            assert a.shape == b.shape and sqnr_db(a, b) > 34
        one = ours(x[0], tuple(s[0] for s in hx) if kind == "LSTM" else h[0])
        one_h = one[0] if kind == "LSTM" else one
        assert one_h.shape == (16,) and sqnr_db((want[0] if kind == "LSTM" else want)[0], one_h) > 34
    with pytest.raises(ValueError, match=r"expected a hidden state of shape \(4, 16\), got \(3, 16\)"):
        ours(x, (h[:3], h[:3]) if kind == "LSTM" else h[:3])


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_a_cell_call_is_one_native_call_with_the_pieces_values(monkeypatch, kind):
    _require_native()
    torch.manual_seed(10)
    ours = Q.quantize_dynamic(_cell(kind, 12, 20))
    x, h = torch.randn(3, 12), torch.randn(3, 20) * 2
    hx = (h, torch.randn(3, 20)) if kind == "LSTM" else h
    with torch.no_grad():
        ours(x, hx)  # warm: the weights packed
        calls = []
        for module, name in ((_dynamic_recurrent, "dynamic_linear"), (recurrent, "run_layer")):  # the pieces one native call replaces
            monkeypatch.setattr(module, name, lambda *a, _name=name, _fn=getattr(module, name): calls.append(_name) or _fn(*a))
        one_call = ours(x, hx)
        assert calls == []
        monkeypatch.setattr(recurrent, "run_cell", lambda *a: False)
        pieces = ours(x, hx)
        assert calls == ["dynamic_linear", "run_layer"]
        for a, b in zip(*((one_call, pieces) if kind == "LSTM" else ((one_call,), (pieces,)))):
            assert torch.equal(a, b)
        monkeypatch.undo()
        as_double = ours(x.double(), tuple(s.double() for s in hx) if kind == "LSTM" else h.double())  # the pieces' route
    got = as_double[0] if kind == "LSTM" else as_double
    assert got.dtype == torch.float64 and float((got - (one_call[0] if kind == "LSTM" else one_call)).abs().max()) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_on_a_gpu_the_torch_route_runs(sqnr_db, kind):
    # Off the CPU the steps run as torch ops (torch.ops.lucid_fx.linear: torch._int_mm on CUDA), on the device's grid.
    model = _rnn(kind, 10, num_layers=2).cuda()
    layer = Q.quantize_dynamic(model)
    x = torch.randn(12, 20, 16, device="cuda")  # 20 rows a step: torch._int_mm wants more than 16
    with torch.no_grad():
        want, got = model(x)[0], layer(x)[0]
    assert got.device.type == "cuda" and sqnr_db(want.cpu(), got.cpu()) > 34


def test_convert_and_quantize_dynamic_know_the_same_recurrent_layers():
    # rules/recurrent.py (which prepare marks) sits below dynamic_rnn.py (which builds): one list written twice.
    from lucid_fx.dynamic_rnn import RECURRENT_SWAPS
    from lucid_fx.rules.recurrent import RECURRENT_LAYERS

    assert set(RECURRENT_LAYERS) == set(RECURRENT_SWAPS) and len(RECURRENT_LAYERS) == 6
