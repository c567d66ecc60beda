"""lower_to_program rewrites the portable int8 graph into the CPU's own calls (passes/lower_to_program.py)."""

import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels.row_plan import planned_rows
from lucid_fx.kernels.target import resolve_target
from lucid_fx.passes.lower_to_program import lower_to_program, record_values
from models import ResNetLike, _init_bn
from _grid import onednn_exact
from _program import called, operands

ON = torch.ops.onednn


def _lowered(model, x):
    q = lucid_fx.quantize(model, (x,), [x, torch.randn_like(x)])
    out, values = record_values(q, (x,))
    program = lower_to_program(q, values, "cpu")
    return q, out, program


def _targets(gm):
    return [called(n) for n in gm.graph.nodes if n.op == "call_function"]


class SigmoidTanh(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        # a chain of tables (a sigmoid straight after the linear would be the linear's post-op)
        return torch.tanh(torch.sigmoid(self.fc(x) / 2))


def test_table_chains_and_the_float_boundary_become_one_lookup():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    q, out, program = _lowered(SigmoidTanh().eval(), x)
    portable = [getattr(t, "__name__", str(t)) for t in _targets(q)]
    # the chain is one table of the linear's codes at convert already (rules/one_source.py); the program
    # composes it with the dequantize after it: one float lookup
    assert portable == ["quantize_per_tensor", "linear", "lut", "dequantize_per_tensor"]
    lowered = _targets(program)
    # quantize, the linear (oneDNN's linear, a 1x1 convolution on CPUs without VNNI, or at this
    # size the row engine's planned call where the Target's row engine takes it; the exact fallback kernel where oneDNN
    # is not exact on the grid: a VNNI kind forced on an AVX2 CPU), one float lookup
    calls = (ON.qlinear_pointwise.default, ON.qconv2d_pointwise.default, planned_rows)
    assert (lowered[1] in calls) == onednn_exact(resolve_target("cpu")) and len(lowered) == 3
    assert [n.name for n in program.graph.nodes if n.op == "call_function"][-1] == "dequantize_per_tensor"
    assert torch.equal(program(x), out)


def test_residual_sum_writes_into_the_residual_codes_only_when_nothing_reads_them_later():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 32, 32)
    q, out, program = _lowered(_init_bn(ResNetLike(num_classes=10, width=8)).eval(), x)
    sums = [n for n in program.graph.nodes if called(n) is ON.qconv2d_pointwise.binary]
    residuals = sum(1 for t in _targets(q) if "conv2d_add" in str(t))
    assert residuals > 0 and len(sums) == (residuals if onednn_exact(resolve_target("cpu")) else 0)  # else fallback
    order = {n: i for i, n in enumerate(program.graph.nodes)}
    clones = 0
    for node in sums:
        accum = operands(node)[6]
        if accum.op == "call_method" and accum.target == "clone":
            clones += 1
            continue
        # oneDNN writes the sum into these codes: nothing may read them after it.
        assert accum.op != "placeholder" and all(order[u] < order[node] for u in accum.users if u is not node), accum
    assert not sums or clones < len(sums)  # the common case (a block's input read by its first conv only) needs no copy
    assert torch.equal(program(x), out)
    assert not any("lucid_fx::" in str(getattr(t, "_qualified_op_name", "")) for t in _targets(program))


def test_the_portable_graph_is_not_changed_and_unknown_devices_get_direct_calls():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    q = lucid_fx.quantize(SigmoidTanh().eval(), (x,), [x])
    before = q.code
    out, values = record_values(q, (x,))
    program = lower_to_program(q, values, "meta-device-without-rules")
    assert q.code == before
    names = [getattr(t, "__qualname__", "") for t in _targets(program)]
    assert names == ["quantize_per_tensor", "linear", "lut", "dequantize_per_tensor"]  # reference kernels
    assert torch.equal(program(x), out)


class _AddMulAttend(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        scores = torch.softmax(torch.matmul(a, b.transpose(-1, -2)), -1)
        # the mul's codes feed the last linear (a result only dequantized would run in float: fold_dequantize)
        return self.a(torch.matmul(scores, a + b) * torch.sigmoid(b))


def test_float_arithmetic_kernels_become_program_ops_with_the_same_codes():
    # add, mul, matmul and softmax on the CPU: multipliers decided once, the fast narrowing
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    q, out, program = _lowered(_AddMulAttend().eval(), x)
    names = {getattr(t, "__name__", "") for t in _targets(program)}
    assert {"add_codes", "mul_codes", "matmul_codes", "cpu_softmax_matmul"} <= names, names  # softmax(s) @ v: one call
    assert torch.equal(program(x), out)


class _SoftmaxReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        p = torch.softmax(torch.matmul(self.a(x), x.transpose(-1, -2)), -1)
        return self.a(torch.matmul(p, x) + torch.matmul(p, self.a(x)))


def test_a_softmax_read_by_two_matmuls_stays_a_softmax_on_its_fixed_grid():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    q, out, program = _lowered(_SoftmaxReadTwice().eval(), x)
    names = [getattr(t, "__name__", "") for t in _targets(program)]
    assert names.count("softmax_codes") == 1 and names.count("matmul_codes") == 3 and "cpu_softmax_matmul" not in names
    assert torch.equal(program(x), out)


class NestedNorm(nn.Module):
    """A layer norm (float where it pays) reading a submodule's parameters by name: a dotted get_attr."""

    def __init__(self):
        super().__init__()
        self.fc, self.block = nn.Linear(8, 8), nn.Module()
        self.block.weight, self.block.bias = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.nn.functional.layer_norm(self.fc(x), (8,), self.block.weight, self.block.bias)


def test_a_submodules_tensor_is_one_plain_attribute_of_the_program_the_same_tensor():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    q, out, program = _lowered(NestedNorm().eval(), x)
    portable = [n.target for n in q.graph.find_nodes(op="get_attr")]
    read = [n.target for n in program.graph.find_nodes(op="get_attr")]
    assert "block.weight" in portable and "block.bias" in portable
    # each read is one attribute lookup: no Module.__getattr__ per step of a path at every call
    assert "_program_attr_block_weight" in read and not [t for t in read if "." in t]
    assert program._program_attr_block_weight is q.block.weight
    with torch.no_grad():
        torch.testing.assert_close(program(x), out, rtol=0, atol=0)
        q.block.weight.mul_(2.0)  # an edit in place: the program reads the same tensor
        torch.testing.assert_close(program(x), q(x), rtol=0, atol=0)
        assert not torch.equal(program(x), out)
