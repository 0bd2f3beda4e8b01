"""Choosing which gradient coordinates to send: exact top-k and a sampled-threshold top-k.

Both take the magnitudes of the accumulated gradient (``|grad + residual|``) and a fixed
``k`` and return exactly ``k`` int64 positions plus how many of them are real selections:
every data-parallel peer must hand the collective a payload of the same size, so when a
selector finds fewer than ``k`` coordinates it pads (``positions[valid:]`` repeat a real
position and carry value 0).

* ``TopK``: ``torch.topk``; the reference, and slow on large tensors.
* ``SampledTopK`` (DGC, Lin et al. 2018): estimate the k-th largest magnitude from a random
  sample, keep everything above a slightly lower threshold (one pass), then take the exact
  top-k among those candidates. Whenever the candidates number at least ``k`` the result is
  the exact top-k (the threshold is then below the k-th largest magnitude, so every top-k
  coordinate is a candidate); otherwise the shortfall is the selection error, counted in
  ``SelectionStats``. The threshold found is reused as the starting point of the next call
  for the same bucket, which halves the work on steady gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class SelectionStats:
    """How the selector did: calls, calls short of k, and the coordinates it missed."""

    calls: int = 0
    short_calls: int = 0
    missed: int = 0
    selected: int = 0

    @property
    def shortfall(self) -> float:
        """Fraction of the requested coordinates not found (0 for exact top-k)."""
        return self.missed / max(1, self.selected + self.missed)


class Selector:
    name = "base"

    def __init__(self) -> None:
        self.stats = SelectionStats()

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> tuple[torch.Tensor, int]:
        """Return (positions[k] int64, number of real selections). ``key`` names the bucket."""
        raise NotImplementedError

    def _record(self, k: int, valid: int) -> None:
        self.stats.calls += 1
        self.stats.selected += valid
        if valid < k:
            self.stats.short_calls += 1
            self.stats.missed += k - valid


class TopK(Selector):
    name = "topk"

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> tuple[torch.Tensor, int]:
        positions = torch.topk(magnitudes, k, sorted=False).indices
        self._record(k, k)
        return positions, k


def _pad(positions: torch.Tensor, k: int) -> torch.Tensor:
    if positions.numel() >= k:
        return positions[:k]
    filler = positions[:1] if positions.numel() else torch.zeros(1, dtype=torch.long, device=positions.device)
    return torch.cat([positions, filler.expand(k - positions.numel())])


class SampledTopK(Selector):
    name = "sampled-topk"

    def __init__(self, sample_fraction: float = 0.01, min_sample: int = 1024, oversample: float = 1.3,
                 seed: int = 0) -> None:
        super().__init__()
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.oversample = oversample
        self.generator = torch.Generator().manual_seed(seed)
        self.thresholds: dict[object, float] = {}

    def _estimate_threshold(self, magnitudes: torch.Tensor, k: int) -> float:
        n = magnitudes.numel()
        size = min(n, max(self.min_sample, int(n * self.sample_fraction)))
        sample_at = torch.randint(0, n, (size,), generator=self.generator).to(magnitudes.device)
        sample = magnitudes[sample_at]
        rank = min(size, max(1, math.ceil(size * self.oversample * k / n)))
        return torch.topk(sample, rank, sorted=False).values.min().item()

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> tuple[torch.Tensor, int]:
        n = magnitudes.numel()
        if k * 4 >= n:  # sampling does not pay when most coordinates are sent
            positions = torch.topk(magnitudes, k, sorted=False).indices
            self._record(k, k)
            return positions, k
        threshold = self.thresholds.get(key)
        candidates = None
        if threshold is not None:
            candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
            # Reuse only while the last threshold still yields a modest surplus.
            if not (k <= candidates.numel() <= 2 * self.oversample * k):
                candidates = None
        if candidates is None:
            threshold = self._estimate_threshold(magnitudes, k)
            candidates = torch.nonzero(magnitudes >= threshold).squeeze(1)
        if candidates.numel() > k:
            best = torch.topk(magnitudes[candidates], k, sorted=False).indices
            positions = candidates[best]
            # Next time start from the k-th largest magnitude scaled down a little.
            self.thresholds[key] = magnitudes[positions].min().item() / self.oversample
        else:
            positions = candidates
            self.thresholds[key] = threshold / self.oversample
        valid = min(k, positions.numel())
        self._record(k, valid)
        return _pad(positions, k), valid


def make_selector(name: str, seed: int = 0) -> Selector:
    if name == "topk":
        return TopK()
    if name == "sampled-topk":
        return SampledTopK(seed=seed)
    raise ValueError(f"unknown selector {name!r}; expected 'topk' or 'sampled-topk'")
