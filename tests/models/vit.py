"""ViT-like: written as transformers' ViTForImageClassification is (eager attention), at toy size.

What it reproduces: a patch-embedding conv flattened to tokens (with transformers' channel check,
``if num_channels != self.num_channels: raise``), a class token expanded and concatenated, a
learned position embedding added, pre-LayerNorm encoder blocks with GELU, a keyword ``forward``
(``pixel_values=None, ...``), a classifier on the class token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._common import image_inputs

IMAGE, PATCH, CHANNELS, HIDDEN, LAYERS, HEADS, INTERMEDIATE, CLASSES = 32, 8, 3, 64, 2, 4, 128, 10


class ViTPatchEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_channels, self.num_patches = CHANNELS, (IMAGE // PATCH) ** 2
        self.projection = nn.Conv2d(CHANNELS, HIDDEN, kernel_size=PATCH, stride=PATCH)

    def forward(self, pixel_values, interpolate_pos_encoding=False):
        batch_size, num_channels, height, width = pixel_values.shape
        if num_channels != self.num_channels:
            raise ValueError("Make sure that the channel dimension of the pixel values match with the one set in the configuration.")
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class ViTEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, HIDDEN) * 0.02)
        self.patch_embeddings = ViTPatchEmbeddings()
        self.position_embeddings = nn.Parameter(torch.randn(1, self.patch_embeddings.num_patches + 1, HIDDEN) * 0.02)
        self.dropout = nn.Dropout(0.0)

    def forward(self, pixel_values, interpolate_pos_encoding=False):
        batch_size = pixel_values.shape[0]
        embeddings = self.patch_embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        cls_tokens = self.cls_token.expand(batch_size, -1, -1)
        embeddings = torch.cat((cls_tokens, embeddings), dim=1)
        return self.dropout(embeddings + self.position_embeddings)


class ViTSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = HEADS, HIDDEN // HEADS
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))

    def forward(self, hidden_states):
        batch_size = hidden_states.shape[0]
        new_shape = batch_size, -1, self.num_attention_heads, self.attention_head_size
        query = self.query(hidden_states).view(*new_shape).transpose(1, 2)
        key = self.key(hidden_states).view(*new_shape).transpose(1, 2)
        value = self.value(hidden_states).view(*new_shape).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        context = torch.matmul(F.softmax(scores, dim=-1), value).transpose(1, 2).contiguous()
        return context.reshape(context.size()[:-2] + (HIDDEN,))


class ViTLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layernorm_before, self.layernorm_after = nn.LayerNorm(HIDDEN, eps=1e-12), nn.LayerNorm(HIDDEN, eps=1e-12)
        self.attention = ViTSelfAttention()
        self.attention_output = nn.Linear(HIDDEN, HIDDEN)
        self.intermediate = nn.Linear(HIDDEN, INTERMEDIATE)
        self.intermediate_act_fn = nn.GELU()
        self.output = nn.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, hidden_states):
        hidden_states = self.attention_output(self.attention(self.layernorm_before(hidden_states))) + hidden_states
        layer_output = self.intermediate_act_fn(self.intermediate(self.layernorm_after(hidden_states)))
        return self.output(layer_output) + hidden_states


class ViTForImageClassification(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = ViTEmbeddings()
        self.layer = nn.ModuleList(ViTLayer() for _ in range(LAYERS))
        self.layernorm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.classifier = nn.Linear(HIDDEN, CLASSES)

    def forward(self, pixel_values=None, head_mask=None, interpolate_pos_encoding=None, return_dict=None):
        if pixel_values is None:
            raise ValueError("You have to specify pixel_values")
        hidden_states = self.embeddings(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states)
        sequence_output = self.layernorm(hidden_states)
        logits = self.classifier(sequence_output[:, 0, :])
        return {"logits": logits} if return_dict is not False else (logits,)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return ViTForImageClassification().eval()


example_inputs, calibration_batches = image_inputs((2, CHANNELS, IMAGE, IMAGE))
