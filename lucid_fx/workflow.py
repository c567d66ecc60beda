"""The reference framework's workflow names, on top of lucid_fx's FX passes.

``prepare_fx`` / ``prepare_qat_fx`` / ``convert_fx`` are :func:`lucid_fx.prepare` /
:func:`lucid_fx.prepare_qat` / :func:`lucid_fx.convert`
under the names users of the reference framework know, reached as ``lucid_fx.quantization.prepare_fx``
(that package's facade; this module is a verb).
"""

from __future__ import annotations

from typing import Any

from lucid_fx.convert import convert
from lucid_fx.prepare import prepare, prepare_qat

__all__ = ["prepare_fx", "prepare_qat_fx", "convert_fx"]


def prepare_fx(model, qconfig_mapping=None, example_inputs=None, inplace: bool = False, **kwargs: Any):
    """:func:`lucid_fx.prepare` under the reference framework's name.

    >>> import torch
    >>> import lucid_fx.quantization as Q
    >>> prepared = Q.prepare_fx(torch.nn.Sequential(torch.nn.Sigmoid()).eval(), None, (torch.randn(2),))
    >>> type(prepared.lucid_fx_observers["_0"]).__name__
    'FixedQParamsObserver'
    """
    return prepare(model, qconfig_mapping, example_inputs, inplace=inplace, **kwargs)


def prepare_qat_fx(model, qconfig_mapping=None, example_inputs=None, inplace: bool = False, **kwargs: Any):
    """:func:`lucid_fx.prepare_qat` under the reference framework's name."""
    return prepare_qat(model, qconfig_mapping, example_inputs, inplace=inplace, **kwargs)


def convert_fx(model, inplace: bool = False, **kwargs: Any):
    """:func:`lucid_fx.convert` under the reference framework's name."""
    return convert(model, inplace=inplace, **kwargs)
