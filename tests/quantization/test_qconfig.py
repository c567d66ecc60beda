import pytest
import torch
from torch import nn

import lucid_fx.quantization as Q


def test_default_qconfig_builds_the_documented_observers():
    act, weight = Q.default_qconfig.activation(), Q.default_qconfig.weight()
    assert isinstance(act, Q.HistogramObserver)
    assert (act.qscheme, act.qdtype) == (Q.per_tensor_affine, Q.quint8)
    assert isinstance(weight, Q.PerChannelMinMaxObserver)
    assert (weight.qscheme, weight.qdtype, weight.ch_axis) == (Q.per_channel_symmetric, Q.qint8, 0)
    qat = Q.default_qat_qconfig.activation()
    assert isinstance(qat, Q.FakeQuantize)
    assert isinstance(qat.activation_post_process, Q.MovingAverageMinMaxObserver)
    assert Q.default_qconfig.activation_qdtype is Q.quint8 and Q.default_qconfig.weight_qdtype is Q.qint8


def test_qconfig_validates_factories():
    with pytest.raises(ValueError, match="got an observer instance; pass a factory such as MinMaxObserver.with_args"):
        Q.QConfig(activation=Q.MinMaxObserver(), weight=Q.MinMaxObserver)
    with pytest.raises(ValueError, match="QConfig.weight must be a zero-argument factory"):
        Q.QConfig(activation=Q.MinMaxObserver, weight=3)


def test_mapping_lookup_order_name_then_regex_then_type_then_global():
    a, b, c, d = (Q.QConfig(Q.MinMaxObserver.with_args(eps=e), Q.PerChannelMinMaxObserver) for e in (1e-3, 1e-4, 1e-5, 1e-6))
    m = (
        Q.QConfigMapping()
        .set_global(a)
        .set_object_type(nn.Linear, b)
        .set_object_type(torch.sigmoid, d)
        .set_module_name_regex(r"blocks\.\d+\.attn", c)
        .set_module_name("blocks.0", None)
    )
    assert m.qconfig_for("head", nn.Linear) is b
    assert m.qconfig_for("head", nn.Conv2d) is a
    assert m.qconfig_for("blocks.1.attn", nn.Linear) is c
    assert m.qconfig_for("blocks.0.attn", nn.Linear) is None  # name beats regex, None = float
    assert m.qconfig_for("blocks.0", nn.Linear) is None
    assert m.qconfig_for("x", None, also_types=("sigmoid", torch.sigmoid)) is d


def test_prefix_form_and_bad_regex():
    m = Q.QConfigMapping().set_global(Q.default_qconfig).set_module_name_prefix("enc.", None)
    assert m.qconfig_for("enc.layer1.fc", nn.Linear) is None
    assert m.qconfig_for("encoder.fc", nn.Linear) is Q.default_qconfig
    with pytest.raises(ValueError, match="invalid pattern"):
        m.set_module_name_regex("(", None)
    with pytest.raises(ValueError, match="expected a QConfig or None, got str"):
        m.set_global("int8")


def test_default_mappings():
    assert Q.get_default_qconfig_mapping().global_qconfig is Q.default_qconfig
    assert Q.get_default_qat_qconfig_mapping("cpu").global_qconfig is Q.default_qat_qconfig
    with pytest.raises(ValueError, match="unknown backend 'tpu'; valid: cpu, cuda"):
        Q.get_default_qconfig_mapping("tpu")
