"""HistogramObserver: pick the clipping range that minimises expected quantization error."""

from __future__ import annotations

from typing import Tuple, Union

import torch

from lucid_fx.quantization.dtypes import QDtype, QScheme, to_qscheme
from lucid_fx.quantization.observers import _StatisticsObserver
from lucid_fx.quantization.qparams import calculate_qparams

__all__ = ["HistogramObserver"]


def _rebin(hist: torch.Tensor, old_lo: float, old_hi: float, new_lo: float, new_hi: float) -> torch.Tensor:
    """Redistribute a histogram over ``[old_lo, old_hi]`` onto as many bins over ``[new_lo, new_hi]``,
    assuming values are uniform within each old bin (linear interpolation of the CDF)."""
    bins = hist.numel()
    if old_hi <= old_lo:
        # All mass sat at one point: put it in the bin that holds that point.
        out = torch.zeros_like(hist)
        idx = int((old_lo - new_lo) / (new_hi - new_lo) * bins) if new_hi > new_lo else 0
        out[min(max(idx, 0), bins - 1)] = hist.sum()
        return out
    old_edges = torch.linspace(old_lo, old_hi, bins + 1, dtype=torch.float64)
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), hist.double().cumsum(0)])
    new_edges = torch.linspace(new_lo, new_hi, bins + 1, dtype=torch.float64).clamp(old_lo, old_hi)
    pos = torch.searchsorted(old_edges, new_edges, right=True).clamp(1, bins) - 1
    frac = ((new_edges - old_edges[pos]) / (old_edges[pos + 1] - old_edges[pos])).clamp(0, 1)
    new_cdf = cdf[pos] + frac * (cdf[pos + 1] - cdf[pos])
    return (new_cdf[1:] - new_cdf[:-1]).clamp_min(0).to(hist.dtype)


def _prefix_sums(hist: torch.Tensor, lo: float, hi: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix sums of count, first and second moment of the bin centres (index i: bins before i)."""
    bins = hist.numel()
    width = (hi - lo) / bins
    h = hist.double()
    centres = lo + (torch.arange(bins, dtype=torch.float64) + 0.5) * width
    zero = torch.zeros(1, dtype=torch.float64)
    return (torch.cat([zero, h.cumsum(0)]), torch.cat([zero, (h * centres).cumsum(0)]),
            torch.cat([zero, (h * centres * centres).cumsum(0)]))


def _clip_errors(sums, lo: float, width: float, starts: torch.Tensor, ends: torch.Tensor):
    """Squared error of the values clipped below ``starts`` and above ``ends`` (bin indices), each
    to the nearer end, with each bin's own spread: one term per start and one per end."""
    c0, c1, c2 = sums
    spread = width * width / 12
    a = lo + starts.double() * width
    b = lo + ends.double() * width
    n_l, s1_l, s2_l = c0[starts], c1[starts], c2[starts]
    left = s2_l - 2 * a * s1_l + a * a * n_l + spread * n_l
    n_r, s1_r, s2_r = c0[-1] - c0[ends], c1[-1] - c1[ends], c2[-1] - c2[ends]
    right = s2_r - 2 * b * s1_r + b * b * n_r + spread * n_r
    return left, right


def _expected_error(
    hist: torch.Tensor, lo: float, hi: float, starts: torch.Tensor, ends: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """Expected squared quantization error for each candidate clipping range ``[starts, ends)``
    (bin indices) quantized with grid spacing ``step``, under a uniform-within-bin model.

    Inside the range each value is rounded to the grid (error ``step^2 / 12``); outside it is
    clipped to the nearer end (error ``(x - end)^2``, with ``x`` the bin centre, plus the bin's
    own spread). Prefix sums make every candidate O(1), so thousands are scored at once.
    """
    sums = _prefix_sums(hist, lo, hi)
    left, right = _clip_errors(sums, lo, (hi - lo) / hist.numel(), starts, ends)
    inside = (sums[0][ends] - sums[0][starts]) * step * step / 12
    return left + right + inside


class HistogramObserver(_StatisticsObserver):
    """Builds a histogram of everything it sees and chooses the clipping range that minimises the
    expected quantization error over it (an L2 search over candidate ranges).

    Args:
        bins: number of histogram bins.
        qscheme, qdtype, eps: as for every observer (per-tensor schemes only).

    >>> torch.manual_seed(0)
    <torch._C.Generator object at ...>
    >>> obs = HistogramObserver()
    >>> _ = obs(torch.randn(10000))
    >>> lo, hi = obs.clip_range()
    >>> 2.0 < hi < 4.5 and -4.5 < lo < -2.0
    True
    """

    def __init__(
        self,
        bins: int = 2048,
        qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
        qdtype: Union[QDtype, str, torch.dtype] = "quint8",
        eps: float = 1e-8,
    ) -> None:
        if to_qscheme(qscheme).is_per_channel:
            raise ValueError(f"HistogramObserver is per-tensor; {to_qscheme(qscheme).value} is not supported")
        super().__init__(qscheme, qdtype, None, eps)
        if not isinstance(bins, int) or bins < 16:
            raise ValueError(f"HistogramObserver: bins must be an integer >= 16, got {bins!r}")
        self.bins = bins
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def has_data(self) -> bool:
        return bool(torch.isfinite(self.min_val))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            return x
        data = x.detach()
        if data.numel() == 0:
            return x
        lo, hi = torch.aminmax(data)
        finite = self._count_nonfinite(data, (lo, hi))
        data = (data[finite] if finite is not None else data).float().reshape(-1)
        if data.numel() == 0:
            return x
        cur_lo, cur_hi = (lo.item(), hi.item()) if finite is None else (data.min().item(), data.max().item())
        if not self.has_data:
            new_lo, new_hi = cur_lo, cur_hi
        else:
            old_lo, old_hi = self.min_val.item(), self.max_val.item()
            new_lo, new_hi = min(old_lo, cur_lo), max(old_hi, cur_hi)
            if (new_lo, new_hi) != (old_lo, old_hi):
                self.histogram.copy_(_rebin(self.histogram.cpu(), old_lo, old_hi, new_lo, new_hi).to(self.histogram.device))
        if new_hi > new_lo:
            self.histogram += torch.histc(data.double(), bins=self.bins, min=new_lo, max=new_hi).to(self.histogram)
        else:
            self.histogram[0] += data.numel()
        self.min_val.fill_(new_lo)
        self.max_val.fill_(new_hi)
        return x

    def clip_range(self) -> Tuple[float, float]:
        """The (lo, hi) clipping range with the least expected quantization error."""
        lo, hi = self.min_val.item(), self.max_val.item()
        if hi <= lo:
            return lo, hi
        hist = self.histogram.cpu()
        if self.qscheme.is_symmetric:
            return self._search_symmetric(hist, lo, hi)
        # Coarse 2-D search over (start, end) bin pairs, then a fine one around the best pair.
        stride = max(1, self.bins // 256)
        best = self._best_pair(hist, lo, hi, torch.arange(0, self.bins, stride), torch.arange(self.bins, 0, -stride))
        if stride > 1:
            s0, e0 = best
            starts = torch.arange(max(0, s0 - stride), min(self.bins - 1, s0 + stride) + 1)
            ends = torch.arange(max(1, e0 - stride), min(self.bins, e0 + stride) + 1)
            best = self._best_pair(hist, lo, hi, starts, ends)
        width = (hi - lo) / self.bins
        return lo + best[0] * width, lo + best[1] * width

    def _best_pair(self, hist, lo, hi, starts, ends) -> Tuple[int, int]:
        # Every (start, end) pair at once as a matrix: the clipping terms depend on one end each,
        # so only the rounding term is computed per pair (4x faster than indexing per pair).
        width = (hi - lo) / self.bins
        sums = _prefix_sums(hist, lo, hi)
        left, right = _clip_errors(sums, lo, width, starts, ends)
        # The grid always spans 0 (calculate_qparams widens the range), so score that grid.
        a = (lo + starts.double() * width).clamp(max=0.0)
        b = (lo + ends.double() * width).clamp(min=0.0)
        step = (b[None, :] - a[:, None]) / (self.qdtype.levels - 1)
        inside = (sums[0][ends][None, :] - sums[0][starts][:, None]) * step * step / 12
        err = (left[:, None] + right[None, :] + inside).masked_fill_(ends[None, :] <= starts[:, None], float("inf"))
        i = int(torch.argmin(err))
        return int(starts[i // ends.numel()]), int(ends[i % ends.numel()])

    def _search_symmetric(self, hist, lo, hi) -> Tuple[float, float]:
        # Candidate magnitudes t * m; the grid spans [-t m, t m] whatever side the data is on.
        m = max(abs(lo), abs(hi))
        width = (hi - lo) / self.bins
        t = torch.linspace(1.0 / 1024, 1.0, 1024, dtype=torch.float64)
        starts = ((-t * m - lo) / width).floor().clamp(0, self.bins - 1).long()
        ends = ((t * m - lo) / width).ceil().clamp(1, self.bins).long()
        ends = torch.maximum(ends, starts + 1)
        err = _expected_error(hist, lo, hi, starts, ends, 2 * t * m / (self.qdtype.levels - 1))
        best = float(t[int(torch.argmin(err))] * m)
        return -best, best

    def calculate_qparams(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.has_data:
            return self._uncalibrated_qparams(())
        lo, hi = self.clip_range()
        device = self.min_val.device
        return calculate_qparams(
            torch.tensor(lo, device=device), torch.tensor(hi, device=device), self.qscheme, self.qdtype, self.eps
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        key = prefix + "histogram"
        if key in state_dict and state_dict[key].numel() != self.bins:
            self.bins = state_dict[key].numel()
            self.histogram.resize_(self.bins)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
