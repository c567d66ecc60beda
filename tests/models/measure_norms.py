"""SQNR of the family models with their norms in int8 (forced by a QConfig) against float (the
default, rules/observers.py FLOAT_WHERE_IT_PAYS): the table in docs/convert.md, "Float where it pays".

    python -m tests.models.measure_norms [family,...]
"""

from __future__ import annotations

import sys

import lucid_fx
from lucid_fx.quantization import default_qconfig, get_default_qconfig_mapping

from . import measure
from .families import FAMILIES, as_batch

NORMS = ("layer_norm", "rms_norm")


def sqnr(name: str, int8_norms: bool) -> float:
    family = FAMILIES[name]
    model, example = family.make_model(), family.example_inputs()
    batches, held_out = measure._data(family)
    mapping = get_default_qconfig_mapping()
    for op in NORMS if int8_norms else ():
        mapping.set_object_type(op, default_qconfig)
    prepared = lucid_fx.prepare(model, mapping, example_inputs=measure.positional(model, example))
    lucid_fx.calibrate(prepared, [as_batch(b) for b in batches], progress=False)
    return measure._sqnr_on(model, lucid_fx.convert(prepared), held_out)


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["bert", "gpt2", "llama", "vit", "convnext"]
    print("| model | int8 norms (dB) | float norms (dB) |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {sqnr(name, True):.1f} | {sqnr(name, False):.1f} |", flush=True)


if __name__ == "__main__":
    main()
