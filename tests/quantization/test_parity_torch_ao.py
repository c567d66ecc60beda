"""Differential tests: lucid_fx.quantization against torch.ao.quantization as an oracle.

torch.ao.quantization (deprecated, still working on the torch this project pins) is used here
only as a reference implementation; the product never imports it. Every case runs on seeded
random tensors, over several seeds and shapes (odd ones included), so a failure reproduces.

Known, intended differences (not asserted as equal, documented instead):

* ``torch.quantize_per_tensor`` / ``torch.quantize_per_channel`` on x86 (fbgemm) round *after*
  adding the zero point, with a fused multiply-add: ``round(x * inv_scale + zp)``, up to torch
  2.13 at least; torch 2.14.1 rounds as the spec does. The spec (api.md section 1) and torch's
  own fake-quant kernels use ``round(x * inv_scale) + zp``.
  The two agree everywhere except exactly at half-step ties with an odd zero point (and
  within one float ulp of a tie when ``x * inv_scale`` is inexact). Parity with
  ``quantize_per_tensor`` is therefore asserted on non-tie data and on ties where the two
  formulas provably coincide (zero point 0, or a power-of-two scale with an even zero
  point); the odd-zero-point tie case is pinned to the spec formula and to torch's
  fake-quant kernels, and ``quantize_per_tensor`` there must follow one of the two formulas:
  the spec's (then it equals lucid_fx code for code) or fbgemm's (then it diverges from
  lucid_fx in exactly the predicted set of elements).
* ``HistogramObserver``: lucid_fx does an exhaustive L2 search over candidate clipping ranges,
  torch.ao a greedy one, so scales differ; see the tolerances at the histogram tests.
* lucid_fx's ``eps`` default is 1e-8, torch.ao's is float32 eps; zero-range cases pass
  ``eps=1e-8`` to torch.ao explicitly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.ao.quantization as tq

import lucid_fx.quantization as Q

pytestmark = pytest.mark.filterwarnings(
    # torch's own deprecation notice for quantized tensor creation (the oracle, not the product).
    "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning"
)

SEEDS = [0, 1, 2, 3]

# (lucid scheme, lucid dtype, torch.ao qscheme, torch dtype)
PER_TENSOR = {
    "affine-quint8": (Q.per_tensor_affine, Q.quint8, torch.per_tensor_affine, torch.quint8),
    "affine-qint8": (Q.per_tensor_affine, Q.qint8, torch.per_tensor_affine, torch.qint8),
    "symmetric-qint8": (Q.per_tensor_symmetric, Q.qint8, torch.per_tensor_symmetric, torch.qint8),
    "symmetric-quint8": (Q.per_tensor_symmetric, Q.quint8, torch.per_tensor_symmetric, torch.quint8),
}
PER_CHANNEL = {
    "symmetric-qint8": (Q.per_channel_symmetric, Q.qint8, torch.per_channel_symmetric, torch.qint8),
    "affine-quint8": (Q.per_channel_affine, Q.quint8, torch.per_channel_affine, torch.quint8),
}
QDTYPES = {"quint8": (Q.quint8, torch.quint8), "qint8": (Q.qint8, torch.qint8)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batches(seed: int, shapes):
    """Batches with a different spread and offset each, so running statistics keep moving."""
    g = _gen(seed)
    out = []
    for i, shape in enumerate(shapes):
        spread = 0.5 + 3.0 * torch.rand((), generator=g).item()
        offset = (torch.rand((), generator=g).item() - 0.5) * 2.0
        out.append(torch.randn(shape, generator=g) * spread + offset * (i % 3))
    return out


def _f32(v: float) -> float:
    """A Python float that is exactly representable in float32 (the dtype both sides compute in)."""
    return float(torch.tensor(v, dtype=torch.float32))


def _assert_qparams_equal(ours, ref, *, rtol=1e-6):
    scale, zp = ours
    ref_scale, ref_zp = ref
    torch.testing.assert_close(scale.reshape(-1).float(), ref_scale.reshape(-1).float(), rtol=rtol, atol=0.0)
    assert zp.reshape(-1).tolist() == ref_zp.reshape(-1).tolist()


# ---------------------------------------------------------------------------------------------
# 1. MinMaxObserver
# ---------------------------------------------------------------------------------------------

PT_SHAPES = [(3, 5, 7), (1,), (13,), (2, 1, 9, 4), (257,), (6, 6)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("config", list(PER_TENSOR), ids=list(PER_TENSOR))
def test_minmax_observer_matches_torch_ao(config, seed):
    scheme, qd, tscheme, tdtype = PER_TENSOR[config]
    ours = Q.MinMaxObserver(qscheme=scheme, qdtype=qd)
    ref = tq.MinMaxObserver(dtype=tdtype, qscheme=tscheme)
    for x in _batches(seed, PT_SHAPES):
        assert torch.equal(ours(x), x)
        ref(x)
        assert ours.min_val.item() == ref.min_val.item()
        assert ours.max_val.item() == ref.max_val.item()
        _assert_qparams_equal(ours.calculate_qparams(), ref.calculate_qparams())


@pytest.mark.parametrize(
    "batches",
    [
        pytest.param([torch.zeros(7)], id="all-zero"),
        pytest.param([torch.full((3, 3), 2.5)], id="constant-positive"),
        pytest.param([torch.full((5,), -1.25)], id="constant-negative"),
        pytest.param([torch.zeros(4), torch.full((2, 3), 0.75)], id="zero-then-positive"),
    ],
)
@pytest.mark.parametrize("config", list(PER_TENSOR), ids=list(PER_TENSOR))
def test_minmax_observer_degenerate_ranges_with_explicit_eps(config, batches):
    scheme, qd, tscheme, tdtype = PER_TENSOR[config]
    ours = Q.MinMaxObserver(qscheme=scheme, qdtype=qd, eps=1e-8)
    ref = tq.MinMaxObserver(dtype=tdtype, qscheme=tscheme, eps=1e-8)
    for x in batches:
        ours(x)
        ref(x)
        _assert_qparams_equal(ours.calculate_qparams(), ref.calculate_qparams())
    scale, _ = ours.calculate_qparams()
    assert scale.item() > 0


# ---------------------------------------------------------------------------------------------
# 2. PerChannelMinMaxObserver
# ---------------------------------------------------------------------------------------------

def _per_channel_shapes(ch_axis: int, channels: int):
    """Shapes whose ``ch_axis`` has ``channels`` entries; the other dims vary per batch."""
    if ch_axis == 0:
        return [(channels, 5, 3), (channels, 1), (channels, 7, 2, 3), (channels, 11)]
    if ch_axis == 1:
        return [(2, channels, 3, 3), (5, channels), (1, channels, 7), (3, channels, 1, 5)]
    assert ch_axis == -1
    return [(4, channels), (2, 3, channels), (9, channels), (1, 1, channels)]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("channels", [1, 3, 17])
@pytest.mark.parametrize("ch_axis", [0, 1, -1])
@pytest.mark.parametrize("config", list(PER_CHANNEL), ids=list(PER_CHANNEL))
def test_per_channel_minmax_observer_matches_torch_ao(config, ch_axis, channels, seed):
    scheme, qd, tscheme, tdtype = PER_CHANNEL[config]
    ours = Q.PerChannelMinMaxObserver(ch_axis=ch_axis, qscheme=scheme, qdtype=qd)
    ref = tq.PerChannelMinMaxObserver(ch_axis=ch_axis, dtype=tdtype, qscheme=tscheme)
    for x in _batches(seed, _per_channel_shapes(ch_axis, channels)):
        assert torch.equal(ours(x), x)
        ref(x)
        assert torch.equal(ours.min_val, ref.min_val)
        assert torch.equal(ours.max_val, ref.max_val)
        scale, zp = ours.calculate_qparams()
        assert scale.shape == (channels,) and zp.shape == (channels,)
        _assert_qparams_equal((scale, zp), ref.calculate_qparams())


# ---------------------------------------------------------------------------------------------
# 3. Moving-average observers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("averaging_constant", [0.01, 0.3])
@pytest.mark.parametrize("config", ["affine-quint8", "symmetric-qint8"])
def test_moving_average_minmax_observer_matches_torch_ao(config, averaging_constant, seed):
    scheme, qd, tscheme, tdtype = PER_TENSOR[config]
    ours = Q.MovingAverageMinMaxObserver(averaging_constant=averaging_constant, qscheme=scheme, qdtype=qd)
    ref = tq.MovingAverageMinMaxObserver(averaging_constant=averaging_constant, dtype=tdtype, qscheme=tscheme)
    first = None
    for x in _batches(seed, PT_SHAPES + [(4, 4, 4), (31,)]):
        ours(x)
        ref(x)
        if first is None:
            first = (x.min().item(), x.max().item())
            # The first batch seeds the range verbatim.
            assert (ours.min_val.item(), ours.max_val.item()) == first
        # Same float32 update ``v + c * (cur - v)`` on both sides: bit-identical buffers.
        assert ours.min_val.item() == ref.min_val.item()
        assert ours.max_val.item() == ref.max_val.item()
        _assert_qparams_equal(ours.calculate_qparams(), ref.calculate_qparams())
    # The averaging really happened (the range is not the plain running min/max).
    assert ours.min_val.item() != min(b.min().item() for b in _batches(seed, PT_SHAPES + [(4, 4, 4), (31,)]))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("averaging_constant", [0.01, 0.3])
@pytest.mark.parametrize("ch_axis", [0, 1])
@pytest.mark.parametrize("config", list(PER_CHANNEL), ids=list(PER_CHANNEL))
def test_moving_average_per_channel_observer_matches_torch_ao(config, ch_axis, averaging_constant, seed):
    scheme, qd, tscheme, tdtype = PER_CHANNEL[config]
    ours = Q.MovingAveragePerChannelMinMaxObserver(
        averaging_constant=averaging_constant, ch_axis=ch_axis, qscheme=scheme, qdtype=qd
    )
    ref = tq.MovingAveragePerChannelMinMaxObserver(
        averaging_constant=averaging_constant, ch_axis=ch_axis, dtype=tdtype, qscheme=tscheme
    )
    shapes = _per_channel_shapes(ch_axis, 5) * 2
    for x in _batches(seed, shapes):
        ours(x)
        ref(x)
        assert torch.equal(ours.min_val, ref.min_val)
        assert torch.equal(ours.max_val, ref.max_val)
        _assert_qparams_equal(ours.calculate_qparams(), ref.calculate_qparams())


# ---------------------------------------------------------------------------------------------
# 4. HistogramObserver
# ---------------------------------------------------------------------------------------------

def _histogram_data(dist: str, g: torch.Generator, n: int) -> torch.Tensor:
    if dist == "normal":
        return torch.randn(n, generator=g)
    if dist == "uniform":
        return torch.rand(n, generator=g) * 4 - 1
    if dist == "laplace_outliers":
        u = torch.rand(n, generator=g) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs())
        idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
        x[idx] = (torch.rand(idx.numel(), generator=g) * 2 - 1) * 40  # 0.1% outliers up to +-40
        return x
    if dist == "relu_half_normal":
        return torch.randn(n, generator=g).clamp_min(0)
    if dist == "shifted_normal":
        return torch.randn(n, generator=g) * 0.5 + 2
    raise AssertionError(dist)


def _qdq_mse(x: torch.Tensor, scale, zero_point, qd) -> float:
    scale = float(torch.as_tensor(scale).reshape(-1)[0])
    zero_point = int(torch.as_tensor(zero_point).reshape(-1)[0])
    q = Q.quantize(x, scale, zero_point, qd)
    return float(((Q.dequantize(q, scale, zero_point) - x) ** 2).mean())


HIST_CONFIGS = {
    "affine-quint8": PER_TENSOR["affine-quint8"],
    "symmetric-qint8": PER_TENSOR["symmetric-qint8"],
}
HIST_DISTS = ["normal", "uniform", "laplace_outliers", "relu_half_normal", "shifted_normal"]
HIST_BATCH_SIZES = (3000, 2049, 4097)  # three batches, odd sizes; later ones widen the range

# Measured ours/torch.ao scale ratio with this data (5 distributions x 10 seeds, both configs):
# 0.952 .. 1.013 (most clipping difference on symmetric laplace/normal, where our exhaustive
# search clips deeper than torch.ao's greedy walk). The algorithms differ by design, so the
# bound is +-10%.
SCALE_RATIO_BOUNDS = (0.90, 1.10)
# Measured MSE(ours) / MSE(torch.ao) of quantize->dequantize on all observed data: 0.936 ..
# 1.039. Ours is better on normal/laplace (down to ~0.94) and slightly worse on uniform and
# relu half-normal with symmetric qint8 (up to 1.039: our error model scores a clipped value as
# landing on the clip boundary, while the symmetric grid's top code sits half a step inside it,
# and it charges rounding error to the exact zeros of ReLU data). We require ours to be at most
# 6% worse than torch.ao's on every case.
MSE_FACTOR = 1.06


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dist", HIST_DISTS)
@pytest.mark.parametrize("config", list(HIST_CONFIGS), ids=list(HIST_CONFIGS))
def test_histogram_observer_close_to_torch_ao(config, dist, seed):
    scheme, qd, tscheme, tdtype = HIST_CONFIGS[config]
    g = _gen(seed)
    batches = [_histogram_data(dist, g, n) for n in HIST_BATCH_SIZES]
    ours = Q.HistogramObserver(qscheme=scheme, qdtype=qd)
    ref = tq.HistogramObserver(dtype=tdtype, qscheme=tscheme)
    for x in batches:
        assert torch.equal(ours(x), x)
        ref(x)
    data = torch.cat(batches)
    assert ours.min_val.item() == ref.min_val.item() == data.min().item()
    assert ours.max_val.item() == ref.max_val.item() == data.max().item()

    scale, zp = ours.calculate_qparams()
    ref_scale, ref_zp = ref.calculate_qparams()
    ratio = scale.item() / ref_scale.item()
    mse, ref_mse = _qdq_mse(data, scale, zp, qd), _qdq_mse(data, ref_scale, ref_zp, qd)
    print(f"{config} {dist} seed={seed}: scale ratio {ratio:.4f}, mse ratio {mse / ref_mse:.4f}")
    assert SCALE_RATIO_BOUNDS[0] <= ratio <= SCALE_RATIO_BOUNDS[1], ratio
    assert mse <= MSE_FACTOR * ref_mse, (mse, ref_mse, mse / ref_mse)
    if scheme.is_symmetric:
        assert int(zp) == int(ref_zp) == 0
    else:
        # Zero points follow from nearly equal ranges; measured |difference| <= 3.
        assert abs(int(zp) - int(ref_zp)) <= 6, (int(zp), int(ref_zp))
    # Not meaningfully worse than plain min/max either (same factor; on uniform data no
    # clipping is optimal and min/max is up to ~4% better (measured 1.036), elsewhere the search wins).
    mm = Q.MinMaxObserver(qscheme=scheme, qdtype=qd)
    mm(data)
    mm_scale, mm_zp = mm.calculate_qparams()
    mm_mse = _qdq_mse(data, mm_scale, mm_zp, qd)
    assert mse <= MSE_FACTOR * mm_mse
    if dist in ("normal", "laplace_outliers"):
        # Where clipping the tails pays off the search must actually find it (measured ratio to
        # min/max <= 0.987 on these cases; torch.ao's greedy walk stays at ~0.99-1.0).
        assert mse <= 0.995 * mm_mse, mse / mm_mse


# ---------------------------------------------------------------------------------------------
# 5. quantize / dequantize codes
# ---------------------------------------------------------------------------------------------

CODE_SHAPES = [(1,), (7,), (33,), (3, 5, 7), (2, 17, 3)]


def _code_data(shape, scale: float, g: torch.Generator) -> torch.Tensor:
    """Values spanning well beyond the grid on both sides (so clamping is exercised)."""
    return torch.randn(shape, generator=g) * (90 * scale) + (torch.rand((), generator=g) - 0.5) * 100 * scale


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", CODE_SHAPES, ids=str)
@pytest.mark.parametrize("qdtype", list(QDTYPES))
def test_quantize_per_tensor_codes_match_torch(qdtype, shape, seed):
    qd, tdtype = QDTYPES[qdtype]
    g = _gen(seed)
    for _ in range(4):
        scale = _f32(10 ** (torch.rand((), generator=g).item() * 4 - 3))
        zp = int(torch.randint(qd.quant_min, qd.quant_max + 1, (), generator=g))
        x = _code_data(shape, scale, g)
        ref = torch.quantize_per_tensor(x, scale, zp, tdtype)
        q = Q.quantize(x, scale, zp, qd)
        assert q.dtype == qd.storage
        assert torch.equal(q, ref.int_repr())
        assert int(q.min()) >= qd.quant_min and int(q.max()) <= qd.quant_max
        deq = Q.dequantize(q, scale, zp)
        assert deq.dtype == torch.float32
        assert torch.equal(deq, ref.dequantize())


def _ties(scale: float, lo_code: int, hi_code: int) -> torch.Tensor:
    """Values exactly half-way between neighbouring grid points (k + 1/2) * scale."""
    k = torch.arange(lo_code, hi_code, dtype=torch.float32)
    return (k + 0.5) * scale


@pytest.mark.parametrize(
    "qdtype,scale,zp",
    [
        # zero point 0: one rounding on both sides, any scale.
        ("qint8", 0.1, 0),
        ("qint8", 0.037, 0),
        ("qint8", 1 / 3, 0),
        ("quint8", 0.0314159, 0),
        # power-of-two scale, even zero point: ties are exact and adding an even integer keeps
        # round-half-to-even unchanged.
        ("quint8", 0.25, 128),
        ("quint8", 2.0**-7, 64),
        ("qint8", 0.5, -10),
        ("qint8", 2.0**-5, 4),
    ],
)
def test_quantize_ties_match_torch_where_formulas_coincide(qdtype, scale, zp):
    qd, tdtype = QDTYPES[qdtype]
    scale = _f32(scale)
    x = _ties(scale, -300, 300)
    if scale in (0.25, 2.0**-7, 0.5, 2.0**-5):
        # Really exact ties: x / scale has a fractional part of exactly 1/2.
        assert torch.equal((x / scale) - torch.floor(x / scale), torch.full_like(x, 0.5))
    q = Q.quantize(x, scale, zp, qd)
    ref = torch.quantize_per_tensor(x, scale, zp, tdtype)
    assert torch.equal(q, ref.int_repr())
    assert torch.equal(Q.dequantize(q, scale, zp), ref.dequantize())
    # Round half to even, as the spec's ``round`` (torch.round) does.
    if scale == 0.25:
        assert Q.quantize(torch.tensor([0.125, 0.375, -0.125]), scale, zp, qd).tolist() == [zp, zp + 2, zp]


@pytest.mark.parametrize("qdtype,scale,zp", [("quint8", 0.25, 1), ("quint8", 2.0**-6, 127), ("qint8", 0.5, -3), ("qint8", 1.0, 5)])
def test_quantize_ties_with_odd_zero_point_follow_spec(qdtype, scale, zp):
    """Intended difference: spec ``round(x/s) + zp`` (as torch's fake-quant kernels) versus
    fbgemm's ``round(x/s + zp)`` in ``torch.quantize_per_tensor`` (up to torch 2.13; 2.14.1
    follows the spec)."""
    qd, tdtype = QDTYPES[qdtype]
    x = _ties(scale, qd.quant_min - zp - 3, qd.quant_max - zp + 3)
    q = Q.quantize(x, scale, zp, qd)
    spec = torch.clamp(torch.round(x / scale) + zp, qd.quant_min, qd.quant_max).to(qd.storage)
    assert torch.equal(q, spec)
    # torch's fake-quant kernel uses the same formula: recover its codes from its output.
    fq = torch.fake_quantize_per_tensor_affine(x, scale, zp, qd.quant_min, qd.quant_max)
    assert torch.equal(q, (fq / scale + zp).round().to(qd.storage))
    # The two roundings really disagree on these ties...
    fbgemm = torch.clamp(torch.round(x / scale + zp), qd.quant_min, qd.quant_max).to(qd.storage)
    diff = q.to(torch.int32) - fbgemm.to(torch.int32)
    assert set(diff.unique().tolist()) == {-1, 0, 1}
    # ...and quantize_per_tensor follows one of them: the spec's (torch 2.14.1: then it is
    # lucid_fx code for code) or fbgemm's (torch 2.13: one code off exactly where they disagree).
    ref = torch.quantize_per_tensor(x, scale, zp, tdtype).int_repr()
    assert torch.equal(ref, q) or torch.equal(ref, fbgemm), (ref != q).sum()


def _channel_params(qd, channels: int, g: torch.Generator, *, pow2: bool = False):
    if pow2:
        scale = 2.0 ** torch.randint(-8, 1, (channels,), generator=g).float()
        zp = torch.randint(qd.quant_min // 2, qd.quant_max // 2 + 1, (channels,), generator=g) * 2
    else:
        scale = (10 ** (torch.rand(channels, generator=g) * 3 - 3)).float()
        zp = torch.randint(qd.quant_min, qd.quant_max + 1, (channels,), generator=g)
    return scale, zp


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,ch_axis", [((5, 7), 0), ((3, 4, 5), 1), ((2, 3, 5, 7), 1), ((1, 9), 1), ((6, 1, 3), 2)], ids=str)
@pytest.mark.parametrize("qdtype", list(QDTYPES))
def test_quantize_per_channel_codes_match_torch(qdtype, shape, ch_axis, seed):
    qd, tdtype = QDTYPES[qdtype]
    g = _gen(seed)
    channels = shape[ch_axis]
    scale, zp = _channel_params(qd, channels, g)
    bshape = [1] * len(shape)
    bshape[ch_axis] = channels
    x = torch.randn(shape, generator=g) * (90 * scale.reshape(bshape))
    ref = torch.quantize_per_channel(x, scale.double(), zp, ch_axis, tdtype)
    q = Q.quantize(x, scale, zp, qd, ch_axis=ch_axis)
    assert torch.equal(q, ref.int_repr())
    assert torch.equal(Q.dequantize(q, scale, zp, ch_axis=ch_axis), ref.dequantize())

    # Exact ties per channel (power-of-two scales, even zero points): still identical.
    scale2, zp2 = _channel_params(qd, channels, g, pow2=True)
    k = torch.randint(-300, 300, shape, generator=g).float()
    xt = (k + 0.5) * scale2.reshape(bshape)
    ref2 = torch.quantize_per_channel(xt, scale2.double(), zp2, ch_axis, tdtype)
    q2 = Q.quantize(xt, scale2, zp2, qd, ch_axis=ch_axis)
    assert torch.equal(q2, ref2.int_repr())
    assert torch.equal(Q.dequantize(q2, scale2, zp2, ch_axis=ch_axis), ref2.dequantize())


# ---------------------------------------------------------------------------------------------
# 6. fake_quantize values and straight-through gradients
# ---------------------------------------------------------------------------------------------

QUANT_RANGES = {"0..255": (0, 255), "-128..127": (-128, 127)}


def _fq_data(shape, scale, zp, qmin, qmax, g) -> torch.Tensor:
    """Random values around the grid, far-outside values, exact ties and the grid ends."""
    lo, hi = (qmin - zp) * scale, (qmax - zp) * scale
    span = hi - lo
    x = (torch.rand(shape, generator=g) * 1.6 - 0.3) * span + lo
    flat = x.reshape(-1)
    n = flat.numel()
    special = torch.tensor(
        [lo, hi, lo - 0.5 * scale, hi + 0.5 * scale, lo - 0.51 * scale, hi + 0.51 * scale,
         lo - 1e3 * span, hi + 1e3 * span, lo - 1e6, hi + 1e6, 0.0, 0.5 * scale, -0.5 * scale,
         1.5 * scale, -2.5 * scale]
    )
    m = min(n, special.numel())
    flat[:m] = special[:m]
    return flat.reshape(shape)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(15,), (3, 5, 7), (2, 33)], ids=str)
@pytest.mark.parametrize("qrange", list(QUANT_RANGES))
def test_fake_quantize_per_tensor_matches_torch(qrange, shape, seed):
    qmin, qmax = QUANT_RANGES[qrange]
    g = _gen(seed)
    for scale, zp in [
        (_f32(10 ** (torch.rand((), generator=g).item() * 3 - 3)), int(torch.randint(qmin, qmax + 1, (), generator=g))),
        (0.25, qmin + 1),  # power-of-two scale, odd offset: exact ties against an odd zero point
        (_f32(0.1), 0 if qmin < 0 else 128),
    ]:
        x = _fq_data(shape, scale, zp, qmin, qmax, g)
        upstream = torch.randn(shape, generator=g)

        xo = x.clone().requires_grad_(True)
        out = Q.fake_quantize(xo, scale, zp, qmin, qmax)
        out.backward(upstream)

        xr = x.clone().requires_grad_(True)
        ref = torch.fake_quantize_per_tensor_affine(xr, scale, zp, qmin, qmax)
        ref.backward(upstream)

        assert out.dtype == torch.float32
        assert torch.equal(out, ref)
        assert torch.equal(xo.grad, xr.grad)
        # Far outside the grid the straight-through gradient is exactly 0; inside it passes.
        far = (x < (qmin - zp - 1) * scale) | (x > (qmax - zp + 1) * scale)
        assert bool(far.any())
        assert bool((xo.grad[far] == 0).all())
        inside = (x > (qmin - zp + 1) * scale) & (x < (qmax - zp - 1) * scale)
        assert bool(inside.any())
        assert torch.equal(xo.grad[inside], upstream[inside])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape,ch_axis", [((4, 9), 0), ((3, 5, 7), 1), ((2, 3, 4, 5), 1), ((5, 2, 3), 2)], ids=str)
@pytest.mark.parametrize("qrange", list(QUANT_RANGES))
def test_fake_quantize_per_channel_matches_torch(qrange, shape, ch_axis, seed):
    qmin, qmax = QUANT_RANGES[qrange]
    g = _gen(seed)
    channels = shape[ch_axis]
    scale = (10 ** (torch.rand(channels, generator=g) * 3 - 3)).float()
    scale[0] = 0.25
    zp = torch.randint(qmin, qmax + 1, (channels,), generator=g)
    zp[0] = qmin + 1  # odd: exact ties in channel 0 exercise the rounding order
    bshape = [1] * len(shape)
    bshape[ch_axis] = channels
    s_b, z_b = scale.reshape(bshape), zp.reshape(bshape).float()
    lo, hi = (qmin - z_b) * s_b, (qmax - z_b) * s_b
    u = torch.rand(shape, generator=g) * 1.6 - 0.3
    x = u * (hi - lo) + lo
    # 10% far above, 10% far below the grid, 20% exact half-step ties, the rest around it.
    flat_pick = torch.rand(shape, generator=g)
    x = torch.where(flat_pick < 0.1, hi + 1e3 * (hi - lo), x)
    x = torch.where((flat_pick >= 0.1) & (flat_pick < 0.2), lo - 1e3 * (hi - lo), x)
    ties = (torch.randint(-140, 140, shape, generator=g).float() + 0.5) * s_b
    x = torch.where((flat_pick >= 0.2) & (flat_pick < 0.4), ties, x)
    upstream = torch.randn(shape, generator=g)

    xo = x.clone().requires_grad_(True)
    out = Q.fake_quantize(xo, scale, zp, qmin, qmax, ch_axis=ch_axis)
    out.backward(upstream)

    xr = x.clone().requires_grad_(True)
    ref = torch.fake_quantize_per_channel_affine(xr, scale, zp.to(torch.int32), ch_axis, qmin, qmax)
    ref.backward(upstream)

    assert torch.equal(out, ref)
    assert torch.equal(xo.grad, xr.grad)
    far = flat_pick < 0.2
    assert bool(far.any())
    assert bool((xo.grad[far] == 0).all())
    assert bool((xo.grad != 0).any())


@pytest.mark.parametrize("qrange", list(QUANT_RANGES))
def test_fake_quantize_gradient_edges_match_torch(qrange):
    """Codes exactly at quant_min/quant_max keep the gradient; one code beyond loses it."""
    qmin, qmax = QUANT_RANGES[qrange]
    scale, zp = 0.5, (qmin + qmax + 1) // 2
    codes = torch.tensor([qmin - 2, qmin - 1, qmin, qmin + 1, qmax - 1, qmax, qmax + 1, qmax + 2], dtype=torch.float32)
    x = ((codes - zp) * scale).requires_grad_(True)
    Q.fake_quantize(x, scale, zp, qmin, qmax).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    torch.fake_quantize_per_tensor_affine(xr, scale, zp, qmin, qmax).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert torch.equal(x.grad, xr.grad)
