"""The real ``transformers`` classes (BertModel, GPT2LMHeadModel, LlamaForCausalLM,
ViTForImageClassification, and twenty-three more: DistilBERT, RoBERTa, Mistral, Qwen2, Phi-3, Gemma,
Mixtral, GPT-NeoX, OPT, Swin, ConvNeXt, DeiT; T5, BART, Whisper, wav2vec 2.0, DeBERTa-v2, BLOOM, Falcon,
Mamba, CLIP's vision tower, SegFormer, MobileViT), built from small configs with random weights (nothing
downloaded, tests/models/hf_check.py), through prepare / calibrate / convert as a user runs them: issue 14's
goals, at least 95% of the matrix FLOPs in int8 and an output SQNR of at least 25 dB (torch.ao's
FX quantization cannot trace any of them). The test extra installs it: ``pip install -e '.[test]'``.
"""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[test]'")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests.models` under a bare `pytest` too
from tests.models.hf_check import gemma2_family, hf_families  # noqa: E402
from tests.models.measure import run_lucid  # noqa: E402

# model -> what issue 14 still has to build for it: all twenty-seven meet the goals (transformers 5.24, 2026-12-02;
# the eleven from T5 on since 2026-12-03, transformers 5.25;
# Mixtral since its experts' grouped products run in int8: 48.7% of its FLOPs in int8 before)
MISSING = {}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=MISSING[n])] if n in MISSING else [])
                                  for n in hf_families()])
def test_transformers_model_meets_the_issue_14_goals(name):
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = run_lucid(hf_families()[name], use_concrete=False)
    assert "failed" not in result, result["failed"]
    # torch's counter counts the float model's calls; the report, what runs per call and, apart, what prepare folded
    assert result["flops"] + result["folded_flops"] == result["torch_flops"] > 0, "the report's FLOPs are torch's counter's"
    share = result["int8_flops"] / result["flops"]
    assert share >= 0.95, f"{100 * share:.1f}% of FLOPs in int8\n{result['report']}"
    assert result["sqnr"] >= 25.0, f"SQNR {result['sqnr']:.1f} dB"


@pytest.mark.slow
def test_gemma2_soft_capping_keeps_its_values():
    """Gemma 2's ``tanh(x / c) * c`` keeps scores and logits within a few hundredths of 0, where the
    proven grids are [-1, 1] and [-c, c]: 7.4 dB output SQNR before convert narrowed those grids to
    what their inputs' grids reach (passes/narrow_fixed_grids.py), 24.7 after. Not yet the 25 dB goal:
    the attention scores' int8 matmul measures 22 dB on this random-weight model."""
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    result = run_lucid(gemma2_family(), use_concrete=False)
    assert "failed" not in result, result["failed"]
    assert result["int8_flops"] / result["flops"] >= 0.95
    assert result["sqnr"] >= 20.0, f"SQNR {result['sqnr']:.1f} dB"


@pytest.mark.slow
def test_gpt2_is_called_positionally_as_the_model_is():
    # GPT2LMHeadModel.forward(input_ids, cache, attention_mask, ...): the converted model binds a
    # positional call the same way (tests/test_forward_signature.py has the small cases).
    import lucid_fx

    family = hf_families()["gpt2"]
    model = family.make_model()
    (_, example), batches = family.example_inputs(), [kwargs for _, kwargs in family.calibration_batches(4)]
    qmodel = lucid_fx.quantize(model, example, batches, progress=False)
    ids, mask = example["input_ids"], example["attention_mask"]
    by_name = qmodel(input_ids=ids, attention_mask=mask)["logits"]
    assert torch.equal(qmodel(ids, None, mask)["logits"], by_name)
    with torch.no_grad():
        reference = model(ids, None, mask)["logits"]
    assert 10 * torch.log10(reference.pow(2).mean() / (by_name - reference).pow(2).mean()) >= 25
    with pytest.raises(TypeError, match=r"^forward: cache was left at its default \(None\) when prepare captured"):
        qmodel(ids, mask)  # the model reads mask as its cache: never as attention_mask


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "mistral"])
def test_dynamic_shapes_auto_runs_another_batch_and_length(name):
    # all fifteen ran at (3, 7) from a calibration at (2, 16), 27.9-43.1 dB (DeiT, at batch 3, 22.8;
    # Swin's export took 169 s); two of them here (the family models' BERT and Llama: test_dynamic_shapes.py)
    import lucid_fx

    family = hf_families()[name]
    model = family.make_model()
    (_, example), batches = family.example_inputs(), [kwargs for _, kwargs in family.calibration_batches(4)]
    qmodel = lucid_fx.quantize(model, example, batches, progress=False, dynamic_shapes="auto")
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(1, 1000, (3, 7), generator=g), "attention_mask": torch.ones(3, 7, dtype=torch.long)}
    inputs["attention_mask"][-1, -2:] = 0
    key = "last_hidden_state" if name == "bert" else "logits"
    with torch.no_grad():
        reference = model(**inputs)[key]
    got = qmodel(**inputs)[key]
    assert got.shape == reference.shape
    assert 10 * torch.log10(reference.pow(2).mean() / (got - reference).pow(2).mean()) >= 25


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "roberta", "llama", "swin", "mixtral", "mamba"])
def test_the_converted_model_saves_and_loads(name):
    # eleven of the fifteen could not be saved: aten new_ones, type_as, index and __and__ stayed
    # in the graph, off save's allowlist; all fifteen round-trip now (measured), and these four
    # hold each op that stopped them (BERT: new_ones, index, &; RoBERTa: type_as; Swin: index;
    # Llama: new_ones); Mixtral's routing (topk, sort, histc, cumsum) and its int8 grouped products;
    # Mamba's scan, float since 2026-12-04 (exp, softplus, stack, its read-out matmuls, tensor_split)
    import io

    import lucid_fx

    family = hf_families()[name]
    args, kwargs = family.example_inputs()
    qmodel = lucid_fx.quantize(family.make_model(), (args or None) if not kwargs else kwargs,
                               [a if not k else k for a, k in family.calibration_batches(2)], progress=False)
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    expected, got = qmodel(*args, **kwargs), loaded(*args, **kwargs)
    leaves = torch.utils._pytree.tree_leaves
    assert len(leaves(got)) == len(leaves(expected)) > 0
    assert all(torch.equal(a, b) for a, b in zip(leaves(got), leaves(expected)))
