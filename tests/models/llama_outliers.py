"""The Llama-like model with the activation outliers of a real LLM: three hidden channels of
every RMSNorm's output 20-50x larger than the rest (their norm weights are), so every linear
after a norm reads them at tens of times the other channels' size (Dettmers et al. 2022; Xiao
et al. 2022, fig. 4). The model of ``llama.py`` itself has none: its norm weights are ones.

As in a trained model, the linears that read an outlier channel have learned weights that fit
its size: their input column for it is as much smaller (``compensated=True``, the default), so
the model computes what the plain Llama-like model computes and only the activations between
a norm and its linears differ. With random weights and no such fit (``compensated=False``), the
outlier channels make q and k 20-50x larger, attention scores up to 2500x larger and every
softmax one-hot, so any rounding of q or k can move attention to another token.
"""

from __future__ import annotations

import torch
from torch import nn

from . import llama

OUTLIER_CHANNELS = (5, 17, 42)
example_inputs, calibration_batches = llama.example_inputs, llama.calibration_batches


def make_model(compensated: bool = True) -> nn.Module:
    model = llama.make_model()
    channels = list(OUTLIER_CHANNELS)
    gain = 20 + 30 * torch.rand(len(channels), generator=torch.Generator().manual_seed(0))
    readers = {}  # norm -> the linears that read its output
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        readers[layer.input_layernorm] = (attn.q_proj, attn.k_proj, attn.v_proj)
        readers[layer.post_attention_layernorm] = (mlp.gate_proj, mlp.up_proj)
    readers[model.norm] = (model.lm_head,)
    with torch.no_grad():
        for norm, linears in readers.items():
            norm.weight[channels] *= gain
            for linear in linears if compensated else ():
                linear.weight[:, channels] /= gain
    return model


def make_uncompensated_model() -> nn.Module:
    return make_model(compensated=False)
