"""The real transformers classes, built from small configs (random weights, nothing downloaded):
which capture works (torch.fx, transformers.utils.fx where this transformers has it,
torch.export), and what today's lucid_fx does with the model and with ``ep.module()``.
Needs ``pip install transformers``; run from the repository root:

    python -m tests.models.hf_check [bert|gpt2|llama|vit ...]
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Dict, List, Optional

import torch
from torch import fx

from .families import Family
from ._common import image_inputs, init_batch_norms, token_inputs
from .export_ops import aten_ops, quantize_exported
from .measure import _capture, _error, run_lucid

VOCAB = 1000


def hf_families() -> Dict[str, Family]:
    import transformers as T

    def text(cls, config):
        def make():
            torch.manual_seed(0)
            return cls(config).eval()
        return Family(make, *token_inputs(VOCAB, batch=2, seq=16))

    example, batches = image_inputs((2, 3, 32, 32))
    pixels = lambda inputs: ((), {"pixel_values": inputs[0][0]})  # noqa: E731 - called as model(pixel_values=...)

    def keywords(cls, config, inputs, trained_norms=False):
        """A model called with the keyword inputs ``inputs(seed)`` makes; ``trained_norms``: batch norms with
        trained-looking statistics (a fresh MobileViT's output is all zeros)."""
        def make():
            torch.manual_seed(0)
            model = cls(config)
            return (init_batch_norms(model) if trained_norms else model).eval()
        return Family(make, lambda: ((), inputs(0)), lambda n=4: [((), inputs(1000 + i)) for i in range(n)])

    def with_decoder(family: Family) -> Family:
        """``family``'s text inputs and ``decoder_input_ids`` (8 tokens) for an encoder-decoder model."""
        def add(inputs):
            args, kwargs = inputs
            ids = kwargs["input_ids"]
            return args, dict(kwargs, decoder_input_ids=ids[:, :8].flip(1).contiguous())
        return Family(family.make_model, lambda: add(family.example_inputs()),
                      lambda n=4: [add(b) for b in family.calibration_batches(n)])

    def tensor(shape, name):
        return lambda seed: {name: torch.randn(shape, generator=torch.Generator().manual_seed(seed))}

    def vit():
        torch.manual_seed(0)
        config = T.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, num_labels=10)
        return T.ViTForImageClassification(config).eval()

    def image(cls, config):
        def make():
            torch.manual_seed(0)
            return cls(config).eval()
        return Family(make, lambda: pixels(example()), lambda n=4: [pixels(b) for b in batches(n)])

    encoder = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB)
    decoder = dict(encoder, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    return {
        "bert": text(T.BertModel, T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               intermediate_size=128, vocab_size=VOCAB)),
        "gpt2": text(T.GPT2LMHeadModel, T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB,
                                                     use_cache=False)),
        "llama": text(T.LlamaForCausalLM, T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                        max_position_embeddings=64, use_cache=False)),
        "vit": Family(vit, lambda: pixels(example()), lambda n=4: [pixels(b) for b in batches(n)]),
        # more architectures, each with something the four above lack
        "distilbert": text(T.DistilBertModel, T.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB)),
        "roberta": text(T.RobertaModel, T.RobertaConfig(**encoder)),  # padding-offset positions
        "mistral": text(T.MistralForCausalLM, T.MistralConfig(**decoder)),  # sliding-window mask
        "qwen2": text(T.Qwen2ForCausalLM, T.Qwen2Config(**decoder)),  # q/k/v with bias
        "phi3": text(T.Phi3ForCausalLM, T.Phi3Config(**decoder, pad_token_id=0, eos_token_id=1, bos_token_id=1)),  # fused qkv, gate_up
        "gemma": text(T.GemmaForCausalLM, T.GemmaConfig(**decoder, head_dim=16)),  # GeGLU, RMSNorm (1 + w), scaled embedding
        # a mixture of experts: top-2 routing, each expert's rows in one grouped product (torch._grouped_mm)
        "mixtral": text(T.MixtralForCausalLM, T.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2)),
        "gpt_neox": text(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**encoder, use_cache=False)),  # parallel residual, partial rotary
        "opt": text(T.OPTForCausalLM, T.OPTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                                                  vocab_size=VOCAB, word_embed_proj_dim=64, use_cache=False)),  # learned positions, relu
        "swin": image(T.SwinForImageClassification, T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                                  num_heads=[2, 2], window_size=4, num_labels=10)),  # windows, relative bias
        "convnext": image(T.ConvNextForImageClassification, T.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                                                                             num_labels=10)),  # channels-first LayerNorm, layer scale
        "deit": image(T.DeiTForImageClassification, T.DeiTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                                                 num_attention_heads=4, intermediate_size=128, num_labels=10)),  # two tokens
        # encoder-decoders, speech, other attention forms (2026-12-03)
        "t5": with_decoder(text(T.T5Model, T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB,
                                                      use_cache=False))),  # relative position bias, RMSNorm without mean
        "bart": text(T.BartModel, T.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                               vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)),  # cross-attention
        "whisper": keywords(T.WhisperModel, T.WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32, max_target_positions=16,
            vocab_size=VOCAB, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
            lambda seed: dict(tensor((2, 16, 64), "input_features")(seed),
                              decoder_input_ids=torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed)))),  # conv1d stem
        "wav2vec2": keywords(T.Wav2Vec2Model, T.Wav2Vec2Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
            tensor((2, 1600), "input_values")),  # raw audio: conv1d feature extractor, group norm, weight-normed conv
        "deberta_v2": text(T.DebertaV2Model, T.DebertaV2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                               intermediate_size=128, vocab_size=VOCAB)),  # disentangled attention
        "bloom": text(T.BloomForCausalLM, T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                        use_cache=False)),  # ALiBi
        "falcon": text(T.FalconForCausalLM, T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                           vocab_size=VOCAB, use_cache=False)),  # multi-query, parallel attention
        "mamba": text(T.MambaForCausalLM, T.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8,
                                                        use_cache=False)),  # selective scan, causal conv1d
        "clip_vision": keywords(T.CLIPVisionModel, T.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                                      num_attention_heads=4, image_size=32, patch_size=8),
                                tensor((2, 3, 32, 32), "pixel_values")),  # quick GELU, pre-norm
        "segformer": keywords(T.SegformerForSemanticSegmentation, T.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
            decoder_hidden_size=32, num_labels=4, patch_sizes=[7, 3], strides=[4, 2]),
            tensor((2, 3, 32, 32), "pixel_values"), trained_norms=True),  # reduced keys by a strided conv, upsampling head
        "mobilevit": keywords(T.MobileViTModel, T.MobileViTConfig(image_size=32, hidden_sizes=[32, 48, 64],
                                                                  neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
                              tensor((2, 3, 32, 32), "pixel_values"), trained_norms=True),  # patches unfolded by reshapes
    }


def gemma2_family() -> Family:
    """Gemma 2: soft-capped attention scores and logits, ``tanh(x / c) * c`` (c = 50 and 30)."""
    import transformers as T

    config = T.Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=VOCAB, num_key_value_heads=2, max_position_embeddings=64, use_cache=False, head_dim=16)

    def make():
        torch.manual_seed(0)
        return T.Gemma2ForCausalLM(config).eval()
    return Family(make, *token_inputs(VOCAB, batch=2, seq=16))


def _try(fn) -> str:
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"fails: {_error(exc)}"
    return f"ok ({time.perf_counter() - start:.1f}s)"


def check(name: str, family: Family) -> List[str]:
    import transformers

    model = family.make_model()
    args, kwargs = family.example_inputs()
    lines = [f"## {name} ({type(model).__name__}, attention {getattr(model.config, '_attn_implementation', '?')})"]
    lines.append(f"- torch.fx.symbolic_trace: {_try(lambda: fx.symbolic_trace(model))}")
    try:
        from transformers.utils.fx import symbolic_trace as hf_trace
    except ImportError:
        lines.append(f"- transformers.utils.fx: absent in transformers {transformers.__version__}")
    else:
        lines.append(f"- transformers.utils.fx.symbolic_trace: {_try(lambda: hf_trace(model, input_names=list(kwargs)))}")
    start = time.perf_counter()
    try:
        ep = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:  # noqa: BLE001
        lines.append(f"- torch.export(strict=False): fails: {_error(exc)}")
        ep = None
    else:
        ops = aten_ops(ep.module())
        lines.append(f"- torch.export(strict=False): ok ({time.perf_counter() - start:.1f}s), "
                     + ", ".join(f"{op} {n}" for op, n in sorted(ops.items())))
    for concrete in (False, True):
        r = run_lucid(family, use_concrete=concrete)
        text = f"FAILED {r['failed']}" if "failed" in r else (
            f"{r['kernels']} int8 kernels, {sum(r['float_ops'].values())} float ops, "
            f"{100.0 * r['int8_flops'] / max(r['flops'], 1):.0f}% of FLOPs in int8, SQNR {r['sqnr']:.1f} dB")
        lines.append(f"- lucid_fx.prepare ({_capture(r)}): {text}")
        lines += [f"    float module: {d[:300]}" for d in r.get("float_modules", [])[:6]]
    if ep is not None:
        q = quantize_exported(family, model, ep)
        text = f"FAILED {q['failed']}" if "failed" in q else f"{q['kernels']} int8 kernels, SQNR {q['sqnr']:.1f} dB"
        lines.append(f"- lucid_fx.prepare(ep.module()): {q.get('as_is', 'accepted')}; with training flags cleared: {text}")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*")
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    start = time.perf_counter()
    import transformers

    print(f"transformers {transformers.__version__} (import {time.perf_counter() - start:.1f}s)")
    families = hf_families()
    for name in options.families or list(families):
        print("\n".join(check(name, families[name])))


if __name__ == "__main__":
    main()
