"""Which values may share storage: the tables passes/functionalize_inplace.py (and the passes that must not
fold or move a view) read. Data only, next to the op table it derives from (:mod:`lucid_fx.ops`)."""

from __future__ import annotations

import operator

from lucid_fx.ops import ops_tagged
from lucid_fx.op_tags import Tag

__all__ = ["VIEW_OPS", "VIEW_SPELLINGS", "METADATA_ATTRS", "OUT_OF_PLACE_OPERATORS"]

# Aliasing (passes/functionalize_inplace.py): canonical ops whose result may be a view of their input, or the
# input itself (dropout in eval, nn.Identity, contiguous on a contiguous tensor, reshape where a view is possible).
VIEW_OPS = ops_tagged(Tag.VIEW)
# Tensor methods and torch functions outside the canonical table that may return a view or their
# input (torch's "Tensor Views" page, plus the conversions that return self when nothing changes).
VIEW_SPELLINGS = frozenset((
    "view_as reshape_as expand_as as_strided detach diagonal movedim moveaxis narrow select t unflatten unfold unbind split "
    "split_with_sizes tensor_split hsplit vsplit dsplit swapaxes swapdims real imag view_as_real view_as_complex adjoint alias "
    "to type type_as float double half bfloat16 cpu cuda align_as align_to refine_names rename indices values").split())
# ``getattr(x, name)`` results that are not tensors, so never share x's storage (``x.T`` does).
METADATA_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout", "is_quantized"})
# ``a += b`` and friends -> the operator that returns a new tensor.
OUT_OF_PLACE_OPERATORS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                          operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv,
                          operator.imatmul: operator.matmul, operator.ipow: operator.pow}
