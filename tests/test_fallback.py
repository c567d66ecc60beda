"""The fallback for untraceable modules (lucid_fx/_fallback.py): children called with keywords,
concrete_args below the top level, errors naming the submodule, a parent reading an attribute of
a child prepare replaced; and Conv -> BN -> SiLU chains."""

import pytest
import torch
from torch import fx, nn

import lucid_fx
from lucid_fx._fallback import keep_attributes, part_arguments


class Attention(nn.Module):
    """A transformers-style child: called with keywords, optional arguments that decide the flow."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        y = self.q(hidden_states)
        if attention_mask is not None:
            y = y + attention_mask
        if output_attentions:
            return self.o(y), y
        return self.o(y)


class Layer(nn.Module):
    """Untraceable itself (data-dependent branch); calls its children with keywords and reads
    ``self.conv1.stride``."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.conv1 = Attention(), nn.Conv1d(16, 16, 3, padding=1)

    def forward(self, x):
        if x.sum() > 1e9:
            x = x * 2
        y = self.self_attn(hidden_states=x, output_attentions=False)
        step = self.conv1.stride[0]
        return self.conv1(y.transpose(1, 2)).transpose(1, 2) * step


def _quantized(model, x):
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    for seed in range(3):
        prepared(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
    return prepared, lucid_fx.convert(prepared)


def test_a_child_called_with_keywords_is_traced_with_its_call_s_constants():
    torch.manual_seed(0)
    model, x = Layer().eval(), torch.randn(2, 5, 16)
    prepared, converted = _quantized(model, x)
    assert [u.path for u in prepared.lucid_fx_report.float_modules] == [""]  # the attention traced
    assert isinstance(prepared.self_attn, fx.GraphModule) and {"q", "o"} <= set(prepared.self_attn.lucid_fx_observers.keys())
    report = converted.lucid_fx_convert_report  # one report, nested nodes by path, on the float root
    assert any(name.startswith("self_attn.") for name in report.lowered)
    assert not any(name.startswith("self_attn.") for name in report.float_ops)
    out, ref = converted(x), model(x)
    assert 10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()) > 25  # three int8 layers in series
    with pytest.raises(AssertionError, match="output_attentions has been specialized"):
        prepared.self_attn(hidden_states=x, output_attentions=True)  # a guard, not a wrong answer


def test_a_parent_reads_an_attribute_of_a_replaced_child_at_calibrate_and_after_convert():
    model, x = Layer().eval(), torch.randn(2, 5, 16)
    prepared, converted = _quantized(model, x)
    assert isinstance(prepared.conv1, fx.GraphModule) and prepared.conv1.stride == converted.conv1.stride == (1,)
    prepared(x)  # calibrate runs the parent's forward, which reads it
    assert converted(x).shape == (2, 5, 16)


def test_part_arguments_from_a_keyword_call():
    attn, h = Attention(), torch.randn(1, 16)
    inputs, concrete = part_arguments(attn, ((), {"hidden_states": h, "output_attentions": False}))
    assert inputs[0] is h and inputs[1:] == (None, False)
    assert concrete == {"attention_mask": None, "output_attentions": False}
    assert part_arguments(attn, None) == (None, None)  # the child did not run on the example inputs


def test_keep_attributes_skips_modules_tensors_and_private_state():
    new = keep_attributes(nn.Conv2d(3, 4, 3, stride=2), nn.Module())
    assert new.stride == (2, 2) and new.groups == 1
    assert not hasattr(new, "weight") and not hasattr(new, "_parameters_copy")


def test_an_error_in_a_nested_part_names_the_submodule():
    def refuse(node, ctx):
        raise ValueError(f"rule refuses {node.name}")

    with lucid_fx.registry_scope() as registry:
        lucid_fx.register_observer_rule("linear", refuse, registry=registry)
        with pytest.raises(ValueError, match=r"in submodule 'self_attn' \(Attention\).*rule refuses q"):
            lucid_fx.prepare(Layer().eval(), example_inputs=(torch.randn(2, 5, 16),), registry=registry)


class ConvBnSiLU(nn.Module):
    def __init__(self, cin, cout, groups=1):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(cin, cout, 3, padding=1, groups=groups), nn.BatchNorm2d(cout), nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def test_conv_bn_silu_chains_become_one_kernel_each():
    torch.manual_seed(0)
    model = nn.Sequential(ConvBnSiLU(3, 8), ConvBnSiLU(8, 8, groups=8), ConvBnSiLU(8, 8)).eval()
    _, converted = _quantized(model, torch.randn(2, 3, 16, 16))
    report = converted.lucid_fx_convert_report
    assert report.float_ops == {} and sorted(report.lowered.values()) == ["conv2d+silu"] * 3
