"""Attention masks after convert: masked positions get exactly zero probability, the output is within
int8 error of float, and a mask is never quantized (docs/policies.md, "Attention masks").

Before this, on this block: ``masked_fill(mask, -inf)`` leaked 0.24-0.30 of each row's probability
onto masked positions (the observer skipped -inf, convert mapped it to the lowest code), and a
large finite negative (-1e9, -1e4, finfo.min, masked or added) stretched the grid until the output
SQNR fell to 12-14 dB.
"""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.kernels.library import op_name
from lucid_fx.placement import placements

B, H, T, DH = 4, 2, 12, 16
D = H * DH
FMIN = torch.finfo(torch.float32).min
NEG_INF = float("-inf")


def _split(t):
    return t.view(t.shape[0], T, H, DH).transpose(1, 2)  # (B, H, T, DH)


class Attention(nn.Module):
    """q/k/v linears, scores = q @ k.T * DH ** -0.5, a padding and a causal mask, softmax, @ v.
    Returns the output and the probabilities (B, H, T, T)."""

    def __init__(self, spelling, fill=NEG_INF):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.spelling, self.fill = spelling, fill
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1))

    def forward(self, x, keep):  # keep: (B, T), 1.0 for a token, 0.0 for padding
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        s = q @ k.transpose(-2, -1) * DH ** -0.5
        masked = (keep[:, None, None, :] < 0.5) | self.causal  # bool, True = masked
        if self.spelling == "method":
            s = s.masked_fill(masked, self.fill)
        elif self.spelling == "function":
            s = torch.masked_fill(s, masked, self.fill)
        elif self.spelling == "inplace":
            s = s.masked_fill_(masked, self.fill)
        elif self.spelling == "bare":  # used only through mutation: made out of place at prepare
            s.masked_fill_(masked, self.fill)
        elif self.spelling == "additive":  # transformers: (1.0 - mask) * finfo.min, from the input
            s = s + (1.0 - (~masked).float()) * self.fill
        elif self.spelling == "additive_first":
            s = (1.0 - (~masked).float()) * self.fill + s
        elif self.spelling == "additive_where":
            s = s + torch.where(masked, self.fill, 0.0)
        p = F.softmax(s, dim=-1)
        return (p @ v).transpose(1, 2).reshape(x.shape[0], T, D), p


def _batches(n, seed, fully_masked=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        keep = torch.ones(B, T)
        for b in range(B):
            keep[b, T - 1 - (i + b) % 6:] = 0.0  # 1 to 6 padding tokens
        keep[:, 0] = 0.0 if fully_masked else 1.0  # fully_masked: row 0 of every sample masks everything
        out.append((torch.randn(B, T, D, generator=g), keep))
    return out


def _masked(keep):
    return ((keep[:, None, None, :] < 0.5) | torch.ones(T, T, dtype=torch.bool).triu(1)).expand(B, H, T, T)


def _where(model):
    return {name: str(placement) for name, placement in placements(model).items()}


def _not_mask(float_ops):
    """The ops of a convert report that run in float for another reason than being (part of) a mask."""
    return {name for name, why in float_ops.items() if not why.startswith("attention mask")}


def _calibrate(model, seed=0):
    torch.manual_seed(seed)
    calibration = _batches(8, seed=seed + 1)
    prepared = lucid_fx.prepare(model, example_inputs=calibration[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no observer skips -inf: the masked values are never observed
        lucid_fx.calibrate(prepared, calibration, progress=False)
    return prepared


@functools.lru_cache(maxsize=None)
def _calibrated(cls, *args):
    """(float model, calibrated prepared model), once per model: tests convert their own copy."""
    torch.manual_seed(0)
    model = cls(*args).eval()
    return model, _calibrate(model)


SPELLINGS = [
    ("method", NEG_INF), ("method", -1e9), ("method", -10000.0), ("method", FMIN), ("function", NEG_INF),
    ("function", -1e9), ("inplace", NEG_INF), ("bare", NEG_INF), ("additive", FMIN), ("additive", -10000.0), ("additive_first", FMIN),
    ("additive_where", NEG_INF), ("additive_where", -1e9),
]


@pytest.mark.parametrize("spelling,fill", SPELLINGS, ids=[f"{s}-{f:g}" for s, f in SPELLINGS])
def test_masked_positions_get_exactly_zero_probability(spelling, fill, sqnr_db):
    model, prepared = _calibrated(Attention, spelling, fill)
    qmodel = lucid_fx.convert(prepared)
    x, keep = _batches(3, seed=99)[2]
    out, p = qmodel(x, keep)
    ref_out, ref_p = model(x, keep)
    masked = _masked(keep)
    assert torch.equal(p[masked], torch.zeros_like(p[masked]))  # not one code of probability leaks
    assert float(ref_p[masked].detach().abs().max()) == 0.0
    assert sqnr_db(ref_out, out) >= 30.0
    assert sqnr_db(ref_p, p) >= 30.0
    kernels = [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
    assert kernels.count("masked_softmax") == 1 and "softmax" not in kernels
    assert _not_mask(qmodel.lucid_fx_convert_report.float_ops) == set()  # only the mask's own ops are float
    assert _where(prepared) == _where(qmodel)  # explain predicted it


class InputMask(Attention):
    """transformers' eager attention: the 4-d additive mask is an input, -inf or finfo.min on masked keys."""

    def forward(self, x, mask):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        p = torch.softmax(q @ k.transpose(-2, -1) * DH ** -0.5 + mask, -1)
        return (p @ v).transpose(1, 2).reshape(x.shape[0], T, D), p


@pytest.mark.parametrize("fill", [NEG_INF, FMIN])
def test_an_input_mask_is_read_exactly_and_never_observed(fill, sqnr_db):
    def batch(x, keep):
        return x, torch.zeros(B, 1, T, T).masked_fill(_masked(keep)[:, :1], fill)

    torch.manual_seed(0)
    model = InputMask("input", fill).eval()
    calibration = [batch(*b) for b in _batches(8, seed=1)]
    prepared = lucid_fx.prepare(model, example_inputs=calibration[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the mask input has no observer to skip its -inf
        lucid_fx.calibrate(prepared, calibration, progress=False)
    assert "mask" not in prepared.lucid_fx_observers
    qmodel = lucid_fx.convert(prepared)
    x, mask = batch(*_batches(3, seed=99)[2])
    (out, p), (ref_out, ref_p) = qmodel(x, mask), model(x, mask)
    masked = (mask < -1e4).expand(B, H, T, T)
    assert torch.equal(p[masked], torch.zeros_like(p[masked]))
    assert sqnr_db(ref_out, out) >= 30.0 and sqnr_db(ref_p, p) >= 30.0
    masked_softmax = next(n for n in qmodel.graph.nodes if getattr(n.target, "__name__", "") == "masked_softmax")
    assert masked_softmax.args[3].op == "placeholder"  # the input itself, not a dequantized copy


def test_the_scores_are_observed_before_the_mask():
    # The grid of the scores comes from the unmasked values: not stretched by -1e9, not a skipped -inf.
    _, prepared = _calibrated(Attention, "method", -1e9)
    ranges = {name: (float(o.min_val), float(o.max_val)) for name, o in prepared.lucid_fx_observers.items()
              if hasattr(o, "min_val")}
    assert "masked_fill" not in ranges  # fused with the softmax: its output is never observed
    lo, hi = ranges["mul"]  # scores = q @ k.T * DH ** -0.5
    assert -20.0 < lo < 0.0 < hi < 20.0
    assert all(lo > -100.0 for lo, _ in ranges.values())


def test_an_additive_bias_is_exact_and_its_mask_chain_stays_float(sqnr_db):
    # ALiBi-like biases (-0.25 per token of distance) plus a -1e4 padding mask, built from the input:
    # on one 8-bit grid from -1e4 to 0 every bias would be 0 or -39; read in float they are exact.
    class Biased(Attention):
        def forward(self, x, keep):
            q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
            s = q @ k.transpose(-2, -1) * DH ** -0.5
            distance = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs().float()
            bias = -0.25 * distance + (1.0 - keep[:, None, None, :]) * -10000.0
            p = torch.softmax(s + bias, -1)
            return (p @ v).transpose(1, 2).reshape(x.shape[0], T, D), p

    torch.manual_seed(0)
    model = Biased("biased").eval()
    prepared = _calibrate(model)
    qmodel = lucid_fx.convert(prepared)
    x, keep = _batches(3, seed=99)[2]
    (out, p), (ref_out, ref_p) = qmodel(x, keep), model(x, keep)
    assert sqnr_db(ref_out, out) >= 30.0 and sqnr_db(ref_p, p) >= 30.0
    padded = (keep[:, None, None, :] < 0.5).expand(B, H, T, T)
    assert torch.equal(p[padded], torch.zeros_like(p[padded]))
    table = lucid_fx.explain(prepared).by_node()
    kept_float = {name for name, row in table.items() if row["reason"].startswith("attention mask")}
    assert kept_float == {"getitem_3", "sub", "mul_1", "add"}  # keep[:, None, None], 1.0 - it, * -1e4, + biases
    assert all(table[name]["kind"] == "float" for name in kept_float)
    masked_softmax = next(n for n in qmodel.graph.nodes if getattr(n.target, "__name__", "") == "masked_softmax")
    mask = masked_softmax.args[3]
    assert (mask.op, mask.target) == ("call_method", "add")  # the float sum, not a dequantize


class CopiedIn(Attention):
    """transformers' causal mask as torch.export captures it: a causal mask from factories, with the
    padding mask copied into a view of a clone of it in place."""

    def forward(self, x, keep):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        s = q @ k.transpose(-2, -1) * DH ** -0.5
        mask = torch.full((T, T), FMIN).triu(1)[None, None].expand(x.shape[0], 1, T, T).clone()
        view = mask[:, :, :, :T]
        view.copy_(view.masked_fill(keep[:, None, None, :] < 0.5, FMIN))
        p = torch.softmax(s + mask, -1)
        return (p @ v).transpose(1, 2).reshape(x.shape[0], T, D), p


def test_a_mask_copied_into_in_place_is_built_in_float_and_said_so(sqnr_db):
    torch.manual_seed(0)
    model = CopiedIn("copied").eval()
    prepared = _calibrate(model)
    table = lucid_fx.explain(prepared).by_node()
    write = next(row for row in table.values() if row["op"] == "copy_")  # stays in place: the clone is read after it
    assert write["reason"].startswith("changes 'alias' in place, and 'clone_1' shares its storage and is read afterwards")
    built = {name: row for name, row in table.items() if row["op"] in ("full", "triu", "clone", "masked_fill", "expand")}
    assert sorted(row["op"] for row in built.values()) == ["clone", "expand", "full", "masked_fill", "triu"]
    assert all(row["kind"] == "float" and row["reason"].startswith("attention mask") for row in built.values()), built
    qmodel = lucid_fx.convert(prepared)
    assert not [line for line in str(qmodel.lucid_fx_convert_report).splitlines() if "no lowering rule" in line]
    x, keep = _batches(3, seed=99)[2]
    (out, p), (ref_out, ref_p) = qmodel(x, keep), model(x, keep)
    assert sqnr_db(ref_out, out) >= 30.0
    masked = ((keep[:, None, None, :] < 0.5) | torch.ones(T, T, dtype=torch.bool).triu(1)).expand(B, H, T, T)
    assert torch.equal(p[masked], torch.zeros_like(p[masked]))


@pytest.mark.parametrize("fill,expected", [(NEG_INF, 0.0), (FMIN, 1.0 / T), (-1e9, 1.0 / T)])
def test_fully_masked_rows(fill, expected, sqnr_db):
    # Float gives NaN for a row of -inf (int8 codes hold no NaN: the row is all zeros, the documented
    # choice) and a uniform row for one finite value (as float does).
    model, prepared = _calibrated(Attention, "method", fill)
    qmodel = lucid_fx.convert(prepared)
    x, keep = _batches(1, seed=99, fully_masked=True)[0]
    (out, p), (ref_out, ref_p) = qmodel(x, keep), model(x, keep)
    row = p[:, :, 0, :]  # query 0 sees only key 0, which is padding in every sample
    assert torch.isnan(ref_p[:, :, 0, :]).all() == (fill == NEG_INF)
    assert torch.allclose(row, torch.full_like(row, expected), atol=1 / 512)
    assert not torch.isnan(p).any()
    fine = slice(1, None)  # every other row is within int8 error of float
    assert sqnr_db(ref_p[:, :, fine], p[:, :, fine]) >= 30.0


def test_the_reference_model_masks_exactly_too(sqnr_db):
    model, prepared = _calibrated(Attention, "additive", -10000.0)
    reference = lucid_fx.convert(prepared, reference=True)
    x, keep = _batches(3, seed=99)[2]
    (out, p), (ref_out, _) = reference(x, keep), model(x, keep)
    masked = _masked(keep)
    assert torch.equal(p[masked], torch.zeros_like(p[masked]))
    assert sqnr_db(ref_out, out) >= 30.0


class Unfused(Attention):
    """The masked scores are also read elsewhere (their row maximum), so the masked_fill or add
    cannot fuse with the softmax; or they were masked before the add that fuses with it."""

    def forward(self, x, keep):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        s = q @ k.transpose(-2, -1) * DH ** -0.5
        if self.spelling == "method":
            s = s.masked_fill(_masked(keep), self.fill)
        elif self.spelling == "additive":
            s = s + (1.0 - (~_masked(keep)).float()) * self.fill
        elif self.spelling == "twice":  # two masks added one after the other
            s = s + (1.0 - keep[:, None, None, :]) * self.fill + self.causal * self.fill
            return self._end(torch.softmax(s, -1), v, None)
        else:  # GPT-2's eager attention: where(causal, s, finfo.min) + the padding mask
            s = torch.where(~self.causal, s, self.fill) + (1.0 - keep[:, None, None, :]) * self.fill
            return self._end(torch.softmax(s, -1), v, None)
        p = torch.softmax(s, -1)
        return self._end(p, v, s.amax(-1))

    def _end(self, p, v, also):
        return (p @ v).transpose(1, 2).reshape(v.shape[0], T, D), p, also


UNFUSED = [  # spelling, fill, what runs in float (amax: the other reader), whether an observer skips -inf
    ("method", NEG_INF, {"masked_fill", "softmax", "amax"}, True),
    ("additive", FMIN, {"float_1", "add", "softmax", "amax"}, False),  # float_1: (~m).float(), no int8 kernel
    ("additive", -10000.0, {"float_1", "add", "softmax", "amax"}, False),
    ("twice", -10000.0, {"add", "softmax"}, False),  # (s + a) + b: the group's scores s + a hold -1e4
    ("where", FMIN, {"where", "softmax"}, False),  # GPT-2: where(causal, s, finfo.min) + padding mask
]


@pytest.mark.parametrize("spelling,fill,float_ops,warns", UNFUSED, ids=[u[0] for u in UNFUSED])
def test_a_mask_that_is_not_fused_keeps_the_masked_ops_float(spelling, fill, float_ops, warns, sqnr_db):
    # Its observer skips -inf (with a warning) or stretches to -1e4: the softmax must not read those
    # codes, and the add must not make them. Both run in float, and the convert report says why.
    torch.manual_seed(0)
    model = Unfused(spelling, fill).eval()
    calibration = _batches(8, seed=1)
    prepared = lucid_fx.prepare(model, example_inputs=calibration[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lucid_fx.calibrate(prepared, calibration, progress=False)
    assert any("non-finite" in str(w.message) for w in caught) == warns
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report.float_ops
    assert _not_mask(report) == float_ops
    assert "held mask values" in report["softmax"]
    assert _where(prepared) == _where(qmodel)  # explain predicted it from the calibration
    x, keep = _batches(3, seed=99)[2]
    (out, p, _), (ref_out, ref_p, _) = qmodel(x, keep), model(x, keep)
    masked = _masked(keep)
    assert torch.equal(p[masked], torch.zeros_like(p[masked]))
    assert sqnr_db(ref_out, out) >= 30.0 and sqnr_db(ref_p, p) >= 30.0


class SDPA(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.kind = kind
        self.register_buffer("causal", torch.ones(T, T, dtype=torch.bool).triu(1))

    def forward(self, x, keep):
        q, k, v = _split(self.q(x)), _split(self.k(x)), _split(self.v(x))
        masked = (keep[:, None, None, :] < 0.5) | self.causal
        if self.kind == "bool":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked)
        elif self.kind == "additive":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=masked.float() * FMIN - 0.1 * keep[:, None, None, :])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(x.shape[0], T, D)


@pytest.mark.parametrize("kind", ["bool", "additive", "is_causal"])
def test_scaled_dot_product_attention_runs_as_int8_matmuls_around_the_masked_softmax(kind, sqnr_db):
    # prepare writes the call out as eager attention computes it (passes/decompose_attention.py)
    model, prepared = _calibrated(SDPA, kind)
    qmodel = lucid_fx.convert(prepared)
    x, keep = _batches(3, seed=99)[2]
    (out, ref) = qmodel(x, keep), model(x, keep)
    assert sqnr_db(ref, out) >= 30.0
    report = qmodel.lucid_fx_convert_report
    assert _not_mask(report.float_ops) == set(), report.float_ops
    ops = [op_name(n) for n in qmodel.graph.nodes]
    # q @ k^T, then the masked softmax fused with p @ v (kernels/softmax_matmul.py), its mask an argument
    assert ops.count("matmul") == 1 and ops.count("softmax_matmul") == 1 and "masked_softmax" not in ops, ops
    (fused,) = [n for n in qmodel.graph.nodes if op_name(n) == "softmax_matmul"]
    assert isinstance(fused.args[3], torch.fx.Node)
