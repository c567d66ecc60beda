"""Pools of channels-last codes in one native pass (lucid_fx/kernels/native_pool.py, native_pool.c):
max pools give the reference's codes exactly; average pools are at most one code from the
reference's float average, and only where the exact average is a tie; what the pass does not take
is declined at plan time, and codes of other strides take the torch path."""

import pytest
import torch
import torch.nn.functional as F

from lucid_fx.kernels import native_pool as npl
from lucid_fx.kernels import program_ops
from lucid_fx.kernels import reference as ref

# (kernel, stride, padding): ResNet's 3x3/2, DenseNet's 2x2/2, a stride-1 window, odd shapes, 1x1
GEOMETRIES = [((3, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (0, 0)), ((3, 3), (1, 1), (1, 1)),
              ((5, 3), (2, 1), (2, 1)), ((1, 1), (1, 1), (0, 0)), ((4, 4), (3, 3), (2, 2))]


def _codes(shape, dtype, seed):
    info = torch.iinfo(dtype)
    q = torch.randint(info.min, info.max + 1, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return q.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("channels", [1, 16, 300])  # 300: past the kernel's blocks of channels
def test_max_pools_are_the_reference_codes_exactly(native_build, build, dtype, channels):
    native_build(build)
    for i, (k, s, p) in enumerate(GEOMETRIES):
        q = _codes((2, channels, 9, 11), dtype, i)
        expected = ref.max_pool2d(q, list(k), list(s), list(p), [1, 1], False)
        plan = npl.pool_plan(q, expected, "max", list(k), list(s), list(p))
        got = npl.pool_codes(q, plan)
        assert got.stride() == expected.stride() and torch.equal(got, expected), (build, k, s, p)


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("dtype,zp,out_zp", [(torch.uint8, 3, 7), (torch.int8, -5, 2)])
@pytest.mark.parametrize("include_pad", [True, False])
def test_average_pools_differ_from_the_reference_only_at_ties(native_build, build, dtype, zp, out_zp, include_pad):
    # scale / out_scale = 1.25 on integer sums: many exact ties, where float rounding picks either code
    native_build(build)
    differ = 0
    for i, (k, s, p) in enumerate(GEOMETRIES):
        q = _codes((2, 40, 9, 11), dtype, i)
        expected = ref.avg_pool2d(q, 0.05, zp, list(k), list(s), list(p), False, include_pad, 0.04, out_zp)
        plan = npl.pool_plan(q, expected, "avg_with_pad" if include_pad else "avg", list(k), list(s), list(p),
                             (0.05, zp, 0.04, out_zp))
        got = npl.pool_codes(q, plan)
        assert got.stride() == expected.stride()
        exact = F.avg_pool2d((q.double() - zp) * 0.05, k, s, p, False, include_pad) / 0.04 + out_zp
        tie = ((exact - exact.floor()) - 0.5).abs() < 1e-9
        diff = (got.int() - expected.int()).abs()
        assert diff.max() <= 1 and not (diff.bool() & ~tie).any(), (build, k, s, p)
        low, high = (0, 255) if dtype == torch.uint8 else (-128, 127)
        assert torch.equal(got[~tie].double(), exact[~tie].round().clamp(low, high))  # the exact average's code
        differ += int(diff.bool().sum())
    assert differ > 0  # the ties were there to tell


def test_what_the_pass_declines():
    q = _codes((2, 16, 8, 8), torch.uint8, 0)
    out = ref.max_pool2d(q, [2, 2], [2, 2], [0, 0], [1, 1], False)
    assert npl.pool_plan(q, out, "max", [2, 2], [2, 2], [0, 0]) is not None
    planes = q.contiguous()  # contiguous planes: the torch path was faster
    assert npl.pool_plan(planes, out.contiguous(), "max", [2, 2], [2, 2], [0, 0]) is None
    assert npl.pool_plan(q, out.contiguous(), "max", [2, 2], [2, 2], [0, 0]) is None  # output in another layout
    assert npl.pool_plan(q, out, "max", [2, 2], [2, 2], [2, 2]) is None  # padding past half the window
    assert npl.pool_plan(q, out.view(torch.int8), "max", [2, 2], [2, 2], [0, 0]) is None  # dtype changes
    big = _codes((1, 4, 70, 70), torch.uint8, 1)
    assert npl.pool_plan(big, big[:, :, :1, :1], "avg", [65, 65], [1, 1], [0, 0]) is None  # past MAX_TAPS


def test_codes_of_other_strides_take_the_torch_path():
    q = _codes((2, 16, 8, 8), torch.uint8, 2)
    out = ref.max_pool2d(q, [3, 3], [2, 2], [1, 1], [1, 1], False)
    plan = npl.pool_plan(q, out, "max", [3, 3], [2, 2], [1, 1])
    planes = q.contiguous()
    assert torch.equal(npl.pool_codes(planes, plan), program_ops.max_pool_taps(planes, [3, 3], [2, 2], [1, 1]))
    avg = npl.pool_plan(q, out, "avg", [3, 3], [2, 2], [1, 1], (0.1, 4, 0.2, 9))
    assert torch.equal(npl.pool_codes(planes, avg), ref.avg_pool2d(planes, 0.1, 4, [3, 3], [2, 2], [1, 1], False, False, 0.2, 9))


@pytest.mark.parametrize("engine", ["c++", "python"])
def test_a_planned_pool_step_gives_the_pools_codes_and_refuses_other_strides(native_on, bound_ops_on, monkeypatch, engine):
    if engine == "python":  # the step as the Python closure that serves where the bound calls are not built
        monkeypatch.setattr(bound_ops_on, "module", lambda: None)
    q = _codes((1, 24, 15, 15), torch.uint8, 3)
    expected = ref.max_pool2d(q, [3, 3], [2, 2], [1, 1], [1, 1], False)
    pool = npl.pool_plan(q, expected, "max", [3, 3], [2, 2], [1, 1])
    step = npl.pool_step(pool, torch.uint8)
    assert type(step).__name__ == ("NativeStep" if engine == "c++" else "function")
    got = step(q)
    assert got.stride() == expected.stride() and torch.equal(got, expected)  # native_pool.c's status 0: pooled
    assert step(q.contiguous()) is None  # planes, not channels-last: refused
    assert torch.equal(npl.pool_codes(q.contiguous(), pool, step), expected)  # ... and the torch path serves them
    assert npl.pool_codes.returns_step == ("step", ("q",))
