import pytest
import torch

import lucid_fx.quantization as Q


def test_qscheme_values_properties_and_aliases():
    assert [s.value for s in Q.QScheme] == [
        "per_tensor_affine",
        "per_tensor_symmetric",
        "per_channel_affine",
        "per_channel_symmetric",
    ]
    assert Q.per_channel_symmetric is Q.QScheme.PER_CHANNEL_SYMMETRIC
    assert [s.is_per_channel for s in Q.QScheme] == [False, False, True, True]
    assert [s.is_symmetric for s in Q.QScheme] == [False, True, False, True]


@pytest.mark.parametrize(
    "qdtype, bits, signed, lo, hi, storage",
    [
        (Q.qint8, 8, True, -128, 127, torch.int8),
        (Q.quint8, 8, False, 0, 255, torch.uint8),
        (Q.qint32, 32, True, -(2**31), 2**31 - 1, torch.int32),
        (Q.qint4, 4, True, -8, 7, torch.int8),
    ],
)
def test_qdtype_grids(qdtype, bits, signed, lo, hi, storage):
    assert (qdtype.bits, qdtype.signed, qdtype.quant_min, qdtype.quant_max, qdtype.storage) == (
        bits,
        signed,
        lo,
        hi,
        storage,
    )


def test_qdtype_repr_and_frozen():
    assert repr(Q.qint8) == "lucid_fx.quantization.qint8"
    with pytest.raises(Exception):
        Q.qint8.quant_min = 0


def test_torch_dtypes_convert_at_the_boundary():
    assert Q.to_qdtype(torch.qint8) is Q.qint8
    assert Q.to_qdtype(torch.quint8) is Q.quint8
    assert Q.to_qdtype("torch.quint8") is Q.quint8
    assert Q.to_qscheme(torch.per_channel_symmetric) is Q.per_channel_symmetric
    obs = Q.MinMaxObserver(qdtype=torch.qint8)
    assert obs.qdtype is Q.qint8


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="unknown qdtype 'int7'; valid: qint32, qint4, qint8, quint8"):
        Q.to_qdtype("int7")
    with pytest.raises(ValueError, match="valid: per_tensor_affine, per_tensor_symmetric, per_channel_affine"):
        Q.to_qscheme("per_row")
    with pytest.raises(ValueError, match="unknown qdtype"):
        Q.MinMaxObserver(qdtype="float8")


def test_qparams_bundle_is_frozen_and_validated():
    p = Q.QParams(torch.tensor(0.1), torch.tensor(3), "per_tensor_affine", "quint8")
    assert p.qscheme is Q.per_tensor_affine and p.qdtype is Q.quint8
    with pytest.raises(ValueError, match="needs a ch_axis"):
        Q.QParams(torch.ones(3), torch.zeros(3), Q.per_channel_symmetric, Q.qint8)
