"""Measure what the float-to-float transforms (``equalize``, ``correct_bias``, ``smooth_quant``)
buy on the family models: output SQNR of ``lucid_fx.quantize`` against the original float model
on held-out batches, without and with each. The tables of docs/accuracy.md. Run from the
repository root:

    python -m tests.models.measure_transforms [cnn] [relu6] [transformers] [target]

Each model is quantized as ``measure.py`` does (``lucid_fx.quantize(model, example_inputs,
calibration batches)``, default QConfigs); the Llama-like models' root does not trace, so their
traceable parts are quantized (every linear, the MLPs, the norms) and the attention math runs
in float, as it does for a user who calls ``quantize`` on them.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

import lucid_fx
from lucid_fx.quantization import get_default_qconfig_mapping

from . import llama, llama_outliers
from ._common import as_batch
from .families import BASELINES, FAMILIES, Family
from .measure import CALIBRATION_BATCHES, HELD_OUT_BATCHES, outputs, positional, sqnr

CNNS = ["mobilenet_v2", "efficientnet", "convnext", "densenet", "shufflenet", "mobilenet_v3", "resnet18"]
LLAMA_OUTLIERS = Family(llama_outliers.make_model, llama_outliers.example_inputs, llama_outliers.calibration_batches)
LLAMA_RAW = Family(llama_outliers.make_uncompensated_model, llama_outliers.example_inputs, llama_outliers.calibration_batches)


class Setup:
    """One family's model, example inputs, calibration batches and held-out reference outputs."""

    def __init__(self, family: Family) -> None:
        self.model = family.make_model()
        self.example = positional(self.model, family.example_inputs())
        batches = family.calibration_batches(CALIBRATION_BATCHES + HELD_OUT_BATCHES)
        self.calibration = [as_batch(b) for b in batches[:CALIBRATION_BATCHES]]
        self.held_out = batches[CALIBRATION_BATCHES:]
        self.reference = self.run(self.model)

    def run(self, model: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([outputs(model(*args, **kwargs)) for args, kwargs in self.held_out])

    def int8_sqnr(self, model: nn.Module, mapping=None) -> float:
        """SQNR of ``quantize(model)`` against the original float model, on the held-out batches."""
        return sqnr(self.reference, self.run(lucid_fx.quantize(model, self.example, self.calibration, mapping)))


def _try(fn: Callable[[], float]) -> str:
    try:
        return f"{fn():.1f}"
    except Exception as exc:  # noqa: BLE001 - a failure is a measurement too
        return f"fails ({type(exc).__name__})"


def cnn_row(name: str) -> str:
    s = Setup({**FAMILIES, **BASELINES}[name])
    equalized = lucid_fx.equalize(s.model, s.example)
    pairs = len(equalized.lucid_fx_transforms[-1].changed)
    plain, eq = s.int8_sqnr(s.model), s.int8_sqnr(equalized)
    bias = s.int8_sqnr(lucid_fx.correct_bias(s.model, s.calibration))
    both = s.int8_sqnr(lucid_fx.correct_bias(equalized, s.calibration))
    return f"| {name} | {pairs} | {plain:.1f} | {eq:.1f} ({eq - plain:+.1f}) | {bias:.1f} | {both:.1f} |"


def relu6_rows() -> List[str]:
    s = Setup(FAMILIES["mobilenet_v2"])
    rows = []
    for mode in ("relu", "clip", "keep"):
        equalized = lucid_fx.equalize(s.model, s.example, relu6=mode)
        report = equalized.lucid_fx_transforms[-1]
        qmodel = lucid_fx.quantize(equalized, s.example, s.calibration)
        convert = qmodel.lucid_fx_convert_report
        rows.append(f"| `{mode}` | {len(report.changed)} | {report.float_sqnr_db:.0f} | {sqnr(s.reference, s.run(qmodel)):.1f} | "
                    f"{len(convert.lowered)} / {len(convert.float_ops)} |")
    return rows


def _norms_float(model: nn.Module):
    mapping = get_default_qconfig_mapping()
    for name, module in model.named_modules():
        if isinstance(module, llama.LlamaRMSNorm):
            mapping.set_module_name(name, None)
    return mapping


def transformer_rows(alphas=(0.5,)) -> List[str]:
    rows = []
    cases = [("llama (no outliers)", FAMILIES["llama"], None), ("llama, outliers", LLAMA_OUTLIERS, None),
             ("llama, outliers uncompensated", LLAMA_RAW, None), ("llama, outliers uncompensated, RMSNorms float", LLAMA_RAW, _norms_float),
             ("vit", FAMILIES["vit"], None)]
    for label, family, mapping_for in cases:
        s = Setup(family)
        mapping = mapping_for(s.model) if mapping_for else None
        cells = [_try(lambda: s.int8_sqnr(s.model, mapping))]
        for alpha in alphas:
            smoothed = lucid_fx.smooth_quant(s.model, s.calibration, alpha=alpha)
            cells.append(_try(lambda: s.int8_sqnr(smoothed, mapping)))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def target_rows(target: float = 25.0) -> List[str]:
    """``quantize(..., target_sqnr_db=target)`` on each model: held-out SQNR reached, nodes kept
    float, the share of matrix FLOPs run in float, rounds used."""
    rows = []
    cases = [("vit", FAMILIES["vit"], None), ("mobilenet_v2", FAMILIES["mobilenet_v2"], None),
             ("mobilenet_v2, equalized", FAMILIES["mobilenet_v2"], "equalize"), ("convnext", FAMILIES["convnext"], None),
             ("llama, outliers", LLAMA_OUTLIERS, None)]
    for label, family, transform in cases:
        s = Setup(family)
        model = lucid_fx.equalize(s.model, s.example) if transform == "equalize" else s.model
        held_out = [positional(s.model, (args, kwargs)) for args, kwargs in s.held_out]
        qmodel = lucid_fx.quantize(model, s.example, s.calibration, target_sqnr_db=target, held_out_data=held_out)
        report = qmodel.lucid_fx_target
        plain = report.rounds[0].split("-> ")[1].split(" dB")[0]
        rows.append(f"| {label} | {plain} | {sqnr(s.reference, s.run(qmodel)):.1f} | {len(report.float_nodes)} | "
                    f"{100 * report.float_flops:.1f}% | {len(report.rounds)} |")
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="*", default=["cnn", "relu6", "transformers", "target"])
    options = parser.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if "cnn" in options.tables:
        print("| model | pairs equalized | plain | equalize | correct_bias | equalize + correct_bias |")
        print("|---|---|---|---|---|---|")
        for name in CNNS:
            print(cnn_row(name))
    if "relu6" in options.tables:
        print("\n| relu6 | pairs equalized | float output vs original (dB) | int8 SQNR (dB) | int8 kernels / float ops |")
        print("|---|---|---|---|---|")
        print("\n".join(relu6_rows()))
    if "transformers" in options.tables:
        alphas = (0.3, 0.5, 0.7)
        print("\n| model | plain | " + " | ".join(f"smooth_quant alpha={a}" for a in alphas) + " |")
        print("|---|---|" + "---|" * len(alphas))
        print("\n".join(transformer_rows(alphas)))
    if "target" in options.tables:
        print("\n| model | plain (dB) | target_sqnr_db=25 (dB) | nodes float | matrix FLOPs float | rounds |")
        print("|---|---|---|---|---|---|")
        print("\n".join(target_rows()))


if __name__ == "__main__":
    main()
