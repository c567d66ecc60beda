"""The ops lucid_fx runs in float on purpose, as data: always (``FLOAT_BY_DESIGN``), by default where
measured float is as fast and more accurate (``FLOAT_WHERE_IT_PAYS``), or where ``precision="measured"``
times both ways (``MEASURED_OPS``). The observer rules (``rules/observers.py``) read them.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["FLOAT_BY_DESIGN", "FLOAT_WHERE_IT_PAYS", "MEASURED_OPS"]

# Ops lucid_fx keeps in float on purpose, and why: no observer, no weight observer; a fused group
# holding one runs in float too. Every other op an observer rule quantizes has a lowering
# (tests/test_op_table.py).
FLOAT_BY_DESIGN: Dict[str, str] = {
    "conv3d": "no int8 3-d convolution kernel (lucid_fx.kernels has conv1d and conv2d): runs in float, by design",
}


# Ops that run in float by default because, measured, float is both more accurate and no slower
# there (docs/convert.md, "Float where it pays"); their output is still quantized for an int8
# consumer. A QConfig set for the op, its module or its node by name forces int8
# (``QConfigMapping().set_global(qc).set_object_type("layer_norm", qc)``).
FLOAT_WHERE_IT_PAYS: Dict[str, str] = {
    "layer_norm": "layer_norm runs in float where it pays: normalising int8 input magnifies the input's rounding "
                  "(measured 4-9 dB less SQNR, and no faster); set a QConfig for layer_norm to force int8",
    "rms_norm": "rms_norm runs in float where it pays: normalising int8 input magnifies the input's rounding "
                "(measured 4 dB less SQNR on the Llama-like model); set a QConfig for rms_norm to force int8",
    "normalize": "normalize runs in float where it pays: normalising int8 input magnifies the input's rounding "
                 "(measured 2.9 dB less SQNR on a cosine-attention block, and no faster); set a QConfig for normalize "
                 "to force int8",
}

# Ops whose int8 form may cost more time than it saves, with nothing but activations in: the
# attention core and elementwise tails. ``quantize(..., precision="measured")`` times each region
# of them both ways on the machine it runs on (lucid_fx/measured_precision.py); everywhere else
# they run int8. Weighted ops (linear, conv) are where int8 pays and are never candidates.
MEASURED_OPS: Dict[str, str] = {
    **dict.fromkeys(("matmul", "scaled_dot_product_attention", "softmax", "log_softmax", "masked_fill"), "attention"),
    **dict.fromkeys(("mul", "div", "exp", "sigmoid", "tanh", "gelu", "silu", "hardsigmoid", "hardswish", "elu", "softsign"),
                    "elementwise"),
}
