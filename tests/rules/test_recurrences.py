"""lucid_fx/rules/recurrences.py: an unrolled linear recurrence (a selective scan) runs float with its
coefficients and read-out; residual streams, rotary embeddings and short chains are no recurrence."""

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
import lucid_fx.passes.choose_observers as choose_observers
from lucid_fx import _meta
from lucid_fx.quantization import QConfigMapping, default_qconfig, get_default_qconfig_mapping
from lucid_fx.rules.observers import DecisionKind
from lucid_fx.rules.recurrences import MIN_STEPS, RECURRENCE_WHY, recurrence_nodes


class Scan(nn.Module):
    """Mamba's mixer as transformers runs it on a CPU: a selective scan unrolled over the tokens, between
    int8 linears (in, dt, out); the decay ``exp(A * dt)`` lies just below 1."""

    def __init__(self, d=32, inner=64, state=8, tokens=12):
        super().__init__()
        self.tokens, self.state = tokens, state
        self.in_proj, self.x_proj = nn.Linear(d, 2 * inner), nn.Linear(inner, 4 + 2 * state)
        self.dt_proj, self.out_proj = nn.Linear(4, inner), nn.Linear(inner, d, bias=False)  # the output is the scan's
        nn.init.constant_(self.dt_proj.bias, -4.0)  # softplus(-4) ~ 0.018: Mamba's small steps
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))

    def forward(self, x):  # x: (batch, tokens, d)
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        return self.scan(F.silu(u), gate)

    def scan(self, u, gate):
        dt_in, B, C = self.x_proj(u).split([4, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt_in)).transpose(1, 2)  # (batch, inner, tokens)
        A = -torch.exp(self.A_log)
        decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (batch, inner, tokens, state)
        drive = dt[:, :, :, None] * B[:, None, :, :] * u.transpose(1, 2)[:, :, :, None]
        s = torch.zeros(u.shape[0], u.shape[-1], self.state)
        outputs = []
        for i in range(self.tokens):
            s = decay[:, :, i, :] * s + drive[:, :, i, :]
            outputs.append(torch.matmul(s, C[:, i, :].unsqueeze(-1))[:, :, 0])
        y = torch.stack(outputs, dim=-1).transpose(1, 2)  # (batch, tokens, inner)
        return self.out_proj(y * F.silu(gate))


class ConvScan(Scan):
    """transformers' Mamba: one half of the input projection through a depthwise conv1d (int8), the other the
    scan's gate (float): the chunk both halves are items of is read by both."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(64, 64, 3, padding=2, groups=64)

    def forward(self, x):
        u, gate = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # (batch, inner, tokens)
        u = F.silu(self.conv(u)[..., : x.shape[1]]).transpose(1, 2)
        return self.scan(u, gate.transpose(1, 2))


def test_a_value_int8_ops_read_too_stays_int8():
    torch.manual_seed(0)
    model = ConvScan().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(_batches(1)[0],))
    region = {n.name for n in recurrence_nodes(prepared.graph)}
    ops = {n.name: n.meta[_meta.OP].op for n in prepared.graph.nodes if _meta.OP in n.meta}
    assert "chunk" not in {ops.get(name) for name in region}, "the chunk feeds the int8 conv1d too"
    assert sum(ops.get(name) == "add" for name in region) == 12, "the scan's steps are float"
    lucid_fx.calibrate(prepared, _batches(8), progress=False)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report
    convs = [str(n.target) for n in qmodel.graph.nodes if n.op == "call_function" and "conv" in str(n.target)]
    assert convs == ["lucid_fx.conv2d"], convs  # the int8 convolution (conv1d runs as height 1)
    assert report.int8_flop_share > 0.9, report.int8_flop_share


def _batches(n, seed=0, tokens=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, tokens, 32, generator=g) for _ in range(n)]


def _quantized(mapping=None):
    torch.manual_seed(0)
    model = Scan().eval()
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(_batches(1)[0],))
    lucid_fx.calibrate(prepared, _batches(8), progress=False)
    return model, prepared, lucid_fx.convert(prepared)


def _decisions(prepared):
    return {n.name: n.meta[_meta.DECISION] for n in prepared.graph.nodes if _meta.DECISION in n.meta}


def test_a_selective_scan_runs_float_between_int8_linears(sqnr_db, monkeypatch):
    model, prepared, qmodel = _quantized()
    decisions = _decisions(prepared)
    recurrent = {name for name, d in decisions.items() if d.reason == RECURRENCE_WHY}
    ops = {n.name: n.meta[_meta.OP].op for n in prepared.graph.nodes if _meta.OP in n.meta}
    assert all(decisions[name].kind is DecisionKind.FLOAT or decisions[name].keep_float for name in recurrent)
    # every step of the scan (12 products, 12 sums), every read-out product, the stack, the decay's exp
    assert sum(ops[name] == "mul" for name in recurrent) >= 12 and sum(ops[name] == "add" for name in recurrent) == 12
    assert sum(ops[name] == "matmul" for name in recurrent) == 12
    assert {"stack", "exp", "softplus"} <= {ops[name] for name in recurrent}
    # the linears stay int8; out_proj reads the float tail quantized once
    report = qmodel.lucid_fx_convert_report
    assert report.int8_flop_share > 0.9, report.int8_flop_share
    # the report gives the scan one line (GROUPED or more regions of one reason), not one per node
    scan = [r for r in report.float_regions if r.why == RECURRENCE_WHY]
    lines = [line for line in str(report).splitlines() if f" ({RECURRENCE_WHY}, " in line]  # not "input of quantized x (...)"
    assert len(scan) >= 30 and lines == [lines[0]] and f", ... ({len(scan)} nodes) (" in lines[0], str(report)
    linears = [n for n in qmodel.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert len(linears) == 4, [str(n.target) for n in qmodel.graph.nodes]
    x = _batches(4, seed=100)
    with torch.no_grad():
        float_scan_db = min(sqnr_db(model(b), qmodel(b)) for b in x)
    monkeypatch.setattr(choose_observers, "recurrence_nodes", lambda graph: frozenset())  # the scan in int8, as before
    _, prepared_int8, int8_scan = _quantized()
    assert not any(d.reason == RECURRENCE_WHY for d in _decisions(prepared_int8).values())
    with torch.no_grad():
        int8_scan_db = min(sqnr_db(model(b), int8_scan(b)) for b in x)
    # 16.0 against 10.4 dB here; hidden 768, 64 tokens, transformers' Mamba: 7.5 against 2.3 (docs/policies.md)
    assert float_scan_db > int8_scan_db + 4, (float_scan_db, int8_scan_db)


def test_an_op_a_qconfig_names_stays_int8():
    mapping = get_default_qconfig_mapping().set_object_type(torch.add, default_qconfig)
    _, prepared, _ = _quantized(mapping)
    decisions = _decisions(prepared)
    ops = {n.name: n.meta[_meta.OP].op for n in prepared.graph.nodes if _meta.OP in n.meta}
    adds = [name for name, op in ops.items() if op == "add"]
    assert adds and all(decisions[name].reason != RECURRENCE_WHY for name in adds)
    assert any(decisions[name].reason == RECURRENCE_WHY for name, op in ops.items() if op == "mul")


def _traced_recurrence(fn, *shapes):
    gm = lucid_fx.prepare(_Wrap(fn).eval(), QConfigMapping(), example_inputs=tuple(torch.randn(s) for s in shapes))
    ops = {n: n.meta[_meta.OP].op for n in gm.graph.nodes if _meta.OP in n.meta}
    return sorted(ops[n] for n in recurrence_nodes(gm.graph))


class _Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.lin = nn.Linear(16, 16)

    def forward(self, *args):
        return self.fn(self, *args)


def test_a_running_sum_is_a_recurrence_and_its_short_form_is_not():
    def running(m, x, steps):  # s = s + x_t, t < steps
        s = x[:, 0]
        for i in range(1, steps):
            s = s + x[:, i]
        return m.lin(s)

    found = _traced_recurrence(lambda m, x: running(m, x, MIN_STEPS + 1), (2, MIN_STEPS + 1, 16))
    assert found == ["add"] * MIN_STEPS + ["getitem"] * (MIN_STEPS + 1)  # the sums and the slices they read
    assert _traced_recurrence(lambda m, x: running(m, x, MIN_STEPS), (2, MIN_STEPS, 16)) == []


def test_residual_streams_and_rotary_embeddings_are_no_recurrence():
    def residual(m, x):  # each branch is computed from the stream: no linear recurrence
        for _ in range(12):
            x = x + m.lin(F.layer_norm(x, (16,))) * 0.5
        return x

    def rotary(m, q, cos, sin):
        half = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
        return m.lin(q * cos + half * sin)

    assert _traced_recurrence(residual, (2, 16)) == []
    assert _traced_recurrence(rotary, (2, 16), (2, 16), (2, 16)) == []
