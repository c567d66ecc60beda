"""Float-to-float transforms that make a model easier to quantize: each takes a float model and
returns a float model that computes the same function (or, for bias correction, one that
anticipates the int8 weights' error), so they compose with ``prepare``/``quantize``::

    qmodel = lucid_fx.quantize(lucid_fx.equalize(model, example_inputs), example_inputs, batches)

The user's model is copied unless ``inplace=True``. Each transform appends a
:class:`TransformReport` to the result's ``lucid_fx_transforms`` list.
"""

from lucid_fx.transforms.bias_correction import correct_bias
from lucid_fx.transforms.equalization import ChannelClip, equalize
from lucid_fx.transforms.report import TransformReport
from lucid_fx.transforms.smoothing import smooth_quant

__all__ = ["equalize", "correct_bias", "smooth_quant", "ChannelClip", "TransformReport"]
