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

Every row has one layout (``layout``): a shard's pieces select their own counts and the row
pads the rest to the widest shard's count with empty slots (value 0), so every rank hands each
collective the same bytes. Wire per rank: an all-to-all of P rows, (P-1)/P x P rows, and an
all-gather of one, (P-1) rows, each row about 1/P of a flat payload: both flat in P.

One layout is also what keeps the work per bucket flat in P: the rows are rounded, packed and
decoded as one [P, ...] batch, and the pieces that fill a whole shard (at large P, nearly all)
are selected in one call over the rows of the [P, shard] view. What loops in Python is the
pieces a parameter boundary cuts, about two per parameter of the bucket, whatever P.

Pure tensor code: no process group (``reduce.sharded_reduce`` holds the collectives).
"""

from __future__ import annotations

import torch

from .compressor import ParamSlot, Selector, k_of
from .payload import Payload, SlotLayout, SparseGrad, payload_format, position_encoding, scale_span


_KEPT_LAYOUTS = 4  # a step's density, the owners' density, the dense steps' 1.0, and one to spare


class ShardedPlan:
    """The selection units of a bucket of ``numel`` coordinates cut into ``world`` shards, and
    the one layout of every shard's row. Shards are Megatron's: ``ceil(numel / world)``
    coordinates each (the distributed optimizer pads its buckets to a multiple of ``world``, so
    there they are its shards exactly); a small bucket's last shards may be short or empty,
    and count as padded to the others' length."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, world: int, device: torch.device,
                 payload: Payload | str = "wide") -> None:
        self.numel, self.world, self.device = numel, world, device
        self.payload = payload_format(payload) if isinstance(payload, str) else payload
        self.shard = -(-numel // world)
        self.bounds = [(min(r * self.shard, numel), min((r + 1) * self.shard, numel)) for r in range(world)]
        # A parameter is sent whole or selected by its own size, not by its piece's: a large
        # one cut small at a shard bound is still selected (at 1,024 ranks most pieces are small).
        large = [s for s in slots if not s.sent_whole(min_param_numel)]
        small = sorted((s.start, s.end) for s in slots if s.sent_whole(min_param_numel))
        self.pieces = [_pieces(large, lo, hi) for lo, hi in self.bounds]  # per shard, relative to its start
        # Shards one piece fills whole: selected together, as rows of the [world, shard] view.
        self.full_shards = [j for j, pieces in enumerate(self.pieces)
                            if len(pieces) == 1 and pieces[0].numel == self.shard]
        self._full = set(self.full_shards)
        self._full_index = torch.tensor(self.full_shards, dtype=torch.int64, device=device)  # made once, here
        self._layouts: dict[float, SlotLayout] = {}
        self._no_always = torch.empty(0, dtype=torch.int64, device=device)
        # The small ones go by an all-reduce of their own, not in the rows: where a shard holds
        # many of them (a run of layer norms) they would widen every row to its width.
        self.always_positions = (torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in small])
                                 if small else self._no_always)

    def always_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the small parameters' all-reduce."""
        return self.always_positions.numel() * dtype.itemsize

    def take_always(self, acc: torch.Tensor) -> torch.Tensor:
        """The small parameters' values of ``acc``, for their all-reduce; they are zeroed in
        ``acc``, so the rows, the owner's sum and the residual hold none of them."""
        always = acc.index_select(0, self.always_positions)
        acc.index_fill_(0, self.always_positions, 0)
        return always

    def shard_k(self, shard: int, density: float) -> int:
        """Coordinates shard ``shard``'s pieces select at ``density``."""
        return sum(k_of(piece.numel, density) for piece in self.pieces[shard])

    def k_selected(self, density: float) -> int:
        """Coordinates one rank selects over the whole bucket at ``density``."""
        return sum(self.shard_k(shard, density) for shard in range(self.world))

    def layout(self, density: float) -> SlotLayout:
        """Every row's layout at ``density``: the widest shard's count of slots over ``shard``
        coordinates. Where every piece sends every coordinate, a blocked format sends the whole
        shard in order (the implicit encoding)."""
        if density not in self._layouts:
            if len(self._layouts) >= _KEPT_LAYOUTS:  # a ramp asks for a new density every step
                del self._layouts[next(iter(self._layouts))]
            every = self.payload.blocked and any(self.pieces) and all(
                k_of(piece.numel, density) == piece.numel for pieces in self.pieces for piece in pieces)
            k = self.shard if every else max(self.shard_k(shard, density) for shard in range(self.world))
            self._layouts[density] = SlotLayout(self.shard, self._no_always, k,
                                                position_encoding(self.payload.name, self.shard, k, every),
                                                scale_span(density))
        return self._layouts[density]

    def row_bytes(self, density: float, dtype: torch.dtype, payload: Payload | None = None) -> int:
        """Bytes of one row (one shard's payload) at ``density``."""
        return (payload or self.payload).nbytes(self.layout(density), dtype)

    def compress_rows(self, acc: torch.Tensor, density: float, selector: Selector, rank: int, key: object = None,
                      payload: Payload | None = None, left: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [world, row bytes]: row j is this rank's payload for shard j, its own top
        ``density`` of ``acc`` there (per piece). Row ``rank`` is zero: this rank's own shard goes
        whole into its sum (``sum_shard``), not on the wire. ``left`` (as long as the bucket), if
        given, gets what is left of ``acc`` after sending: per shard ``acc`` less its payload,
        and zero on this rank's own shard."""
        payload = payload or self.payload
        rows = self._as_rows(acc)
        sent = self._compress(rows, list(range(self.world)), density, selector, key, payload)
        packed = payload.pack_rows(sent, self.layout(density))
        packed.select(0, rank).zero_()
        if left is not None:
            whole = self.world * self.shard == self.numel  # else ``rows`` is a padded copy
            remains = self._left_after(rows, sent, left.view(self.world, self.shard) if whole else None)
            remains.select(0, rank).zero_()
            if not whole:
                left.copy_(remains.view(-1).narrow(0, 0, self.numel))
        return packed

    def sum_shard(self, rank: int, own: torch.Tensor, received: torch.Tensor, density: float,
                  payload: Payload | None = None) -> torch.Tensor:
        """fp32: shard ``rank`` summed over the group, in rank order: ``own`` (this rank's
        accumulated gradient there) at its place, every other rank's row decoded (all rows in
        one pass)."""
        payload = payload or self.payload
        others = torch.cat([received.narrow(0, 0, rank), received.narrow(0, rank + 1, self.world - rank - 1)])
        decoded = payload.decode_rows(others, self.layout(density), torch.float32)  # row ``rank`` is not a payload
        total = torch.zeros(own.numel(), dtype=torch.float32, device=own.device)
        for peer in range(self.world):
            total.add_(own if peer == rank else decoded.select(0, peer - (peer > rank)).narrow(0, 0, own.numel()))
        return total

    def compress_sum(self, rank: int, total: torch.Tensor, density: float, selector: Selector, key: object = None,
                     payload: Payload | None = None) -> torch.Tensor:
        """The owner's row for the all-gather: its own top ``density`` of its shard's sum
        ``total`` (per piece), in every row's layout. ``total`` becomes what is left of it
        (fp32): the owner's residual there."""
        payload = payload or self.payload
        rows = torch.zeros(1, self.shard, dtype=total.dtype, device=total.device)
        rows.select(0, 0).narrow(0, 0, total.numel()).copy_(total)
        sent = self._compress(rows, [rank], density, selector, (key, "sum"), payload)
        total.copy_(self._left_after(rows, sent).select(0, 0).narrow(0, 0, total.numel()))
        return payload.pack_rows(sent, self.layout(density)).squeeze(0)

    def add_gathered(self, target: torch.Tensor, gathered: torch.Tensor, density: float,
                     payload: Payload | None = None) -> None:
        """``target`` (the bucket) = every owner's row of ``gathered`` (uint8 [world, row
        bytes]) decoded into its shard: the same bytes, so the same gradient, on every rank.
        The small parameters' sums are the caller's to put in."""
        decoded = (payload or self.payload).decode_rows(gathered, self.layout(density), target.dtype)
        target.copy_(decoded.reshape(-1).narrow(0, 0, self.numel))  # (bf16 values decode as a strided view)

    def _as_rows(self, acc: torch.Tensor) -> torch.Tensor:
        """``acc`` as [world, shard]: a view, or a copy padded with zeros past the bucket's end."""
        if self.world * self.shard == self.numel:
            return acc.view(self.world, self.shard)
        rows = torch.zeros(self.world * self.shard, dtype=acc.dtype, device=acc.device)
        rows.narrow(0, 0, self.numel).copy_(acc)
        return rows.view(self.world, self.shard)

    def _compress(self, rows: torch.Tensor, shards: list[int], density: float, selector: Selector, key: object,
                  payload: Payload) -> SparseGrad:
        """The rounded payloads of ``rows`` ([len(shards), shard]: the accumulated gradient on
        those shards), one a row, each its pieces' top ``density``, in every row's layout: a
        shard with fewer slots than the widest ends in empty ones (position 0, value 0)."""
        layout = self.layout(density)
        empty = rows.new_empty(rows.shape[0], 0)
        if layout.encoding == "implicit":  # every coordinate, in order: nothing to select
            return payload.round_rows(SparseGrad(empty, self._no_always, None, rows), layout)
        positions, real = self._select(rows, shards, density, selector, key)
        if layout.encoding == "offsets":  # 16-bit offsets need each row's positions sorted
            positions, order = torch.sort(positions, dim=1)
            real = real.gather(1, order)
        values = torch.where(real, rows.gather(1, positions), 0)
        return payload.round_rows(SparseGrad(empty, self._no_always, positions, values), layout)

    def _select(self, rows: torch.Tensor, shards: list[int], density: float, selector: Selector, key: object
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [rows, k] positions in each row, bool [rows, k]: which slots are real). The
        shards one piece fills whole are selected in one call when every shard is asked for."""
        k_row = self.layout(density).k
        positions = torch.zeros(len(shards), k_row, dtype=torch.int64, device=rows.device)
        real = torch.zeros(len(shards), k_row, dtype=torch.bool, device=rows.device)
        batched = len(shards) == self.world and len(self.full_shards) > 1
        if batched:
            k = k_of(self.shard, density)
            chosen = selector.select_rows(rows.index_select(0, self._full_index).abs(), k, key=(key, "full"))
            positions.narrow(1, 0, k).index_copy_(0, self._full_index, chosen.positions)
            if chosen.valid is None:
                real.narrow(1, 0, k).index_fill_(0, self._full_index, True)
            else:
                real.narrow(1, 0, k).index_copy_(0, self._full_index, chosen.valid)
        for row, shard in enumerate(shards):
            if batched and shard in self._full:
                continue
            at = 0
            for piece in self.pieces[shard]:
                k = k_of(piece.numel, density)
                chosen = selector.select(rows.select(0, row).narrow(0, piece.start, piece.numel).abs(), k,
                                         key=(key, shard, piece.start))
                positions.select(0, row).narrow(0, at, k).copy_(chosen.positions + piece.start)
                if chosen.valid is None:
                    real.select(0, row).narrow(0, at, k).fill_(True)
                else:
                    real.select(0, row).narrow(0, at, k).copy_(chosen.valid)
                at += k
        return positions, real

    @staticmethod
    def _left_after(rows: torch.Tensor, sent: SparseGrad, out: torch.Tensor | None = None) -> torch.Tensor:
        """What is left of ``rows`` after sending ``sent`` (rounded), into ``out`` if given:
        exact, as ``left_after``."""
        out = torch.empty_like(rows) if out is None else out
        if sent.positions is None:  # every coordinate: the rounding is what is left
            return torch.sub(rows, sent.values, out=out)
        return out.copy_(rows).scatter_add_(1, sent.positions, sent.values.neg())


def _pieces(slots: list[ParamSlot], lo: int, hi: int) -> list[ParamSlot]:
    """The parts of ``slots`` inside ``[lo, hi)``, relative to ``lo``."""
    return [ParamSlot(max(s.start, lo) - lo, min(s.end, hi) - lo) for s in slots if s.end > lo and s.start < hi]
