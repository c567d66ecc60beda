"""native_step: a planned native call as data, run in C++ (bound_ops.cpp) or, where that is not built, in Python; both
compute the bound call's values, refuse what they were not planned for, and report a kernel's status as a refusal."""

import gc

import pytest
import torch

from lucid_fx.kernels import bound_ops, native, native_elementwise, native_lut, native_squeeze_excite
from lucid_fx.kernels.native_step import BUFFER, IN, native_chain, native_step


@pytest.fixture(params=["c++", "python"])
def engine(request, native_on, bound_ops_on, monkeypatch):
    """Each test on both: the C++ NativeStep, and the Python closure that serves without it."""
    if request.param == "python":
        monkeypatch.setattr(bound_ops, "module", lambda: None)
    return request.param


def _codes(shape, dtype=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(dtype)


def test_a_step_computes_the_bound_calls_values(engine):
    q, table = _codes((3, 5, 7)), torch.randn(256)
    step = native_lut.lut_plan(q, table)
    assert type(step).__name__ == ("NativeStep" if engine == "c++" else "function")
    assert torch.equal(step(q, table), table[q.long()])  # a lookup: out[i] = table[q[i]]
    a = _codes((2, 8, 3, 3)).contiguous(memory_format=torch.channels_last)
    g = _codes((2, 8, 1, 1), seed=1)
    gate = native_squeeze_excite.gate_mul_plan(a, 3, g, 0, 0.01, 5, 0, 255, torch.uint8)
    assert torch.equal(gate(a, g), native_squeeze_excite.gate_mul_codes(a, 3, g, 0, 0.01, 5, 0, 255, torch.uint8))
    assert gate(a, g).stride() == a.stride()  # its buffer in the planned layout


def test_what_it_was_not_planned_for_is_refused(engine):
    q, table = _codes((4, 6)), torch.randn(256)
    step = native_lut.lut_plan(q, table)
    assert step(q.t().contiguous().t(), table) is None  # other strides
    assert step(_codes((6, 4)), table) is None  # another shape
    assert step(q.to(torch.int8), table) is None  # another dtype
    assert step(q, table.double()) is None
    assert step(q, table[:128]) is None
    with pytest.raises(TypeError, match="takes 2 tensors, got 1"):
        step(q)


def test_a_kernels_status_is_a_refusal_and_the_checked_path_names_the_values(engine):
    x = torch.randn(2, 16)
    step = native_elementwise.quantize_step(x, 10.0, 3, 0, 255, torch.uint8)
    assert torch.equal(step(x), native.quantize_codes(x, 10.0, 3, 0, 255, torch.uint8))
    x[1, 3] = float("inf")
    assert step(x) is None  # the kernel counted a non-finite value
    with pytest.raises(Exception, match="inf"):
        native.quantize_codes(x, 10.0, 3, 0, 255, torch.uint8, plan=step)


def test_the_step_holds_what_its_addresses_point_into(engine):
    q = _codes((64,))
    call = native.bind("lut", torch.float32, q.numel(), 0)
    keep = torch.randn(256)  # a constant the step reads by address, as a GEMM reads its packed weight
    step = native_step(call, [(q.shape, q.stride(), q.dtype)], [(q.shape, q.stride(), torch.float32)],
                       [(IN, 0), keep.data_ptr(), (BUFFER, 0)], keep=keep)
    expected = keep[q.long()]
    del call, keep
    gc.collect()
    for _ in range(3):
        torch.randn(256)  # memory a freed table would be reused by
    assert torch.equal(step(q), expected)


def test_steps_are_profiler_events_while_recorded(engine):
    q, table = _codes((16,)), torch.randn(256)
    step = native_lut.lut_plan(q, table)
    with torch.profiler.profile() as off:
        step(q, table)
    native.record_in_profiler(True)
    try:
        with torch.profiler.profile() as on:
            step(q, table)
    finally:
        native.record_in_profiler(False)
    assert [e.name for e in on.events() if e.name.startswith("native::")] == ["native::lut"]
    assert not [e.name for e in off.events() if e.name.startswith("native::")]


def test_a_dtype_no_kernel_takes_gets_no_step(native_on):
    call = native.bind("lut", torch.float32, 4, 0)
    assert native_step(call, [((4,), (1,), torch.float64)], [((4,), (1,), torch.float32)], [(IN, 0), (BUFFER, 0)]) is None


def test_a_chain_runs_its_calls_in_order_on_the_buffers_they_share(engine):
    q, codes, floats = _codes((3, 40)), _codes((256,), seed=1), torch.randn(256)
    first = native.bind("lut", torch.uint8, q.numel(), 0)  # q -> codes[q]
    second = native.bind("lut", torch.float32, q.numel(), 0)  # -> floats[codes[q]]
    step = native_chain([(first, [(IN, 0), codes.data_ptr(), (BUFFER, 0)]),
                         (second, [(BUFFER, 0), floats.data_ptr(), (BUFFER, 1)])],
                        [(q.shape, q.stride(), torch.uint8)],
                        [(q.shape, q.stride(), torch.uint8), (q.shape, q.stride(), torch.float32)], result=1,
                        keep=(codes, floats))
    assert torch.equal(step(q), floats[codes[q.long()].long()])
