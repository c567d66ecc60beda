"""GPT-2-like: written as transformers' GPT2LMHeadModel is (eager attention), at toy size.

What it reproduces: every projection a ``Conv1D`` computing ``torch.addmm(bias, x.view(-1, nx),
weight)``, the tanh GELU written out (``NewGELUActivation``), qkv split with ``.split``, a causal
mask from a registered bool buffer applied with ``torch.where`` and ``finfo.min``, an additive
padding mask, pre-LayerNorm blocks, an LM head tied to the token embedding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._common import token_inputs

VOCAB, HIDDEN, LAYERS, HEADS, POSITIONS = 1000, 64, 2, 4, 64


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with its weight transposed."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NewGELUActivation(nn.Module):
    """transformers' ACT2FN["gelu_new"], GPT-2's activation: the tanh approximation, written out."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class GPT2Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((POSITIONS, POSITIONS), dtype=torch.bool)).view(1, 1, POSITIONS, POSITIONS),
                             persistent=False)
        self.num_heads, self.head_dim, self.split_size = HEADS, HIDDEN // HEADS, HIDDEN
        self.c_attn = Conv1D(3 * HIDDEN, HIDDEN)
        self.c_proj = Conv1D(HIDDEN, HIDDEN)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype, device=attn_weights.device)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights.type(value.dtype))
        return torch.matmul(attn_weights, value), attn_weights

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)
        attn_output, attn_weights = self._attn(query, key, value, attention_mask)
        attn_output = self.resid_dropout(self.c_proj(self._merge_heads(attn_output, self.num_heads, self.head_dim)))
        return (attn_output, attn_weights) if output_attentions else (attn_output,)


class GPT2MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * HIDDEN, HIDDEN), Conv1D(HIDDEN, 4 * HIDDEN)
        self.act, self.dropout = NewGELUActivation(), nn.Dropout(0.1)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(HIDDEN, eps=1e-5), nn.LayerNorm(HIDDEN, eps=1e-5)
        self.attn, self.mlp = GPT2Attention(), GPT2MLP()

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        residual = hidden_states
        attn_outputs = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, output_attentions=output_attentions)
        hidden_states = attn_outputs[0] + residual
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return (hidden_states,) + attn_outputs[1:]


class GPT2LMHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(POSITIONS, HIDDEN)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(GPT2Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2 ties them

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, token_type_ids=None, position_ids=None,
                use_cache=None, return_dict=None):
        return_dict = return_dict if return_dict is not None else True
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        batch_size = input_ids.shape[0]
        if position_ids is None:
            position_ids = torch.arange(0, input_shape[-1], dtype=torch.long, device=input_ids.device).unsqueeze(0)
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.dtype).min
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=attention_mask)[0]
        hidden_states = self.ln_f(hidden_states)
        output_shape = (-1,) + input_shape[1:] + (hidden_states.size(-1),)
        logits = self.lm_head(hidden_states.view(output_shape))
        return {"logits": logits} if return_dict else (logits,)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel().eval()


example_inputs, calibration_batches = token_inputs(VOCAB, batch=2, seq=16)
