"""Op groups: what the rules need to know about a canonical op, said once as tags on its
:class:`lucid_fx.ops.OpDef`; ``lucid_fx.ops.ops_tagged`` derives the sets the rules use."""

import enum

__all__ = ["Tag"]


class Tag(enum.Enum):
    """An op group."""

    BOUNDED = "bounded"  # output in a fixed interval whatever the input (rules/ranges.py proves it)
    ELEMENTWISE = "elementwise"  # one element out per element in, given its constants: a 256-entry table on int8
    MOVES_CODES = "moves codes"  # moves or selects values without changing them: runs on the codes as they are
    VIEW = "view"  # the result may be a view of the input, or the input (passes/functionalize_inplace.py)
    WEIGHTED = "weighted"  # multiplies by a weight: per-channel int8 weights, a batch norm after it folds in
    CONV = "conv"  # a convolution (fusion patterns)
    PRODUCT = "product"  # products of activations and weights or of two activations (rules/masks.py)
    POOLING = "pooling"  # a window over the spatial dims
    AVERAGE = "average"  # a mean of input values: stays inside the input's range
    NORMALIZATION = "normalization"  # statistics of the values themselves, computed or running
    ATTENTION = "attention"  # reads a mask input, in float (rules/masks.py)
