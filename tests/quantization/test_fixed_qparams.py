"""FixedQParamsObserver: the seed page's contract, and every bad scale or zero point a ValueError
stating the valid range (at construction and in load_state_dict)."""

import pytest
import torch

import lucid_fx.quantization as Q

SCALE_RANGE = "a positive number that is finite and normal in float32 (from 1.1754944e-38 to 3.4028235e+38)"


def zp_range(qdtype):
    return f"an integer in [{qdtype.quant_min}, {qdtype.quant_max}] (the {qdtype.name} grid)"


# --- the seed page, exactly ------------------------------------------------------------------


def test_seed_page_examples_run_as_written():
    obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    scale, zero_point = obs.calculate_qparams()  # valid with no calibration
    assert (round(scale.item(), 6), int(zero_point.item())) == (0.003906, 0)
    before = obs.scale.item()
    _ = obs(torch.randn(4, 4))
    assert obs.scale.item() == before


def test_signature_defaults_and_verbatim_qparams():
    obs = Q.FixedQParamsObserver(scale=1.0 / 256, zero_point=0)
    assert obs.qscheme is Q.per_tensor_affine and obs.qdtype is Q.quint8 and obs.eps == 1e-8
    scale, zp = obs.calculate_qparams()
    assert isinstance(scale, torch.Tensor) and isinstance(zp, torch.Tensor)
    assert scale.item() == 1.0 / 256 and zp.item() == 0


def test_forward_is_identity_and_collects_nothing():
    obs = Q.FixedQParamsObserver(scale=2.0 / 256, zero_point=128)
    before = {k: v.clone() for k, v in obs.state_dict().items()}
    x = torch.randn(4, 4) * 100
    assert obs(x) is x
    after = obs.state_dict()
    assert before.keys() == after.keys() == {"scale", "zero_point"}
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_qscheme_and_eps_are_metadata_only():
    a = Q.FixedQParamsObserver(0.5, 3, qscheme=Q.per_tensor_symmetric, eps=10.0)
    assert a.calculate_qparams()[0].item() == 0.5  # eps would have floored a derived scale
    assert a.calculate_qparams()[1].item() == 3


def test_buffers_move_with_to():
    obs = Q.FixedQParamsObserver(1 / 256, 0).to(torch.float64)
    # .to(dtype) casts floating buffers like any module; the pair is still returned verbatim.
    assert obs.scale.dtype == torch.float64 and obs.zero_point.dtype == torch.int64
    assert obs.calculate_qparams()[0].item() == 1 / 256


def test_numbers_and_one_element_tensors_are_accepted():
    obs = Q.FixedQParamsObserver(torch.tensor(0.5), torch.tensor(7))
    assert (obs.scale.item(), obs.zero_point.item()) == (0.5, 7)
    assert Q.FixedQParamsObserver(0.25, 128.0).zero_point.item() == 128  # an integral float is an integer
    smallest = torch.finfo(torch.float32).tiny
    assert Q.FixedQParamsObserver(smallest, 0).scale.item() == smallest  # the smallest normal float32


# --- bad scales: finite in float64 is not enough ---------------------------------------------


@pytest.mark.parametrize(
    "scale, shown",
    [
        (1e39, "1e+39 (inf in float32)"),  # was stored as inf
        (1e-46, "1e-46 (0 in float32)"),  # was stored as 0
        (1e-40, "1e-40 (9.99995e-41 in float32)"),  # subnormal: 1/scale overflows
        (0.0, "0.0"),
        (-1.0, "-1.0"),
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        ("big", "'big'"),
        (None, "None"),
        (True, "True"),
        (torch.tensor([0.1, 0.2]), "a torch.float32 tensor of shape (2,)"),
    ],
)
def test_bad_scale_is_a_value_error_stating_the_range(scale, shown):
    with pytest.raises(ValueError) as err:
        Q.FixedQParamsObserver(scale=scale, zero_point=0)
    assert str(err.value) == f"FixedQParamsObserver: scale must be {SCALE_RANGE}, got {shown}"


def test_a_float32_overflow_used_to_be_stored_as_inf():
    # What the observer stored before the check: the float64-finite scale rounded to float32.
    assert torch.tensor(1e39, dtype=torch.float32).item() == float("inf")
    assert torch.tensor(1e-46, dtype=torch.float32).item() == 0.0


# --- bad zero points ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "zero_point, shown",
    [
        (None, "None"),  # was TypeError from float(None)
        ("3", "'3'"),  # was accepted as 3
        (torch.tensor([1, 2]), "a torch.int64 tensor of shape (2,)"),  # was RuntimeError from .item()
        (0.5, "0.5"),
        (float("nan"), "nan"),
        (True, "True"),
        (-1, "-1"),
        (256, "256"),
    ],
)
def test_bad_zero_point_is_a_value_error_stating_the_range(zero_point, shown):
    with pytest.raises(ValueError) as err:
        Q.FixedQParamsObserver(scale=0.1, zero_point=zero_point)
    assert str(err.value) == f"FixedQParamsObserver: zero_point must be {zp_range(Q.quint8)}, got {shown}"


@pytest.mark.parametrize("qdtype, zp", [(Q.quint8, -1), (Q.quint8, 256), (Q.qint8, 128), (Q.qint8, -129)])
def test_zero_point_off_grid_names_the_grid(qdtype, zp):
    with pytest.raises(ValueError) as err:
        Q.FixedQParamsObserver(scale=0.1, zero_point=zp, qdtype=qdtype)
    assert str(err.value) == f"FixedQParamsObserver: zero_point must be {zp_range(qdtype)}, got {zp}"


# --- load_state_dict checks what it would copy -------------------------------------------------


@pytest.mark.parametrize(
    "state, message",
    [
        ({"scale": torch.tensor(float("inf")), "zero_point": torch.tensor(0)}, f"scale must be {SCALE_RANGE}, got tensor(inf)"),
        ({"scale": torch.tensor(0.0), "zero_point": torch.tensor(0)}, f"scale must be {SCALE_RANGE}, got tensor(0.)"),
        ({"scale": torch.tensor(1e39, dtype=torch.float64), "zero_point": torch.tensor(0)}, "got tensor(1.0000e+39, dtype=torch.float64) (inf in float32)"),
        ({"scale": torch.tensor(0.1), "zero_point": torch.tensor(300)}, f"zero_point must be {zp_range(Q.quint8)}, got 300"),
        ({"scale": torch.tensor(0.1), "zero_point": torch.tensor(2.5)}, f"zero_point must be {zp_range(Q.quint8)}, got tensor(2.5000)"),
    ],
)
def test_load_state_dict_refuses_an_invalid_state(state, message):
    obs = Q.FixedQParamsObserver(1 / 256, 0)
    with pytest.raises(ValueError) as err:
        obs.load_state_dict(state)
    assert str(err.value).startswith("load_state_dict into FixedQParamsObserver: ")
    assert message in str(err.value)
    assert (obs.scale.item(), obs.zero_point.item()) == (1 / 256, 0)  # nothing was copied


def test_load_state_dict_takes_a_valid_state():
    obs = Q.FixedQParamsObserver(1 / 256, 0)
    obs.load_state_dict(Q.FixedQParamsObserver(2 / 256, 128).state_dict())
    assert (obs.scale.item(), obs.zero_point.item()) == (2 / 256, 128)


def test_fixed_fake_quantize_checks_its_own_qparams_on_load():
    fq = Q.FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))
    state = fq.state_dict()
    state["scale"] = torch.tensor(-1.0)
    with pytest.raises(ValueError, match=r"load_state_dict into FixedQParamsFakeQuantize: scale must be .*got tensor\(-1.\)"):
        fq.load_state_dict(state)
    state = fq.state_dict()
    state["activation_post_process.zero_point"] = torch.tensor(999)
    with pytest.raises(ValueError, match=r"FixedQParamsObserver 'activation_post_process': zero_point must be .*got 999"):
        fq.load_state_dict(state)
    assert fq(torch.tensor([0.5])).item() == 0.5  # unchanged, still on the 1/256 grid


def test_builds_under_a_meta_device_context():
    # lucid_fx.load builds a twin of each module under torch.device("meta") to compare it with the file.
    with torch.device("meta"):
        obs = Q.FixedQParamsObserver(1 / 256, 0)
        with pytest.raises(ValueError, match=r"got 1e\+39 \(inf in float32\)"):
            Q.FixedQParamsObserver(1e39, 0)
    assert obs.scale.is_meta and obs.zero_point.is_meta
