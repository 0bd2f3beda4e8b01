"""How many coordinates each bucket sends, and from which parameters.

A Megatron gradient bucket is a flat tensor holding several parameters. Its plan splits it:

* ``always``: parameters smaller than ``min_param_numel`` (biases, layer norms) send every
  coordinate every step, as values only: their positions are in every peer's plan (DGC
  keeps such layers dense too);
* every other parameter is its own selection unit and sends ``ceil(density * numel)`` of its
  coordinates (layer-wise top-k, as in DGC). Selecting per parameter keeps every layer
  moving (a bucket-wide top-k starves layers whose gradients are small in scale), and it
  keeps tensor-parallel replicas consistent: a parameter replicated across TP ranks has the
  same gradient on each of them, so its own top-k picks the same coordinates everywhere,
  whatever the TP-sharded parameters beside it in the bucket hold.

The counts are fixed for a given density, so every DP peer hands the collective a payload of
the same size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter's gradient sits in its bucket."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class BucketPlan:
    """The selection units of one bucket (see module docstring)."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, device: torch.device) -> None:
        self.numel = numel
        always = sorted((s.start, s.end) for s in slots if s.numel < min_param_numel)
        self.units = sorted((s for s in slots if s.numel >= min_param_numel), key=lambda s: s.start)
        self.always_positions = (
            torch.cat([torch.arange(s, e, dtype=torch.long, device=device) for s, e in always])
            if always else torch.empty(0, dtype=torch.long, device=device))

    @property
    def n_always(self) -> int:
        return self.always_positions.numel()

    def k_unit(self, unit: ParamSlot, density: float) -> int:
        return min(unit.numel, math.ceil(density * unit.numel))

    def k_selected(self, density: float) -> int:
        """Selected coordinates sent per step at ``density`` (fixed for a given density)."""
        return sum(self.k_unit(unit, density) for unit in self.units)

    def payload_bytes(self, density: float, dtype: torch.dtype) -> int:
        """Bytes one peer hands the all-gather per step: values of ``always``, pairs of the rest."""
        itemsize = dtype.itemsize
        size = self.n_always * itemsize + self.k_selected(density) * (4 + itemsize)
        return -(-size // 4) * 4  # padded to 4 bytes (see reduce.sparse_allreduce.pack)
