"""The registry a model was prepared with (``prepare(..., registry=reg)``), so that convert, explain and the
placement reports use its rules without being given it again: a prepared model's ``convert(prepared)`` without
``registry=`` lowered custom ops with the current registry's rules, leaving them float without a word."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["remember_registry", "registry_of"]

_PREPARED_WITH: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def remember_registry(prepared: nn.Module, registry: Any) -> None:
    """Note that ``prepared`` was made with ``registry`` (held as long as the model lives)."""
    _PREPARED_WITH[prepared] = registry


def registry_of(model: nn.Module, registry: Any = None) -> Any:
    """``registry`` where given, else the one ``model`` was prepared with, else None (the caller's
    ``or current_registry()``: this module imports nothing of lucid_fx, so every room may read it)."""
    return registry or _PREPARED_WITH.get(model)
