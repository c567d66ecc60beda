"""lucid_fx/kernels/row_cache.py: the portable linear keeps a small linear's constants per weight, with the very scale
and bias tensors they were built from, and builds them again when one is replaced or changed in place."""

import pytest
import torch

from lucid_fx.kernels import cpu, row_cache

ops = torch.ops.lucid_fx

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


@pytest.fixture
def builds(monkeypatch):
    """The RowLinear builds of the test, counted."""
    count = []
    real = row_cache.row_linear
    monkeypatch.setattr(row_cache, "row_linear", lambda *a, **k: count.append(1) or real(*a, **k))
    return count


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    qx = torch.randint(0, 256, (1, 64), dtype=torch.uint8, generator=g)
    qw = torch.randint(-100, 100, (48, 64), dtype=torch.int8, generator=g)
    return qx, qw, torch.rand(48, generator=g) * 0.01 + 1e-3, torch.randn(48, generator=g)


def _engine():
    """Whether this machine's portable linear takes one row of 64 inputs off oneDNN (the kept constants' route)."""
    return cpu.takes_row(cpu._cpu_target(), cpu._onednn_on(), "none", torch.uint8, 1, 48, 64) is not None


def test_the_constants_are_built_once_for_the_same_tensors(builds):
    qx, qw, ws, bias = _case()
    outs = [ops.linear(qx, 0.02, 120, qw, ws, bias, 0.05, 100, "none", None) for _ in range(3)]
    assert len(builds) == (1 if _engine() else 0)
    assert all(torch.equal(o, outs[0]) for o in outs)
    want = ops.linear(qx, 0.02, 120, qw, ws.clone(), bias.clone(), 0.05, 100, "none", None)  # other tensors: built
    assert torch.equal(outs[0], want) and len(builds) == (2 if _engine() else 0)


def test_a_replaced_bias_or_a_scale_changed_in_place_builds_them_again(builds):
    qx, qw, ws, bias = _case(1)
    first = ops.linear(qx, 0.02, 120, qw, ws, bias, 0.05, 100, "none", torch.float32)
    del bias  # the entry holds it: no new tensor can take its identity
    other = torch.full((48,), 3.0)
    shifted = ops.linear(qx, 0.02, 120, qw, ws, other, 0.05, 100, "none", torch.float32)
    assert float((shifted - first).abs().min()) > 0.5  # the new bias's values, not the kept ones
    ws.mul_(2)  # a new version
    doubled = ops.linear(qx, 0.02, 120, qw, ws, other, 0.05, 100, "none", torch.float32)
    assert torch.allclose(doubled - 3.0, (shifted - 3.0) * 2, atol=1e-4)
    assert len(builds) == (3 if _engine() else 0)


def test_another_scale_or_zero_point_is_another_entry(builds):
    qx, qw, ws, bias = _case(2)
    a = ops.linear(qx, 0.02, 120, qw, ws, bias, 0.05, 100, "none", None)
    b = ops.linear(qx, 0.03, 120, qw, ws, bias, 0.05, 100, "none", None)
    c = ops.linear(qx, 0.02, 121, qw, ws, bias, 0.05, 100, "none", None)
    again = ops.linear(qx, 0.02, 120, qw, ws, bias, 0.05, 100, "none", None)
    assert not torch.equal(a, b) and torch.equal(a, again)
    assert c.shape == a.shape and len(builds) == (3 if _engine() else 0)
