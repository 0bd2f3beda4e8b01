"""The sharded form's plan: one bucket cut at the P shard bounds, each shard with a plan of its own.

Where the sparse form all-gathers every rank's top-k (wire bytes per rank grow with P) and
the agreed form makes every rank send the same blocks (flat in P, but one common choice of
coordinates loses more loss at the same density), the sharded form keeps each rank's own
top-k and still stays flat in P, as Ok-Topk's sparse reduce-scatter (Li and Hoefler, PPoPP
2022) and gTop-k do:

1. each rank selects, per parameter piece of shard j (a parameter cut at the shard bounds),
   its own top ``density`` of its accumulated gradient there, and sends that payload (the
   sparse form's format: a bitmap or offsets, and values) to shard j's owner, rank j, by an
   all-to-all. A rank's own shard is not sent: it adds it whole to the sum, for no bytes.
   Small parameters (under ``min_param_numel``) are summed whole by an all-reduce of their
   own, in the gradient's dtype;
2. the owner sums its shard: its own accumulated gradient plus every other rank's payload;
3. with the distributed optimizer that sum is the shard the optimizer reads. Without it, the
   owner selects the top ``density`` of the sum (per piece again), keeps what it did not
   send in its own residual (error feedback on the sum: applied + Σ residuals = Σ accumulated
   over the group), and an all-gather brings every owner's payload to every rank.

Each shard's payload has a fixed size at a given density (``BucketPlan``), so every rank hands
each collective the same bytes; the rows are padded to the widest shard's. Wire per rank: an
all-to-all of P rows, (P-1)/P x P rows, and an all-gather of one, (P-1) rows, each row about
1/P of a flat payload: both flat in P.

Pure planning: no process group (``reduce.sharded_reduce`` holds the collectives).
"""

from __future__ import annotations

import torch

from .compressor import BucketPlan, ParamSlot, compress, left_after
from .payload import Payload, payload_format
from .selection import Selector


class ShardedPlan:
    """One ``BucketPlan`` per shard of a bucket of ``numel`` coordinates over ``world`` ranks.
    Shards are Megatron's: ``ceil(numel / world)`` coordinates each (the distributed
    optimizer pads its buckets to a multiple of ``world``, so there they are its shards
    exactly); a small bucket's last shards may be short or empty."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, world: int, device: torch.device,
                 payload: Payload | str = "wide") -> None:
        self.numel, self.world, self.device = numel, world, device
        self.payload = payload_format(payload) if isinstance(payload, str) else payload
        self.shard = -(-numel // world)
        self.bounds = [(min(r * self.shard, numel), min((r + 1) * self.shard, numel)) for r in range(world)]
        # A parameter is sent whole or selected by its own size, not by its piece's: a large
        # one cut small at a shard bound is still selected (at 1,024 ranks most pieces are small).
        large = [s for s in slots if s.numel >= min_param_numel]
        small = sorted((s.start, s.end) for s in slots if s.numel < min_param_numel)
        self.shards = [BucketPlan(hi - lo, _pieces(large, lo, hi), 0, device, self.payload)  # every piece a unit
                       for lo, hi in self.bounds]
        self._row_bytes: dict[tuple[float, torch.dtype, Payload | None], int] = {}
        # The small ones go by an all-reduce of their own, not in the rows: where a shard holds
        # many of them (a run of layer norms) they would widen every row to its width.
        self.always_positions = (torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in small])
                                 if small else torch.empty(0, dtype=torch.int64, device=device))

    def always_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the small parameters' all-reduce."""
        return self.always_positions.numel() * dtype.itemsize

    def take_always(self, acc: torch.Tensor) -> torch.Tensor:
        """The small parameters' values of ``acc``, for their all-reduce; they are zeroed in
        ``acc``, so the rows, the owner's sum and the residual hold none of them."""
        always = acc.index_select(0, self.always_positions)
        acc.index_fill_(0, self.always_positions, 0)
        return always

    def row_bytes(self, density: float, dtype: torch.dtype, payload: Payload | None = None) -> int:
        """Bytes of one row (one shard's payload, padded to the widest shard's) at ``density``;
        kept, as it is asked for several times a step and looks at every shard."""
        key = (density, dtype, payload)
        if key not in self._row_bytes:
            self._row_bytes[key] = max(plan.payload_bytes(density, dtype, payload) for plan in self.shards)
        return self._row_bytes[key]

    def k_selected(self, density: float) -> int:
        """Coordinates one rank selects over the whole bucket at ``density``."""
        return sum(plan.k_selected(density) for plan in self.shards)

    def compress_rows(self, acc: torch.Tensor, density: float, selector: Selector, rank: int, key: object = None,
                      payload: Payload | None = None, left: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [world, row bytes]: row j is this rank's payload for shard j, ``compress`` of
        ``acc`` there at ``density``. Row ``rank`` stays zero: this rank's own shard goes whole
        into its sum (``sum_shard``), not on the wire. ``left`` (as long as the bucket), if
        given, gets what is left of ``acc`` after sending: per shard ``acc`` less its payload,
        and zero on this rank's own shard."""
        payload = payload or self.payload
        rows = torch.zeros(self.world, self.row_bytes(density, acc.dtype, payload), dtype=torch.uint8,
                           device=acc.device)
        for owner, ((lo, hi), plan) in enumerate(zip(self.bounds, self.shards)):
            if owner == rank or hi == lo:
                if left is not None:
                    left.narrow(0, lo, hi - lo).zero_()
                continue
            piece = acc.narrow(0, lo, hi - lo)
            sent = compress(piece, plan, density, selector, key=(key, owner), payload=payload)
            packed = payload.pack(sent, plan.layout(density))
            rows.select(0, owner).narrow(0, 0, packed.numel()).copy_(packed)
            if left is not None:
                left_after(piece, sent, left.narrow(0, lo, hi - lo))
        return rows

    def sum_shard(self, rank: int, own: torch.Tensor, received: torch.Tensor, density: float,
                  payload: Payload | None = None) -> torch.Tensor:
        """fp32: shard ``rank`` summed over the group, in rank order: ``own`` (this rank's
        accumulated gradient there) at its place, every other rank's row decoded."""
        payload, layout = payload or self.payload, self.shards[rank].layout(density)
        total = torch.zeros(own.numel(), dtype=torch.float32, device=own.device)
        for peer in range(self.world):
            if peer == rank:
                total.add_(own)
            elif own.numel():
                payload.add_to(total, received.select(0, peer), layout)
        return total

    def compress_sum(self, rank: int, total: torch.Tensor, density: float, selector: Selector, key: object = None,
                     payload: Payload | None = None) -> torch.Tensor:
        """The owner's row for the all-gather: ``compress`` of its shard's sum ``total`` at
        ``density``, padded as every row is. ``total`` becomes what is left of it (fp32): the
        owner's residual there."""
        payload, plan = payload or self.payload, self.shards[rank]
        row = torch.zeros(self.row_bytes(density, total.dtype, payload), dtype=torch.uint8, device=total.device)
        if total.numel():
            sent = compress(total, plan, density, selector, key=(key, "sum"), payload=payload)
            packed = payload.pack(sent, plan.layout(density))
            row.narrow(0, 0, packed.numel()).copy_(packed)
            left_after(total.clone(), sent, total)
        return row

    def add_gathered(self, target: torch.Tensor, gathered: torch.Tensor, density: float,
                     payload: Payload | None = None) -> None:
        """``target`` (the bucket) = every owner's row of ``gathered`` (uint8 [world, row
        bytes]) decoded into its shard: the same bytes, so the same gradient, on every rank.
        The small parameters' sums are the caller's to put in."""
        payload = payload or self.payload
        target.zero_()
        for owner, ((lo, hi), plan) in enumerate(zip(self.bounds, self.shards)):
            if hi > lo:
                payload.add_to(target.narrow(0, lo, hi - lo), gathered.select(0, owner), plan.layout(density))


def _pieces(slots: list[ParamSlot], lo: int, hi: int) -> list[ParamSlot]:
    """The parts of ``slots`` inside ``[lo, hi)``, relative to ``lo``."""
    return [ParamSlot(max(s.start, lo) - lo, min(s.end, hi) - lo) for s in slots if s.end > lo and s.start < hi]
