"""Agreed masks: every data-parallel rank sends the same coordinates, so values sum on the way.

The all-gather of per-rank top-k puts (P-1) payloads on each rank's link: it grows with the
number of ranks P, and past a few ranks it sends more than a dense all-reduce. When every
rank sends the *same* coordinates, their values can be summed by a reduce-scatter-shaped
exchange instead, whose bytes per rank do not grow with P. The coordinates come from block
scores that every rank agrees on (SCAPE; ARC-Top-K), taken one step late so that their small
all-reduce overlaps instead of waiting in the backward hook.

The plan (``AgreedPlan``), fixed for a bucket and a group of P ranks:

* the bucket is cut into P shards of ``ceil(numel / P)`` coordinates: shard j is owned by
  rank j, as the distributed optimizer's shards are (so with it the owner's sums are its
  optimizer's gradient shard);
* every parameter of at least ``min_param_numel`` coordinates is cut at the shard bounds into
  *pieces*, and each piece into blocks of ``block`` coordinates. Selecting per piece keeps
  every layer moving (layer-wise top-k, as in DGC) and keeps TP-replicated parameters
  identical across TP ranks (their scores are the same on every TP rank of a DP replica);
  a piece sends ``ceil(density x blocks)`` of its blocks every step, a fixed number;
* smaller parameters (biases, layer norms) go whole every step, by an all-reduce of their own
  in the gradient's dtype (``always_positions``): in the rows they would all widen the rows of
  the few owners whose shards hold them, and every row is as wide as the widest.

Per step, on every rank alike (``select``): the agreed scores of the last step rank each
piece's blocks; the chosen blocks make, per owner, a row of ``width`` slots (the widest owner's count; the others pad with slots that carry 0). Row j
holds what rank j sums. A piece sent whole takes its own length; otherwise each chosen block
takes ``block`` slots, and those past the piece's end in its last block are padding too (their
position is the piece's last coordinate, and they carry 0). A shard should hold many blocks:
where it holds one or two, ``ceil(density x blocks)`` sends it whole, and the rule that no step
sends more than dense sends the bucket dense.

Values go on the wire in the format of ``--higgs-payload`` (``wide``: the gradient's dtype;
``bf16``; ``int8``/``int4``/``sign`` with an fp32 scale per ``SPAN`` slots of a row, ``sign``
one bit a slot), with no positions: the positions are known to every rank. ``pack_rows`` rounds the values as the receiver will decode them, so the rounding
stays in the error-feedback residual.

``sign`` is 1-bit Adam's exchange (Tang et al., 2021) on these rows: each slot is sent as the sign
of its value, and a span's scale is the mean magnitude of its real slots (the scale that makes
``scale x sign`` closest to the values in L2). A scale per 256 slots, not per 2,048 as the
int8 dense step's: a sign carries no magnitude, so a span's one scale is every coordinate's, and
at 2,048 the update of 1-bit Adam ended 4% above dense's loss at P = 64 where at 256 it ended
below it (``docs/compression.md``). A sign cannot say zero, so the padding slots, which
every rank knows (``select``'s ``real``), are masked on both sides: they carry no magnitude into a
scale and decode to 0. At density 1 every coordinate goes, nothing is selected, and a plan that
never selects (``scored=False``) sends no block scores: about 1/28 of an fp32 all-reduce's wire
bytes per step at any P (1.125 bits a coordinate each way), the owner's re-signed sums included.

Scores (``scores``): per block, the sum of squares of what this rank expects to send next
step, ``residual + gradient`` (the gradient stands in for the next one), summed over the ranks
by an all-reduce in bf16 (half a byte per coordinate of a block of 128 against an fp32
all-reduce's four: 1/256 of dense's bytes). ``ScoreBuffer`` keeps the agreed scores with the
residual's commit and rollback, so a dropped step leaves them as they were.

Shapes depend only on the plan and the density; nothing reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compressor import ParamSlot, k_of
from .payload import bit_weights

BLOCK = 128  # coordinates per block: what one agreed score stands for
SPAN = 256  # int8/int4/sign: slots of a row per fp32 scale (sign: an eighth of a bit a slot)
VALUE_FORMATS = ("wide", "bf16", "int8", "int4", "sign")
_LEVELS = {"int8": 127, "int4": 7}
_SCALED = ("int8", "int4", "sign")


@dataclass(frozen=True)
class Piece:
    """A parameter's coordinates inside one shard, and its blocks in the plan's block order."""

    start: int
    end: int
    owner: int
    first_block: int
    n_blocks: int


@dataclass
class AgreedLayout:
    """The rows at one density: blocks per piece, slots per owner, the common row width."""

    k_blocks: list[int]  # per piece
    width: int  # slots per row (the widest owner's)
    span: int  # int8/int4/sign: slots per scale

    @property
    def n_scales(self) -> int:
        return -(-self.width // self.span)


@dataclass(frozen=True)
class RowRuns:
    """Where a plan's rows at density 1 sit in the bucket, for the fused codecs (made once with
    the plan, on the host, from its pieces: ``AgreedPlan.row_runs``): each row's real slots
    are its first ``used``; ``runs`` (int64 [n, 3], CPU) are (slot of the flattened rows,
    coordinate, length) covering them, sorted by slot (None: the rows are the values
    themselves); ``pad`` (int64 [rows], CPU) the coordinate row r's padding points to (-1: none)."""

    runs: torch.Tensor | None
    used: torch.Tensor
    pad: torch.Tensor
    counts: tuple[int, ...]  # ``used`` on the host (a step reads no device value)
    pads: torch.Tensor  # int64, the plan's device: the coordinates of ``pad`` that are not -1

    def row(self, r: int) -> "RowRuns":
        """Row ``r`` alone, as values (the owner's sums)."""
        return RowRuns(None, self.used.narrow(0, r, 1), self.pad.narrow(0, r, 1), self.counts[r:r + 1],
                       self.pads.narrow(0, 0, 0))


class AgreedPlan:
    """The shards, pieces and blocks of one bucket for a group of ``world`` ranks (see above)."""

    def __init__(self, numel: int, slots: list[ParamSlot], min_param_numel: int, world: int, device: torch.device,
                 value_format: str = "wide", block: int = BLOCK, scored: bool = True) -> None:
        if value_format not in VALUE_FORMATS:
            raise ValueError(f"unknown value format {value_format!r}; expected one of {', '.join(VALUE_FORMATS)}")
        self.numel, self.world, self.block, self.device = numel, world, block, device
        self.value_format = value_format
        self.scored = scored  # False: every step is at density 1, so no block is ever chosen by score
        self.shard = -(-numel // world)
        self.pieces: list[Piece] = []
        block_starts: list[int] = []
        for unit in sorted((s for s in slots if not s.sent_whole(min_param_numel)), key=lambda s: s.start):
            start = unit.start
            while start < unit.end:
                owner = start // self.shard
                end = min(unit.end, (owner + 1) * self.shard)
                n_blocks = -(-(end - start) // block)
                self.pieces.append(Piece(start, end, owner, len(block_starts), n_blocks))
                block_starts += range(start, end, block)
                start = end
        # Segments that tile [0, numel): every block, and the runs between pieces (scored, then dropped).
        lengths, block_segments, at = [], [], 0
        for piece in self.pieces:
            if piece.start > at:
                lengths.append(piece.start - at)
            for first in range(piece.start, piece.end, block):
                block_segments.append(len(lengths))
                lengths.append(min(block, piece.end - first))
            at = piece.end
        if numel > at:
            lengths.append(numel - at)
        self.n_blocks = len(block_starts)
        self._lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self._block_segments = torch.tensor(block_segments, dtype=torch.int64, device=device)
        self._block_starts = torch.tensor(block_starts, dtype=torch.int64, device=device)
        always = sorted((s.start, s.end) for s in slots if s.sent_whole(min_param_numel))
        self.always_positions = (torch.cat([torch.arange(s, e, dtype=torch.int64, device=device) for s, e in always])
                                 if always else torch.empty(0, dtype=torch.int64, device=device))
        self._offsets = torch.arange(block, dtype=torch.int64, device=device)
        self._layouts: dict[float, AgreedLayout] = {}
        self._fixed_rows: dict[float, tuple[torch.Tensor, torch.Tensor, list[tuple[Piece, int, int]]]] = {}
        self._in_shard: dict[tuple[int, float], torch.Tensor] = {}
        # the rows at density 1 for the fused codec (compress.row_codec), made here, not in a step (no host data there),
        # and the coordinates no row holds at density 1 (the always-sent ones, the bucket's padding)
        self.row_runs = self._row_runs()
        gaps, at = [], 0
        for piece in sorted(self.pieces, key=lambda p: p.start):
            gaps += [(at, piece.start)] if piece.start > at else []
            at = piece.end
        gaps += [(at, numel)] if numel > at else []
        self.outside_rows = (torch.cat([torch.arange(a, b, dtype=torch.int64, device=device) for a, b in gaps])
                             if gaps else torch.empty(0, dtype=torch.int64, device=device))

    def layout(self, density: float) -> AgreedLayout:
        if density not in self._layouts:
            k_blocks = [k_of(piece.n_blocks, density) for piece in self.pieces]
            per_owner = [0] * self.world
            for piece, k in zip(self.pieces, k_blocks):  # a piece sent whole takes its own length
                per_owner[piece.owner] += piece.end - piece.start if k == piece.n_blocks else k * self.block
            width = row_width(max(per_owner), self.value_format)
            self._layouts[density] = AgreedLayout(k_blocks, width, min(SPAN, width))
        return self._layouts[density]

    def _row_runs(self) -> RowRuns:
        """``RowRuns`` of the rows at density 1: each piece whole, in order, in its owner's row."""
        width = self.layout(1.0).width
        used, runs = [0] * self.world, []
        for piece in self.pieces:
            runs.append((piece.owner * width + used[piece.owner], piece.start, piece.end - piece.start))
            used[piece.owner] += piece.end - piece.start
        pad = [min(owner * self.shard, self.numel - 1) if used[owner] < width else -1 for owner in range(self.world)]
        return RowRuns(torch.tensor(sorted(runs), dtype=torch.int64).view(-1, 3), torch.tensor(used, dtype=torch.int64),
                       torch.tensor(pad, dtype=torch.int64), tuple(used),
                       torch.tensor([p for p in pad if p >= 0], dtype=torch.int64, device=self.device))

    def row_bytes(self, density: float, dtype: torch.dtype, value_format: str | None = None) -> int:
        """Bytes of one row on the wire (padded to 4), in the plan's value format or ``value_format``."""
        layout = self.layout(density)
        return row_nbytes(layout.width, value_format or self.value_format, layout.span, dtype)

    def always_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the always-sent values' all-reduce."""
        return self.always_positions.numel() * dtype.itemsize

    def score_bytes(self) -> int:
        """Bytes of the scores' all-reduce (bf16, one per block; none where nothing is scored)."""
        return 2 * self.n_blocks if self.scored else 0

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [n_blocks]: each block's sum of squares of ``x``."""
        squares = x.float().square()
        return torch.segment_reduce(squares, "sum", lengths=self._lengths).index_select(0, self._block_segments)

    def _fixed(self, density: float) -> tuple[torch.Tensor, torch.Tensor, list[tuple[Piece, int, int]]]:
        """What the rows at ``density`` hold whatever the scores, made once per density (the last
        few are kept): the positions and real slots of the pieces sent whole and of
        the padding (int64 and bool [world, width]), and for each piece that chooses its blocks
        (piece, blocks, where its slots start in the flattened rows)."""
        if density not in self._fixed_rows:
            if len(self._fixed_rows) >= 2:  # a ramp changes the density every step: keep density 1 and the last
                self._fixed_rows.pop(next(d for d in self._fixed_rows if d != 1.0))
            layout = self.layout(density)
            positions = torch.empty(self.world, layout.width, dtype=torch.int64, device=self.device)
            real = torch.zeros(self.world, layout.width, dtype=torch.bool, device=self.device)
            used = [0] * self.world
            chosen: list[tuple[Piece, int, int]] = []

            def put(owner: int, values: torch.Tensor) -> None:
                positions[owner].narrow(0, used[owner], values.numel()).copy_(values)
                real[owner].narrow(0, used[owner], values.numel()).fill_(True)
                used[owner] += values.numel()

            for piece, k in zip(self.pieces, layout.k_blocks):
                if k == piece.n_blocks:  # every block: the piece's coordinates in order
                    put(piece.owner, torch.arange(piece.start, piece.end, dtype=torch.int64, device=self.device))
                else:
                    chosen.append((piece, k, piece.owner * layout.width + used[piece.owner]))
                    used[piece.owner] += k * self.block
            for owner in range(self.world):  # padding points into the owner's own shard and carries 0
                positions[owner].narrow(0, used[owner], layout.width - used[owner]).fill_(
                    min(owner * self.shard, self.numel - 1))
            self._fixed_rows[density] = (positions, real, chosen)
        return self._fixed_rows[density]

    def in_shard(self, positions: torch.Tensor, real: torch.Tensor, rank: int, density: float) -> torch.Tensor:
        """int64 [width]: ``rank``'s row of ``positions`` as coordinates of its shard, its padding
        as the spare one past the shard (``shard``), where the owner's residual keeps it; made
        once where nothing is chosen by score (the rows are the fixed ones)."""
        key = (rank, density)
        if key in self._in_shard:
            return self._in_shard[key]
        mine, mine_real = positions.select(0, rank), real.select(0, rank)
        in_shard = torch.where(mine_real, mine - rank * self.shard, self.shard)
        if not self._fixed(density)[2]:
            self._in_shard[key] = in_shard
        return in_shard

    def select(self, scores: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [world, width] positions, bool [world, width] real slots) from the agreed
        ``scores``: the same on every rank that holds the same scores."""
        fixed_positions, fixed_real, chosen = self._fixed(density)
        if not chosen:  # nothing chosen by score (every piece whole): the fixed rows, read only
            return fixed_positions, fixed_real
        positions, real = fixed_positions.clone(), fixed_real.clone()
        flat_positions, flat_real = positions.view(-1), real.view(-1)
        for piece, k, at in chosen:
            blocks = torch.topk(scores.narrow(0, piece.first_block, piece.n_blocks), k,
                                sorted=False).indices + piece.first_block
            slots = (self._block_starts.index_select(0, blocks).unsqueeze(1) + self._offsets).view(-1)
            flat_real.narrow(0, at, slots.numel()).copy_(slots < piece.end)
            flat_positions.narrow(0, at, slots.numel()).copy_(slots.clamp_(max=piece.end - 1))
        return positions, real


def row_width(slots: int, value_format: str) -> int:
    """Slots of a row holding ``slots`` values, padded to whole bytes (8 signs, or 2 int4 codes, a byte)."""
    multiple = 8 if value_format == "sign" else 2
    return -(-max(1, slots) // multiple) * multiple


def row_nbytes(width: int, value_format: str, span: int, dtype: torch.dtype) -> int:
    """Bytes of one row of ``width`` slots as ``pack_rows`` makes it (padded to 4): values in
    ``value_format`` (``dtype``'s width for 'wide'), and for the scaled formats an fp32 scale per
    ``span`` slots."""
    size = {"wide": dtype.itemsize * width, "bf16": 2 * width, "int8": width, "int4": width // 2,
            "sign": width // 8}[value_format]
    if value_format in _SCALED:
        size += 4 * -(-width // span)
    return -(-size // 4) * 4


def pack_rows(values: torch.Tensor, value_format: str, span: int, real: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [rows, row bytes] for the wire, the values as the receiver decodes them) from
    ``values`` [rows, width]: fp32 scales per ``span`` slots then codes for int8/int4/sign.
    ``real`` (bool [rows, width]; ``sign`` needs it) marks the slots that are not padding."""
    rows, width = values.shape
    if value_format == "wide":
        return _pad4(values.contiguous().view(torch.uint8).view(rows, -1)), values
    if value_format == "bf16":
        wire = values.to(torch.bfloat16)
        return _pad4(wire.view(torch.uint8).view(rows, -1)), wire.to(values.dtype)
    if value_format == "sign":
        return _pack_signs(values, span, real)
    levels = _LEVELS[value_format]
    n_scales = -(-width // span)
    padded = torch.nn.functional.pad(values.float(), (0, n_scales * span - width))
    amax = padded.abs().view(rows, n_scales, span).amax(2)
    scales = torch.where(amax > 0, amax / levels, 1.0)
    per_slot = scales.repeat_interleave(span, dim=1).narrow(1, 0, width)
    codes = torch.round(values.float() / per_slot).clamp_(-levels, levels)
    rounded = (codes * per_slot).to(values.dtype)
    codes = codes.to(torch.int8)
    body = codes.view(torch.uint8) if value_format == "int8" else _nibbles(codes)
    return _pad4(torch.cat([scales.view(torch.uint8).view(rows, -1), body], dim=1)), rounded


def unpack_rows(wire: torch.Tensor, value_format: str, width: int, span: int, dtype: torch.dtype,
                real: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, width] values in ``dtype`` from ``pack_rows``' bytes (``real`` as there)."""
    rows = wire.shape[0]
    if value_format == "wide":
        return wire.narrow(1, 0, width * dtype.itemsize).contiguous().view(dtype)
    if value_format == "bf16":
        return wire.narrow(1, 0, 2 * width).contiguous().view(torch.bfloat16).to(dtype)
    n_scales = -(-width // span)
    scales = wire.narrow(1, 0, 4 * n_scales).contiguous().view(torch.float32)
    per_slot = scales.repeat_interleave(span, dim=1).narrow(1, 0, width)
    if value_format == "sign":
        positive = _from_bits(wire.narrow(1, 4 * n_scales, width // 8))
        return torch.where(real, torch.where(positive, per_slot, per_slot.neg()), 0).to(dtype)
    body = wire.narrow(1, 4 * n_scales, width if value_format == "int8" else width // 2)
    codes = body.contiguous().view(torch.int8) if value_format == "int8" else _from_nibbles(body)
    return (codes.float() * per_slot).to(dtype).view(rows, width)


def _pack_signs(values: torch.Tensor, span: int, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_rows`` for ``sign``: per span, the mean magnitude of its real slots (1 where it has
    none, so that nothing divides by 0 on the way back); a bit per slot, set where the value is
    0 or more; padding decodes to 0."""
    rows, width = values.shape
    n_scales = -(-width // span)
    fill = n_scales * span - width
    magnitudes = torch.where(real, values.abs().float(), 0)
    sums = halving_sum(torch.nn.functional.pad(magnitudes, (0, fill)).view(rows, n_scales, span))
    counts = torch.nn.functional.pad(real, (0, fill)).view(rows, n_scales, span).sum(2, dtype=torch.float32)
    scales = torch.where(counts > 0, sums / counts.clamp(min=1), 1.0)
    per_slot = scales.repeat_interleave(span, dim=1).narrow(1, 0, width)
    positive = values >= 0
    rounded = torch.where(real, torch.where(positive, per_slot, per_slot.neg()), 0).to(values.dtype)
    bits = (positive.view(rows, width // 8, 8).to(torch.uint8) * bit_weights(values.device)).sum(2, dtype=torch.uint8)
    return _pad4(torch.cat([scales.view(torch.uint8).view(rows, -1), bits], dim=1)), rounded


def halving_sum(x: torch.Tensor) -> torch.Tensor:
    """``x``'s sum over its last dimension in a fixed order: padded with zeros to a power of two,
    then slots i and i + h added, h from half of it down to 1. The fused codecs sum a span in this
    order, so their scales equal these bit for bit (``torch.sum``'s order is its own)."""
    width = x.shape[-1]
    padded = 1 << max(0, width - 1).bit_length()
    if padded != width:
        x = torch.nn.functional.pad(x, (0, padded - width))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x.narrow(-1, 0, half) + x.narrow(-1, half, half)
    return x.squeeze(-1)


def ordered_row_sum(rows: torch.Tensor) -> torch.Tensor:
    """[1, width]: the sum of ``rows`` [P, width], row 0 first, then each in order (the fused
    codecs' order; ``sum(0)``'s is its own)."""
    sums = rows.narrow(0, 0, 1).clone()
    for row in rows.narrow(0, 1, rows.shape[0] - 1):
        sums.add_(row)
    return sums


def _from_bits(packed: torch.Tensor) -> torch.Tensor:
    """bool [rows, 8 x bytes] from ``_pack_signs``' bits."""
    rows = packed.shape[0]
    return torch.bitwise_and(packed.unsqueeze(2), bit_weights(packed.device)).ne(0).view(rows, -1)


def _pad4(rows: torch.Tensor) -> torch.Tensor:
    extra = -rows.shape[1] % 4
    return torch.nn.functional.pad(rows, (0, extra)) if extra else rows


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7], [rows, even width] -> uint8 [rows, width / 2], the first of a pair low."""
    biased = (codes.to(torch.int16) + 8).to(torch.uint8)
    pairs = biased.view(codes.shape[0], -1, 2)
    return torch.bitwise_or(pairs.select(2, 0), torch.bitwise_left_shift(pairs.select(2, 1), 4))


def _from_nibbles(packed: torch.Tensor) -> torch.Tensor:
    halves = torch.stack([torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)], 2)
    return (halves.view(packed.shape[0], -1).to(torch.int16) - 8).to(torch.int8)


class ScoreBuffer:
    """The agreed block scores in force (``committed``) and those the step in flight is
    gathering (``staged``), which take over when the next step begins if the optimizer took
    this one (``settle``)."""

    def __init__(self, n_blocks: int, device: torch.device) -> None:
        self.committed = torch.zeros(n_blocks, dtype=torch.float32, device=device)
        self.staged: torch.Tensor | None = None

    def commit(self) -> None:
        if self.staged is not None:
            self.committed, self.staged = self.staged, None

    def rollback(self) -> None:
        self.staged = None

    def settle(self, kept: bool) -> None:
        """End the last step: its scores take over (``kept``: the optimizer took it) or are dropped."""
        self.commit() if kept else self.rollback()

    def settled(self, kept: bool) -> torch.Tensor:
        """The scores in force once the last step is settled (what a resumed run must start from)."""
        return self.staged if self.staged is not None and kept else self.committed

    @property
    def current(self) -> torch.Tensor:
        """What a resumed run must start from, the last step taken."""
        return self.settled(True)

    def load(self, value: torch.Tensor) -> None:
        self.committed = value.reshape(-1).to(torch.float32).clone()
        self.staged = None
