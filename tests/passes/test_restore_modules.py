"""restore_modules: an exported graph's functional layers on their own parameters become module
calls again, sharing the tensors; anything else is left as it is."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lucid_fx.passes.export_model import export_model


def _calls(gm):
    return [(n.op, n.target if n.op == "call_module" else getattr(n.target, "__name__", n.target))
            for n in gm.graph.nodes if n.op in ("call_module", "call_function")]


def test_conv_batch_norm_and_linear_become_modules_sharing_the_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(64, 5)).eval()
    model[1].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    gm = export_model(model, (x,))
    assert _calls(gm) == [("call_module", "0"), ("call_module", "1"), ("call_function", "relu"),
                          ("call_function", "flatten"), ("call_module", "4")]
    assert type(gm.get_submodule("0")) is nn.Conv2d and gm.get_submodule("0").stride == (2, 2)
    assert type(gm.get_submodule("1")) is nn.BatchNorm2d and type(gm.get_submodule("4")) is nn.Linear
    assert torch.equal(gm.get_submodule("1").running_mean, model[1].running_mean)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x))


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.w) + self.w.sum()  # the weight is also read elsewhere: stays functional


def test_a_parameter_read_elsewhere_keeps_the_functional_call():
    gm = export_model(SharedWeight().eval(), (torch.randn(2, 4),))
    assert ("call_function", "linear") in _calls(gm)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)


class Recurrent(nn.Module):
    """An embedding, a two-layer bi-LSTM whose state is read, a GRU, and a GRUCell and LSTMCell a step."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(32, 12)
        self.gru_cell, self.lstm_cell = nn.GRUCell(12, 12), nn.LSTMCell(12, 6)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        seq, _ = self.gru(out)
        step = self.gru_cell(seq[:, -1], h[-1, :, :12])
        hc = self.lstm_cell(step)
        return hc[0].sum() + c.sum() + step


class Elman(nn.Module):
    """nn.RNN with relu and with tanh, and an nn.RNNCell: torch.rnn_relu / torch.rnn_tanh / torch.rnn_tanh_cell."""

    def __init__(self):
        super().__init__()
        self.relu_rnn, self.tanh_rnn = nn.RNN(8, 16, nonlinearity="relu"), nn.RNN(16, 8, batch_first=True)
        self.cell = nn.RNNCell(8, 8, nonlinearity="tanh")

    def forward(self, x):
        out, h = self.relu_rnn(x)
        seq, _ = self.tanh_rnn(out)
        return self.cell(seq[-1]) + h.sum()


def test_elman_rnns_become_modules_with_their_nonlinearity():
    torch.manual_seed(2)
    model, x = Elman().eval(), torch.randn(4, 3, 8)
    gm = export_model(model, (x,))
    modules = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    assert {name: (type(m), m.nonlinearity) for name, m in modules.items()} == {
        "relu_rnn": (nn.RNN, "relu"), "tanh_rnn": (nn.RNN, "tanh"), "cell": (nn.RNNCell, "tanh")}
    assert modules["tanh_rnn"].batch_first and modules["cell"].weight_ih is model.cell.weight_ih
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


class Projected(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, proj_size=6, num_layers=2, bidirectional=True)

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        return out.sum(0) + h.sum(0).repeat(1, 2) + c.mean()


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_a_projected_lstm_becomes_its_module_with_its_proj_size():
    # torch.lstm's params hold weight_hr_l0 after each layer and direction's biases: its proj_size and hidden size
    torch.manual_seed(3)
    model, x = Projected().eval(), torch.randn(5, 2, 8)
    gm = export_model(model, (x,))
    (rnn,) = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert type(rnn) is nn.LSTM and (rnn.hidden_size, rnn.proj_size, rnn.num_layers) == (16, 6, 2) and rnn.bidirectional
    assert rnn.weight_hr_l1_reverse is model.rnn.weight_hr_l1_reverse
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_recurrent_layers_become_modules_with_their_items():
    # torch.export writes nn.LSTM as torch.lstm(x, [h0, c0], [weights], ...) returning (output, h, c), and the
    # cells as torch.gru_cell / torch.lstm_cell: each becomes its module again (which convert runs in int8).
    torch.manual_seed(1)
    model, x = Recurrent().eval(), torch.randn(3, 5, 8)
    gm = export_model(model, (x,))
    modules = {n.target: type(gm.get_submodule(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
    assert modules == {"lstm": nn.LSTM, "gru": nn.GRU, "gru_cell": nn.GRUCell, "lstm_cell": nn.LSTMCell}
    functions = {getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"}
    assert not functions & {"lstm", "gru", "gru_cell", "lstm_cell"}
    assert gm.get_submodule("lstm").bidirectional and gm.get_submodule("lstm").batch_first
    assert gm.get_submodule("lstm").weight_hh_l1_reverse is model.lstm.weight_hh_l1_reverse  # the same tensors
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))  # (h, c) items included
