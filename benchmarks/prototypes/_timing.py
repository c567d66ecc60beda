"""Shared timing for the prototypes: interleaved medians on a shared machine (1 thread by default)."""

import statistics
import time
from typing import Callable, Dict


def interleaved(fns: Dict[str, Callable[[], object]], rounds: int = 15, target_s: float = 0.02) -> Dict[str, float]:
    """Median microseconds per call of each ``fns[name]()``; every round runs each variant in turn
    (as many calls as take ~``target_s``), so a slow spell of the machine hits all of them."""
    calls = {}
    for name, fn in fns.items():
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < target_s or n < 3:
            fn()
            n += 1
        calls[name] = n
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / calls[name] * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def table(results: Dict[str, float], base: str = None, unit: str = "us") -> str:
    """One line per variant: time and the ratio to ``base`` (default: the first)."""
    base = base or next(iter(results))
    width = max(map(len, results))
    return "\n".join(f"  {name:<{width}} {t:>9.1f} {unit}  {results[base] / t:>5.2f}x vs {base}"
                     for name, t in results.items())
