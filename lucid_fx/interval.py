"""Closed intervals of real numbers, for value-range analysis. ``None`` means "not bounded"."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

Interval = Tuple[float, float]


def point(c: float) -> Interval:
    return (float(c), float(c))


def is_bounded(iv: Optional[Interval]) -> bool:
    return iv is not None and math.isfinite(iv[0]) and math.isfinite(iv[1]) and iv[0] <= iv[1]


def _hull(values: Iterable[float]) -> Optional[Interval]:
    vals = list(values)
    if any(math.isnan(v) for v in vals):
        return None
    return (min(vals), max(vals))


def add(a: Interval, b: Interval) -> Interval:
    return (a[0] + b[0], a[1] + b[1])


def sub(a: Interval, b: Interval) -> Interval:
    return (a[0] - b[1], a[1] - b[0])


def mul(a: Interval, b: Interval) -> Optional[Interval]:
    return _hull(x * y for x in a for y in b)


def div(a: Interval, b: Interval) -> Optional[Interval]:
    if b[0] <= 0.0 <= b[1]:
        return None  # dividing by something that may be zero is unbounded
    return _hull(x / y for x in a for y in b)


def neg(a: Interval) -> Interval:
    return (-a[1], -a[0])


def union(*ivs: Interval) -> Interval:
    return (min(iv[0] for iv in ivs), max(iv[1] for iv in ivs))


def clip(a: Interval, lo: Optional[float], hi: Optional[float]) -> Interval:
    """The image of ``a`` under ``clamp(., lo, hi)`` (either bound may be None)."""
    lo_ = a[0] if lo is None else min(max(a[0], lo), hi if hi is not None else math.inf)
    hi_ = a[1] if hi is None else max(min(a[1], hi), lo if lo is not None else -math.inf)
    return (lo_, hi_)


def monotone(fn, a: Interval) -> Interval:
    """Image of ``a`` under a non-decreasing function."""
    return (fn(a[0]), fn(a[1]))
