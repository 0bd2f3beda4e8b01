"""How many coordinates each bucket sends, and from which parts of it.

A Megatron gradient bucket is a flat tensor holding several parameters. Its plan splits
the bucket into up to three parts, each selected on its own so that data-parallel peers
and tensor-parallel replicas stay consistent:

* ``always``: parameters smaller than ``min_param_numel`` (biases, layer norms): every
  coordinate is sent every step (DGC keeps such layers dense);
* ``replicated``: parameters replicated across tensor-parallel ranks (``tensor_model_parallel``
  false, only when TP > 1). Their gradients are identical on every TP rank, but a top-k
  taken jointly with TP-sharded parameters would pick different coordinates on each TP
  rank and the replicas would drift apart; selected on their own, they pick the same ones;
* ``main``: everything else, selected over the bucket with the other parts masked out.

``k`` of each selected part is ``ceil(density * numel)``: fixed for a given density, so every
DP peer hands the collective the same payload size. ``always`` coordinates travel as values
only (their positions are in every peer's plan); selected ones as (int32 position, value).
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
    tensor_parallel: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


def _positions(ranges: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    if not ranges:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(s, e, dtype=torch.long, device=device) for s, e in ranges])


class BucketPlan:
    """The selection parts of one bucket (see module docstring)."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, tensor_parallel_size: int,
                 device: torch.device) -> None:
        self.numel = numel
        always = [(s.start, s.end) for s in slots if s.numel < min_param_numel]
        replicated = [(s.start, s.end) for s in slots
                      if s.numel >= min_param_numel and tensor_parallel_size > 1 and not s.tensor_parallel]
        self.always_positions = _positions(always, device)
        self.replicated_positions = _positions(replicated, device)
        self.masked_ranges = always + replicated
        self.main_numel = numel - self.always_positions.numel() - self.replicated_positions.numel()

    @property
    def n_always(self) -> int:
        return self.always_positions.numel()

    def k_selected(self, density: float) -> int:
        """Selected coordinates sent per step at ``density`` (fixed for a given density)."""
        return self.k_replicated(density) + self.k_main(density)

    def payload_bytes(self, density: float, dtype: torch.dtype) -> int:
        """Bytes one peer hands the all-gather per step: values of ``always``, pairs of the rest."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        size = self.n_always * itemsize + self.k_selected(density) * (4 + itemsize)
        return -(-size // 4) * 4  # padded to 4 bytes (see reduce.sparse_allreduce.pack)

    def k_replicated(self, density: float) -> int:
        n = self.replicated_positions.numel()
        return min(n, math.ceil(density * n))

    def k_main(self, density: float) -> int:
        return min(self.main_numel, math.ceil(density * self.main_numel))
