"""BERT-like: written as transformers' BertModel is (eager attention), at toy size.

What it reproduces: embeddings called with keywords and built from registered position/token-type
buffers, a padding mask made from an ``attention_mask`` input, ``(1 - mask[:, None, None, :]) *
finfo.min``, a keyword ``forward`` with ``None`` defaults and a dict output, children called with
keywords, post-LayerNorm residual blocks, GELU, a tanh pooler.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._common import token_inputs

VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, MAX_POSITIONS = 1000, 64, 2, 4, 128, 64


class BertEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("position_ids", torch.arange(MAX_POSITIONS).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, past_key_values_length=0):
        input_shape = input_ids.size() if input_ids is not None else inputs_embeds.size()[:-1]
        seq_length = input_shape[1]
        if position_ids is None:
            position_ids = self.position_ids[:, past_key_values_length : seq_length + past_key_values_length]
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :seq_length].expand(input_shape[0], seq_length)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = HEADS, HIDDEN // HEADS
        self.all_head_size = HIDDEN
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.dropout = nn.Dropout(0.1)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = self.dropout(nn.functional.softmax(attention_scores, dim=-1))
        if head_mask is not None:
            attention_probs = attention_probs * head_mask
        context_layer = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))
        return (context_layer, attention_probs) if output_attentions else (context_layer,)


class BertSelfOutput(nn.Module):
    """dense -> dropout -> LayerNorm(x + residual); BertOutput is the same from the intermediate width."""

    def __init__(self, width: int = HIDDEN) -> None:
        super().__init__()
        self.dense = nn.Linear(width, HIDDEN)
        self.LayerNorm = nn.LayerNorm(HIDDEN, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = BertSelfAttention()
        self.output = BertSelfOutput()

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        self_outputs = self.self(hidden_states, attention_mask=attention_mask, head_mask=head_mask, output_attentions=output_attentions)
        attention_output = self.output(self_outputs[0], hidden_states)
        return (attention_output,) + self_outputs[1:]


class GELUActivation(nn.Module):
    """transformers' ACT2FN["gelu"]."""

    def forward(self, input):
        return F.gelu(input)


class BertIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, INTERMEDIATE)
        self.intermediate_act_fn = GELUActivation()

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = BertAttention()
        self.intermediate = BertIntermediate()
        self.output = BertSelfOutput(INTERMEDIATE)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, output_attentions=False):
        outputs = self.attention(hidden_states, attention_mask=attention_mask, head_mask=head_mask, output_attentions=output_attentions)
        attention_output = outputs[0]
        layer_output = self.output(self.intermediate(attention_output), attention_output)
        return (layer_output,) + outputs[1:]


class BertEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer() for _ in range(LAYERS))

    def forward(self, hidden_states, attention_mask=None, output_hidden_states=False):
        all_hidden_states = () if output_hidden_states else None
        for layer_module in self.layer:
            if output_hidden_states:
                all_hidden_states = all_hidden_states + (hidden_states,)
            hidden_states = layer_module(hidden_states, attention_mask=attention_mask)[0]
        return hidden_states, all_hidden_states


class BertPooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings()
        self.encoder = BertEncoder()
        self.pooler = BertPooler()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended_attention_mask = attention_mask[:, None, None, :].to(dtype=dtype)
        return (1.0 - extended_attention_mask) * torch.finfo(dtype).min

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, return_dict=None):
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        return_dict = return_dict if return_dict is not None else True
        input_shape = input_ids.size() if input_ids is not None else inputs_embeds.size()[:-1]
        if attention_mask is None:
            attention_mask = torch.ones(input_shape)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, self.dtype)
        embedding_output = self.embeddings(
            input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids, inputs_embeds=inputs_embeds
        )
        output_hidden_states = output_hidden_states if output_hidden_states is not None else False
        sequence_output, hidden_states = self.encoder(
            embedding_output, attention_mask=extended_attention_mask, output_hidden_states=output_hidden_states
        )
        pooled_output = self.pooler(sequence_output)
        if not return_dict:
            return (sequence_output, pooled_output)
        return {"last_hidden_state": sequence_output, "pooler_output": pooled_output}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return BertModel().eval()


example_inputs, calibration_batches = token_inputs(VOCAB, batch=2, seq=16)
