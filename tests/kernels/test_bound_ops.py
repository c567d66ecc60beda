"""bound_ops: an operator's constants converted once, its tensors passed per call; the same values and errors
as torch.ops, the same profiler record, and a clear "off" where it is not built."""

import os

import pytest
import torch

from lucid_fx.kernels import bound_ops

aten = torch.ops.aten


@pytest.fixture
def built(bound_ops_on):
    """Built and on (tests/conftest.py)."""


def test_a_bound_call_computes_the_operators_value(built):
    other = torch.randn(5)
    add = bound_ops.bind(aten.add.Tensor, [None, other, 2.5], [0])
    x = torch.randn(5)
    assert torch.equal(add(x), aten.add.Tensor(x, other, alpha=2.5))
    assert add.name == "aten::add.Tensor" and add.slots == [0]
    addmm = bound_ops.bind(aten.addmm.default, [torch.ones(3), None, None, 1, 0.5], [1, 2])
    a, b = torch.randn(2, 4), torch.randn(4, 3)
    assert torch.equal(addmm(a, b), torch.addmm(torch.ones(3), a, b, alpha=0.5))


def test_a_constant_is_the_same_tensor_so_an_edit_in_place_reaches_the_call(built):
    other = torch.zeros(3)
    add = bound_ops.bind(aten.add.Tensor, [None, other, 1], [0])
    other.fill_(4.0)
    assert add(torch.ones(3)).tolist() == [5.0, 5.0, 5.0]


def test_what_does_not_bind_is_refused_so_the_caller_keeps_torch_ops(built):
    assert bound_ops.bind(aten.max.dim, [None, 0, False], [0]) is None  # two results
    assert bound_ops.bind(aten.add.Tensor, [None, torch.ones(1), 1], [2]) is None  # a slot at a Scalar argument
    assert bound_ops.bind(aten.add.Tensor, [None, "two", 1], [0]) is None  # a value its schema does not take
    assert bound_ops.bind(aten.add.Tensor, [None, torch.ones(1)], [0]) is None  # an argument missing


def test_a_wrong_call_and_an_operators_error_say_what_torch_ops_says(built):
    add = bound_ops.bind(aten.add.Tensor, [None, torch.ones(3), 1], [0])
    with pytest.raises(TypeError, match=r"aten::add.Tensor bound call takes 1 tensors, got 2"):
        add(torch.ones(3), torch.ones(3))
    with pytest.raises(TypeError, match=r"argument 0 is not a tensor"):
        add(3.0)
    with pytest.raises(RuntimeError) as bound_error:
        add(torch.ones(4))
    with pytest.raises(RuntimeError) as ops_error:
        aten.add.Tensor(torch.ones(4), torch.ones(3))
    assert str(bound_error.value) == str(ops_error.value)  # torch's message, without the C++ backtrace
    assert "Exception raised from" not in str(bound_error.value)


def test_the_profiler_records_the_operator_as_a_torch_ops_call(built):
    mul, x = bound_ops.bind(aten.mul.Tensor, [None, torch.ones(3)], [0]), torch.ones(3)
    with torch.profiler.profile() as prof:
        mul(x)
    assert [e.name for e in prof.events() if e.cpu_parent is None] == ["aten::mul"]


def test_off_says_so_and_binds_nothing(monkeypatch):
    monkeypatch.setenv("LUCID_FX_BOUND_OPS", "0")
    bound_ops._module.cache_clear()
    try:
        assert not bound_ops.available()
        assert bound_ops.status() == "off (LUCID_FX_BOUND_OPS=0): programs call torch.ops"
        assert bound_ops.bind(aten.add.Tensor, [None, torch.ones(1), 1], [0]) is None
    finally:
        monkeypatch.undo()
        bound_ops._module.cache_clear()


def test_without_a_compiler_programs_call_torch_ops(monkeypatch):
    monkeypatch.delenv("LUCID_FX_BOUND_OPS", raising=False)
    monkeypatch.setenv("LUCID_FX_CXX", "no-such-compiler-here")
    bound_ops._module.cache_clear()
    try:
        assert bound_ops.status() == "no C++ compiler found (set LUCID_FX_CXX or CXX): programs call torch.ops"
    finally:
        monkeypatch.undo()
        bound_ops._module.cache_clear()


def test_the_library_is_named_by_the_torch_it_was_built_against():
    flags = bound_ops._flags()
    assert f"-DLUCID_FX_TORCH=\"{torch.__version__}+{torch.version.git_version}\"" in flags
    assert any(f.startswith("-I") and f.endswith(os.path.join("torch", "include")) for f in flags)
