"""plan_program_calls: a program's native calls are planned on its first call (no extra run), keep the portable
graph's codes, bind nothing afterwards, and a step refuses operands it was not planned for."""

import threading
import unittest.mock

import pytest
import torch

import lucid_fx
from lucid_fx.kernels import KernelInputError, bound_ops, conv_native, cpu_float, linear_native, native, native_squeeze_excite
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import pointwise_rows as pr
from lucid_fx.program import programs_of
from lucid_fx.rules.program_cpu import PROGRAM_PLANS_CPU
from models import EfficientNetLike, _init_bn


# What a program's forward is once planned: run_program_natively's C++ program, or the generated (class) forward.
_AFTER_PLANNING = "NativeProgram" if bound_ops.available() else "NoneType"


def _efficientnet(size=32):
    torch.manual_seed(0)
    model = _init_bn(EfficientNetLike(num_classes=10)).eval()
    data = [torch.randn(1, 3, size, size) for _ in range(3)]
    return lucid_fx.quantize(model, (data[0],), data), data[0]


def test_the_first_program_call_plans_the_native_calls_and_later_calls_bind_nothing(native_here, monkeypatch):
    q, x = _efficientnet()
    portable = q(x)  # the portable graph; the program is built
    (program,) = programs_of(q).values()
    assert "forward" in program.__dict__ and not [n for n in program.graph.nodes if "plan" in n.kwargs]
    first = q(x)  # the program's first call plans it as it runs, then runs from C++ where bound_ops is built
    assert type(program.__dict__.get("forward")).__name__ == _AFTER_PLANNING
    planned = [n for n in program.graph.nodes if n.op == "call_function" and "plan" in n.kwargs]
    kinds = {n.target for n in planned}
    assert {native_squeeze_excite.gate_mul_codes, native_squeeze_excite.global_avg_pool_codes, cpu_float.lut} <= kinds  # squeeze-excite's
    assert len(planned) >= 3 * sum(n.target is native_squeeze_excite.gate_mul_codes for n in program.graph.nodes)
    assert all(callable(getattr(program, n.kwargs["plan"].target)) for n in planned)
    seen, bind = [], native.bind
    for module in (native, linear_native, conv_native):
        monkeypatch.setattr(module, "bind", lambda kernel, *a: seen.append(kernel) or bind(kernel, *a))
    again = q(x)
    assert seen == []  # every native call went through its step: no check, no struct made again
    assert torch.equal(first, portable) and torch.equal(again, portable)


def test_without_the_native_kernels_nothing_is_planned(monkeypatch):
    monkeypatch.setattr(native, "_library", lambda: (None, "off (LUCID_FX_NATIVE=0): the torch kernels run"))
    q, x = _efficientnet()
    portable = q(x)
    (program,) = programs_of(q).values()
    assert torch.equal(q(x), portable)  # its planning call planned nothing
    assert type(program.__dict__.get("forward")).__name__ == _AFTER_PLANNING
    assert not [n for n in program.graph.nodes if "plan" in n.kwargs] and torch.equal(q(x), portable)


def test_a_program_planned_by_its_first_call_writes_a_buffer_once_a_call():
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.register_buffer("count", torch.zeros(1))

        def forward(self, x):
            self.count.add_(1)
            return self.fc(x) + self.count

    x = torch.randn(4, 8)
    prepared = lucid_fx.prepare(torch.export.export(Counter().eval(), (x,), strict=False), example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x], progress=False)
    q = lucid_fx.convert(prepared)
    outs = [q(x) for _ in range(4)]  # portable + build, then the program's planning call, then planned calls
    (program,) = programs_of(q).values()
    assert bool([n for n in program.graph.nodes if "plan" in n.kwargs]) == native.available()  # its calls planned
    steps = [float((b - a).mean()) for a, b in zip(outs, outs[1:])]
    assert steps == pytest.approx([1.0, 1.0, 1.0], abs=0.05), steps


def test_a_first_program_call_that_raises_leaves_planning_to_the_next_call(native_here):
    q, x = _efficientnet()
    portable = q(x)
    bad = x.clone()
    bad[0, 0, 3, 3] = float("nan")
    with pytest.raises(KernelInputError, match="NaN"):
        q(bad)
    (program,) = programs_of(q).values()
    assert "forward" in program.__dict__  # not planned: the next call plans
    assert torch.equal(q(x), portable) and type(program.__dict__.get("forward")).__name__ == _AFTER_PLANNING
    assert torch.equal(q(x), portable)


def test_threads_calling_a_new_program_at_once_plan_it_once(native_here):
    q, x = _efficientnet()
    portable = q(x)
    outs, barrier = [None] * 2, threading.Barrier(2)

    def call(i):
        barrier.wait()
        outs[i] = q(x)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (program,) = programs_of(q).values()
    steps = sorted(n.kwargs["plan"].target for n in program.graph.nodes if "plan" in n.kwargs)
    assert steps and steps == sorted(f"_program_step_{i}" for i in range(1, len(steps) + 1))  # one planning run
    assert all(torch.equal(o, portable) for o in outs)


def _codes(*shape, layout=torch.contiguous_format):
    return torch.randint(0, 256, shape, dtype=torch.uint8).contiguous(memory_format=layout)


def _row(k, n, dtype=torch.uint8):
    torch.manual_seed(1)
    qw = torch.randint(-63, 64, (n, k, 1, 1), dtype=torch.int8)
    return lr.row_linear(qw, torch.rand(n) * 0.01 + 0.001, torch.randn(n), 0.02, 7, 0.05 if dtype == torch.uint8 else None,
                         "native")


def test_each_step_refuses_operands_of_other_strides_and_its_function_falls_back_to_the_same_codes(native_here):
    cl = torch.channels_last
    torch.manual_seed(0)
    a, g = _codes(2, 16, 5, 5, layout=cl), _codes(2, 16, 1, 1)
    y, table = torch.randn(2, 16, 5, 5).contiguous(memory_format=cl), _codes(256)
    row = _row(16, 24)
    cases = [  # (function, its arguments, the tensors its step takes, the same tensors laid out otherwise)
        (native_squeeze_excite.gate_mul_codes, (a, 3, g, 0, 0.01, 5, 0, 255, torch.uint8), (a, g), (a.contiguous(), g)),
        (native_squeeze_excite.global_avg_pool_codes, (a, 0.02, 3, 0.01, 7), (a,), (a.contiguous(),)),
        (native.quantize_codes, (y, 20.0, 9, 0, 255, torch.uint8), (y,), (y.contiguous(),)),
        (cpu_float.lut, (a, table), (a, table), (a.contiguous(), table)),
        (pr.pointwise_rows, (a, row, 7, 0, 255, torch.uint8), (a,), (a.contiguous(),)),
    ]
    for function, args, operands, others in cases:
        step = PROGRAM_PLANS_CPU[function](*args)
        assert step is not None, function.__name__
        want = function(*args)
        assert torch.equal(step(*operands), want) and step(*operands).stride() == want.stride()
        assert step(*others) is None, function.__name__  # planned for channels-last codes
        moved = [next((o for p, o in zip(operands, others) if p is t), t) for t in args]
        assert torch.equal(function(*moved, plan=step), function(*moved)), function.__name__


def test_a_convolution_step_equals_the_checked_call(native_here):
    torch.manual_seed(0)
    qw = torch.randint(-63, 64, (24, 1, 3, 3), dtype=torch.int8)  # depthwise
    conv = conv_native.native_conv(qw, torch.rand(24) * 0.01, torch.randn(24), 0.02, 7, [1, 1], 24, 0.05, "relu", "native")
    x = _codes(1, 24, 9, 9, layout=torch.channels_last)
    args = (x, conv, [1, 1], [1, 1], [1, 1], 7, 4, *lr.row_bounds(torch.uint8, 4, "relu"), torch.uint8)
    step = conv_native.conv_plan(*args)
    assert torch.equal(step(x), conv_native.conv_codes(*args)) and step(x.contiguous()) is None
    with unittest.mock.patch.object(conv_native, "bind", lambda *a: None):  # the torch path: the same codes
        assert torch.equal(step(x), conv_native.conv_codes(*args))
