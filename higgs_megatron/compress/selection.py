"""Choosing which gradient coordinates to send: exact top-k and a sampled-threshold top-k.

Both take the magnitudes of the accumulated gradient (``|grad + residual|``) and a fixed
``k`` and return a ``Selection``: exactly ``k`` int64 positions, and which of them are real.
Every data-parallel peer must hand the collective a payload of the same size, so a selector
that finds fewer than ``k`` coordinates pads: a padding slot holds some position of the
tensor and must carry value 0 (``Selection.valid`` is False there).

Neither selector synchronises the host with the device: every shape is a function of ``n``
and ``k`` only, the threshold stays a device tensor, and nothing is read back (no
``.item()``, no ``torch.nonzero``, no boolean-mask indexing). On a GPU this is what keeps
the selection inside a backward hook from stalling the launch queue. Indexing is written as
``narrow`` / ``index_select`` rather than ``t[...]``: the same kernels, and the form that
torch's fake CUDA tensors accept on a CPU-only build, where the device tests run.

* ``TopK``: ``torch.topk``; the reference, and slow on large tensors.
* ``SampledTopK`` (DGC, Lin et al. 2018): estimate the k-th largest magnitude from a sample,
  keep the coordinates above a slightly lower threshold (one pass), then take the exact top-k
  among those candidates. The candidates are gathered into a fixed number of slots
  (``capacity``, a few times ``k``) without ``nonzero``: a running count of the coordinates
  above the threshold (``cumsum``) is searched for the 1st, 2nd, ... of them
  (``searchsorted``). Whenever at least ``k`` and at most ``capacity`` coordinates pass, the
  result is the exact top-k; fewer than ``k`` leaves padding (the selection's shortfall);
  more than ``capacity`` and the slots take an even subsample of them (``overflow``), whose
  top-k is close to but not the exact one. ``SelectionStats`` counts both, on the device.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

MIN_RANK = 32  # the sample's rank of the estimated threshold, at least
# A prime larger than any bucket: i -> (i * prime + offset) mod n visits distinct coordinates
# spread over the whole tensor (a strided sample would alias with a matrix's row length).
_SAMPLE_PRIME = 2_654_435_761


@dataclass
class Selection:
    positions: torch.Tensor  # int64 [k]
    valid: torch.Tensor | None = None  # bool [k], False at padding slots; None: all real


class SelectionStats:
    """How the selector did: calls, coordinates asked for, and (device counts, summed without
    being read back) the coordinates it missed, the calls short of k, the calls that overflowed.
    Reading ``missed``, ``short_calls``, ``overflow_calls`` or ``shortfall`` synchronises: do
    it at a log line or in a benchmark, not per bucket."""

    def __init__(self) -> None:
        self.calls = 0
        self.requested = 0
        self._counts: torch.Tensor | None = None  # [missed, short calls, overflowed calls]

    def record(self, k: int, valid: torch.Tensor | None = None, overflow: torch.Tensor | None = None) -> None:
        self.calls += 1
        self.requested += k
        if valid is None:  # an exact selection finds all k
            return
        missed = k - valid.sum()
        counts = torch.stack([missed, (missed > 0).long(), overflow.long()])
        self._counts = counts if self._counts is None else self._counts + counts

    def _read(self, index: int) -> int:
        return 0 if self._counts is None else int(self._counts[index].item())

    @property
    def missed(self) -> int:
        return self._read(0)

    @property
    def short_calls(self) -> int:
        return self._read(1)

    @property
    def overflow_calls(self) -> int:
        return self._read(2)

    @property
    def shortfall(self) -> float:
        """Fraction of the requested coordinates not found (0 for exact top-k)."""
        return self.missed / max(1, self.requested)


class Selector:
    name = "base"

    def __init__(self) -> None:
        self.stats = SelectionStats()

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        """Exactly ``k`` positions of ``magnitudes`` (1-D); ``key`` names the bucket's unit."""
        raise NotImplementedError

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        """``select`` of each row of ``magnitudes`` ([rows, n], units of one size): positions
        [rows, k] within each row. Row by row here; a selector that can does it in one call."""
        chosen = [self.select(row, k, key=(key, index)) for index, row in enumerate(magnitudes.unbind(0))]
        valid = None
        if any(c.valid is not None for c in chosen):
            valid = torch.stack([torch.ones(k, dtype=torch.bool, device=magnitudes.device) if c.valid is None
                                 else c.valid for c in chosen])
        return Selection(torch.stack([c.positions for c in chosen]), valid)

    def _topk_rows(self, magnitudes: torch.Tensor, k: int) -> Selection:
        for _ in range(magnitudes.shape[0]):
            self.stats.record(k)
        return Selection(torch.topk(magnitudes, k, dim=1, sorted=False).indices)


class TopK(Selector):
    name = "topk"

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        self.stats.record(k)
        return Selection(torch.topk(magnitudes, k, sorted=False).indices)

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        return self._topk_rows(magnitudes, k)


class SampledTopK(Selector):
    name = "sampled-topk"

    def __init__(self, sample_fraction: float = 0.01, min_sample: int = 1024, oversample: float = 2.0,
                 capacity: float = 2.0, seed: int = 0) -> None:
        """``oversample``: the threshold aims at ``oversample * k`` candidates; ``capacity``:
        slots for ``capacity * oversample * k`` of them. ``seed`` seeds the host generator that
        places the sample (a different one per rank is fine: selection is per rank)."""
        super().__init__()
        if capacity * oversample < 1:
            raise ValueError(f"capacity x oversample must be at least 1 (slots for k candidates); got "
                             f"{capacity} x {oversample}")
        self.sample_fraction = sample_fraction
        self.min_sample = min_sample
        self.oversample = oversample
        self.capacity = capacity
        self.offsets = random.Random(seed)

    def _threshold(self, magnitudes: torch.Tensor, k: int) -> torch.Tensor:
        """The estimated ``oversample * k``-th largest magnitude (a 0-d device tensor)."""
        n = magnitudes.numel()
        # Large enough that the threshold is about the MIN_RANK-th of the sample, not the 3rd:
        # a small k would otherwise leave it to chance whether k candidates pass.
        size = min(n, max(self.min_sample, int(n * self.sample_fraction),
                          math.ceil(MIN_RANK * n / (self.oversample * k))))
        sample_at = (torch.arange(size, device=magnitudes.device) * _SAMPLE_PRIME + self.offsets.randrange(n)) % n
        rank = min(size, max(1, math.ceil(size * self.oversample * k / n)))
        return torch.topk(magnitudes.index_select(0, sample_at), rank, sorted=False).values.min()

    def select_rows(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        if k * 4 >= magnitudes.shape[1]:  # as ``select``: exact, and in one call
            return self._topk_rows(magnitudes, k)
        return super().select_rows(magnitudes, k, key)

    def select(self, magnitudes: torch.Tensor, k: int, key: object = None) -> Selection:
        n = magnitudes.numel()
        if k * 4 >= n:  # sampling does not pay when most coordinates are sent
            self.stats.record(k)
            return Selection(torch.topk(magnitudes, k, sorted=False).indices)
        capacity = min(n, math.ceil(self.capacity * self.oversample * k))
        # Zeros never pass (sending one changes nothing): a gradient with fewer than k nonzero
        # coordinates sends all of them and pads, instead of overflowing with zeros. The floor
        # is the dtype's smallest positive value, subnormals included.
        finfo = torch.finfo(magnitudes.dtype)
        threshold = self._threshold(magnitudes, k).clamp(min=finfo.tiny * finfo.eps)
        count_dtype = torch.int32 if n < 2 ** 31 else torch.int64
        above = torch.cumsum(magnitudes >= threshold, 0, dtype=count_dtype)
        found = above.narrow(0, n - 1, 1).long()
        # Slot j (1-based) takes the ceil(j * found / capacity)-th coordinate above the threshold
        # when more than capacity passed (an even subsample), else the j-th: integer arithmetic.
        slots = torch.arange(1, capacity + 1, device=magnitudes.device, dtype=torch.int64)
        wanted = torch.where(found > capacity, (slots * found + capacity - 1) // capacity, slots).to(count_dtype)
        candidates = torch.searchsorted(above, wanted).clamp_(max=n - 1)
        real = wanted <= found
        scores = torch.where(real, magnitudes.index_select(0, candidates), -1.0)
        best = torch.topk(scores, k, sorted=False).indices
        valid = real.index_select(0, best)
        self.stats.record(k, valid, overflow=found.squeeze(0) > capacity)
        return Selection(candidates.index_select(0, best), valid)


def make_selector(name: str, seed: int = 0) -> Selector:
    if name == "topk":
        return TopK()
    if name == "sampled-topk":
        return SampledTopK(seed=seed)
    raise ValueError(f"unknown selector {name!r}; expected 'topk' or 'sampled-topk'")
