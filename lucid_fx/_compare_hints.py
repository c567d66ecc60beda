"""What compare suggests (:meth:`lucid_fx.compare.Comparison.hints`): the layer outputs whose channels' ranges
spread so wide that one per-tensor int8 grid leaves the small channels a few codes each, and what rebalances them
before quantizing (docs/debugging_accuracy.md). Measured on a trained-looking MobileNetV2 (tests/models/mobilenet_v2.py,
7.8 dB output SQNR): fourteen of the outputs compare measures spread 36-60x (its depthwise convolutions' own, fused
into their ReLU6, 60-120x) where its other layers' spread about 4x; after ``lucid_fx.equalize`` 2.9x at most, and
19.9 dB."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from lucid_fx.placement import INT8_RUNS, Placement

__all__ = ["SPREAD_HINT", "HINT_BELOW_DB", "SPREAD_REMEDIES", "channel_ranges", "spread", "spread_hints"]

#: A layer output whose largest channel's range (its float values' largest magnitude) is at least this many times
#: its median channel's is named by :meth:`Comparison.hints`: on one per-tensor int8 grid its small channels keep a
#: few codes each. A trained-looking MobileNetV2's (tests/models/mobilenet_v2.py) measure 36-60, its other layers'
#: about 4.
SPREAD_HINT = 32.0
#: Hints are given for a model output below this SQNR: above it, a spread the model's next layers do not amplify
#: (an equalized one that still spreads 500x, at 41 dB) is no trouble worth a line.
HINT_BELOW_DB = 30.0
_EQUALIZE = ("lucid_fx.equalize(model, example_inputs) before quantizing rescales the channels between two "
             "convolutions or linears in a row (joined by a ReLU, a ReLU6 or nothing) so that they share one grid")
_SMOOTH = ("lucid_fx.smooth_quant(model, batches) before quantizing moves the large channels into the weights of the "
           "linears that read it")
#: Where compare measures the spread of the channels' ranges, and what rebalances it: op -> (channel dim, remedy).
SPREAD_REMEDIES = {"conv1d": (1, _EQUALIZE), "conv2d": (1, _EQUALIZE), "conv3d": (1, _EQUALIZE),
                   "linear": (-1, _EQUALIZE), "layer_norm": (-1, _SMOOTH), "rms_norm": (-1, _SMOOTH)}


def channel_ranges(op: str, where: Optional[Placement], value: torch.Tensor) -> Tuple[str, Optional[torch.Tensor]]:
    """The op of :data:`SPREAD_REMEDIES` whose output channels ``value`` (a float node's value) holds, a fused int8
    group's first (``conv2d+relu``: conv2d), and each channel's largest magnitude; ("", None) for other ops."""
    first = where.why.split("+")[0] if where is not None and where.runs in INT8_RUNS else ""
    of = first if first in SPREAD_REMEDIES else op
    if of not in SPREAD_REMEDIES or value.dim() < 2:
        return "", None
    dim = SPREAD_REMEDIES[of][0] % value.dim()
    return of, value.detach().float().abs().amax(dim=[d for d in range(value.dim()) if d != dim])


def spread(most: Optional[torch.Tensor]) -> Optional[float]:
    """The largest channel's magnitude over the median channel's (None: not measured, or a median of 0)."""
    if most is None or most.numel() < 2:
        return None
    median = float(most.median())
    return float(most.max()) / median if median > 0 else None


def spread_hints(rows: Sequence, output_sqnr_db: float, limit: int = 5) -> List[str]:
    """For a model output below :data:`HINT_BELOW_DB`: one line per remedy of :data:`SPREAD_REMEDIES`, naming the
    rows (:class:`lucid_fx.compare.NodeError`) whose channels spread at least :data:`SPREAD_HINT`-fold, the widest
    first (at most ``limit``), then the remedy."""
    if not output_sqnr_db < HINT_BELOW_DB:
        return []
    wide = sorted((r for r in rows if r.channel_spread is not None and r.channel_spread >= SPREAD_HINT),
                  key=lambda r: -r.channel_spread)
    lines = []
    for remedy in dict.fromkeys(SPREAD_REMEDIES[r.spread_of][1] for r in wide):
        these = [r for r in wide if SPREAD_REMEDIES[r.spread_of][1] == remedy]
        named = ", ".join(f"{r.node} ({r.channel_spread:.0f}x)" for r in these[:limit])
        more = f" and {len(these) - limit} more" if len(these) > limit else ""
        lines.append(f"{named}{more}: the largest channel's range is that many times the median channel's, on one "
                     f"int8 grid, where the small channels keep a few codes each; {remedy} (docs/accuracy.md)")
    return lines
