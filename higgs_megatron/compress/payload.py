"""How one peer's sparse payload is laid out on the wire: the formats of ``--higgs-payload``.

A payload carries, for one bucket (or one slice of it) and one step, the values of the
always-sent coordinates and ``k`` selected (position, value) pairs. ``k`` and every section's
size depend only on the plan and the density, so every DP peer hands the collective the same
number of bytes, and nothing here reads a device value on the host.

* ``wide``: int32 positions, values in the gradient's dtype (8 bytes a pair in fp32).
* ``bf16``: values in bf16; positions in the smallest of three encodings (``SlotLayout.encoding``):
  - ``offsets``: 16-bit offsets within blocks of 64Ki coordinates. The selected positions
    are sorted, and the payload leads with each block's first slot (one int32 per 64Ki
    coordinates), so a slot's block is found again by a search (2 bytes a pair);
  - ``bitmap``: one bit per coordinate of the bucket, smaller above a density of about 1/16;
    the values follow in position order;
  - ``implicit``: every coordinate is sent (density 1), in order: no positions, and no
    separate always-sent section.
* ``int8``: the same positions, int8 values with one fp32 scale per span of coordinates
  (``SlotLayout.span``, a power of two chosen so that a scale covers about 256 slots and at
  least 2,048 coordinates: the scales cost under 2% of the values). At density 1 this is the
  dense int8 step of ``--higgs-dense-int8``: a quarter of an fp32 gradient's bytes.
* ``int4``: as ``int8`` with 4-bit codes in [-7, 7], two to a byte.

Rounding and error feedback. ``round`` replaces the values by what every peer will decode
(bf16, or a code times its scale, back in the gradient's dtype), before the residual is staged,
so the rounding error stays in the residual: ``sent + residual == accumulated`` still holds
exactly (the residual ``acc - sent`` is exact where the two are within a factor of two,
Sterbenz; elsewhere ``sent`` is 0). The always-sent values of the blocked formats travel in
bf16.

Wire layout, one peer: the 4-byte sections first, then the 2-byte ones, then the 1-byte ones,
padded to 4 bytes, so every section of every peer stays aligned inside the gathered buffer:

* ``wide``: ``[int32 positions | always values | values]``
* blocked: ``[int32 block starts (offsets) | fp32 scales (int8, int4) | bf16 always | int16
  offsets (offsets) | bf16 values (bf16) | uint8 bitmap (bitmap) | int8 values (int8) | int4
  values, two a byte, the first in the low half (int4)]``

Padding slots (a sampled selector that came up short) repeat some position with value 0. A
bitmap cannot repeat a position, so its encoder merges repeated positions (their values sum:
the real value plus zeros) and fills the slots left over with 0; the decoder maps those slots
to the bucket's last coordinate, where adding 0 changes nothing.

The bitmap's encoder and decoder work in passes over the bucket, not in sorts or searches:
the encoder takes the selected positions in any order, and puts each value at its slot, the
number of set bits before it (a running count of the bitmap); the decoder writes each set
coordinate into its slot by the same count. So the selector's positions need no sort under a
bitmap (only 16-bit offsets need them sorted), and the decoder does no binary search.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

BLOCK = 1 << 16  # coordinates per block: a 16-bit offset addresses one
_OFFSET_BIAS = 1 << 15  # offsets in [0, BLOCK) are stored as int16 in [-2**15, 2**15)
SLOTS_PER_SCALE = 256  # int8: about this many slots share a scale
MIN_SPAN = 2048  # int8: a scale covers at least this many coordinates
PAYLOADS = ("wide", "bf16", "int8", "int4")
_LEVELS = {"int8": 127, "int4": 7}  # codes in [-levels, levels]


@dataclass
class SlotLayout:
    """What a payload's sections are, for one plan at one density: sizes from Python ints; the
    device constants a decoder needs are made on first use and kept with the layout."""

    numel: int  # coordinates the positions address (the bucket, or this rank's slice)
    always_positions: torch.Tensor  # int64 [n_always], the plan's
    k: int  # selected slots (implicit: every coordinate)
    encoding: str  # 'int32' (wide), 'offsets', 'bitmap' or 'implicit'
    span: int  # int8: coordinates per scale (a power of two)

    @property
    def n_always(self) -> int:
        """Always-sent values in their own section (none when every coordinate is a slot)."""
        return 0 if self.encoding == "implicit" else self.always_positions.numel()

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // BLOCK)

    @property
    def n_scales(self) -> int:
        return -(-self.numel // self.span)

    @property
    def position_bytes(self) -> int:
        return {"int32": 4 * self.k, "offsets": 4 * self.n_blocks + 2 * self.k,
                "bitmap": -(-self.numel // 8), "implicit": 0}[self.encoding]

    @cached_property
    def device(self) -> torch.device:
        return self.always_positions.device

    @cached_property
    def block_firsts(self) -> torch.Tensor:
        """int64 [n_blocks]: each block's first coordinate."""
        return torch.arange(self.n_blocks, device=self.device, dtype=torch.int64) * BLOCK

    @cached_property
    def slots(self) -> torch.Tensor:
        """int64 [k]: 0..k-1, what the offsets' decoder searches the block starts for."""
        return torch.arange(self.k, device=self.device, dtype=torch.int64)

    @property
    def bit_weights(self) -> torch.Tensor:
        return bit_weights(self.device)


@lru_cache(maxsize=None)
def bit_weights(device: torch.device) -> torch.Tensor:
    """uint8 [8]: 1, 2, 4 ... 128, the weights of a byte's bits (the first slot in the lowest),
    made on the device once (no host data: the first use is inside the gradient path)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=device),
                                    torch.arange(8, dtype=torch.uint8, device=device))


def scale_span(density: float) -> int:
    """int8's coordinates per scale at ``density``: a power of two, at least ``MIN_SPAN``, about
    ``SLOTS_PER_SCALE`` slots."""
    span = MIN_SPAN
    while span * density < SLOTS_PER_SCALE and span < 1 << 30:
        span *= 2
    return span


def position_encoding(payload: str, numel: int, k: int, every_coordinate: bool) -> str:
    """The smallest position encoding of ``payload`` for ``k`` slots among ``numel`` coordinates."""
    if payload == "wide":
        return "int32"
    if every_coordinate:
        return "implicit"
    return "bitmap" if -(-numel // 8) < 4 * -(-numel // BLOCK) + 2 * k else "offsets"


@dataclass
class SparseGrad:
    """One peer's compressed bucket: ``always`` at ``always_positions``, ``values`` at
    ``positions`` (0 at padding slots), as every peer will decode them; with ``int8``, the
    codes and per-span scales that encode ``values``. ``positions`` is None when every
    coordinate is sent (the implicit encoding): ``values`` is then the whole bucket and
    ``always`` is empty."""

    always: torch.Tensor  # [n_always], acc's dtype
    always_positions: torch.Tensor  # int64 [n_always], the plan's
    positions: torch.Tensor | None  # int64 [k]; sorted under 16-bit offsets
    values: torch.Tensor  # [k], acc's dtype
    codes: torch.Tensor | None = None  # int8 [k]
    scales: torch.Tensor | None = None  # fp32 [n_scales]


@dataclass(frozen=True)
class Packed:
    """One peer's payload as it goes on the wire: the bytes (``Payload.pack``), and the format
    and layout every peer decodes them with."""

    buffer: torch.Tensor  # uint8, the same size on every peer
    payload: "Payload"
    layout: SlotLayout


def _pad4(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows of uint8 sections side by side, padded to a multiple of 4 bytes."""
    size = sum(p.shape[-1] for p in parts)
    if size % 4:
        parts.append(torch.zeros(parts[0].shape[0], 4 - size % 4, dtype=torch.uint8, device=parts[0].device))
    return torch.cat(parts, dim=1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A row tensor's bytes, row by row: [rows, n * itemsize] uint8."""
    return t.contiguous().view(torch.uint8)


class _Reader:
    """Consecutive typed sections of rows of uint8 payloads ([rows, bytes], one peer a row)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        size = n * dtype.itemsize
        section = self.buffer.narrow(1, self.at, size)
        self.at += size
        # Sections are aligned to their type's size in every row, and rows are 4-byte multiples,
        # so a view is possible except where the rows were handed in as a non-contiguous slice.
        return (section if section.stride(0) % dtype.itemsize == 0 else section.contiguous()).view(dtype)


def _span_amax(values: torch.Tensor, positions: torch.Tensor | None, layout: SlotLayout) -> torch.Tensor:
    """fp32 [rows, n_scales]: the largest magnitude in each span (0 where none is sent)."""
    magnitudes = values.abs().float()
    rows = magnitudes.shape[0]
    if positions is None:  # every coordinate, in order: spans are runs of the values
        padded = torch.nn.functional.pad(magnitudes, (0, layout.n_scales * layout.span - layout.numel))
        return padded.view(rows, layout.n_scales, layout.span).amax(2)
    return torch.zeros(rows, layout.n_scales, dtype=torch.float32, device=magnitudes.device).scatter_reduce_(
        1, positions // layout.span, magnitudes, "amax")


def _per_slot(scales: torch.Tensor, positions: torch.Tensor | None, layout: SlotLayout) -> torch.Tensor:
    if positions is None:
        return scales.repeat_interleave(layout.span, dim=1).narrow(1, 0, layout.numel)
    return scales.gather(1, positions // layout.span)


def _bitmap(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 [rows, numel rounded up to 8]: 1 at each of ``positions`` (in any order, repeats allowed)."""
    bits = torch.zeros(positions.shape[0], -(-numel // 8) * 8, dtype=torch.uint8, device=positions.device)
    return bits.scatter_(1, positions, 1)


def _in_position_order(bits: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """The bitmap's value section: ``values`` summed per distinct position, in position order,
    then zeros. A slot's place is the number of set bits before its position; a repeat is a
    padding slot's and carries 0, so the sum is the real value."""
    place = torch.cumsum(bits, 1, dtype=torch.int32).gather(1, positions).long() - 1
    wide = values.to(torch.int32 if values.dtype == torch.int8 else values.dtype)
    return torch.zeros(values.shape[0], k, dtype=wide.dtype, device=wide.device).scatter_add_(
        1, place, wide).to(values.dtype)


def _bitmap_positions(packed: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    """int64 [rows, k]: the set coordinates of each row's packed bitmap, in order, then the last
    coordinate for each slot left over. Each set coordinate is written to its slot (the set bits
    before it); each unset coordinate i to a spare place, k + i, past the slots, so every write
    has a place of its own and the result does not depend on the order of the writes."""
    k, numel, device, rows = layout.k, layout.numel, packed.device, packed.shape[0]
    bits = torch.bitwise_and(packed.unsqueeze(2), layout.bit_weights).ne(0).view(rows, -1).narrow(1, 0, numel)
    place = torch.where(bits, torch.cumsum(bits, 1).sub_(1), torch.arange(k, k + numel, device=device))
    positions = torch.full((rows, k + numel), numel - 1, dtype=torch.int64, device=device)
    coordinates = torch.arange(numel, device=device).expand(rows, numel)
    return positions.scatter_(1, place, coordinates).narrow(1, 0, k)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] -> uint8, two a byte (code + 8 in each half, the first low), per row."""
    biased = (codes.to(torch.int16) + 8).to(torch.uint8)
    if biased.shape[1] % 2:
        biased = torch.cat([biased, biased.new_full((biased.shape[0], 1), 8)], dim=1)
    pairs = biased.view(biased.shape[0], -1, 2)
    return torch.bitwise_or(pairs.select(2, 0), torch.bitwise_left_shift(pairs.select(2, 1), 4))


def _unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    halves = torch.stack([torch.bitwise_and(packed, 15), torch.bitwise_right_shift(packed, 4)], 2)
    return (halves.view(packed.shape[0], -1).narrow(1, 0, k).to(torch.int16) - 8).to(torch.int8)


def _as_rows(sparse: SparseGrad) -> SparseGrad:
    """One peer's ``SparseGrad`` as the one row of a batch."""
    def row(t):
        return None if t is None else t.unsqueeze(0)
    return SparseGrad(row(sparse.always), sparse.always_positions, row(sparse.positions), row(sparse.values),
                      row(sparse.codes), row(sparse.scales))


def _first_row(sparse: SparseGrad) -> SparseGrad:
    def first(t):
        return None if t is None else t.squeeze(0)
    return SparseGrad(first(sparse.always), sparse.always_positions, first(sparse.positions), first(sparse.values),
                      first(sparse.codes), first(sparse.scales))


@dataclass(frozen=True)
class Payload:
    """One wire format (see the module docstring). Each operation has a form for one peer's
    payload and one for rows of them (``*_rows``: several peers, or several shards, at one
    layout, in one pass of each kernel); the one-peer form is the one-row case."""

    name: str

    @property
    def blocked(self) -> bool:
        """Positions as offsets in blocks or a bitmap (not int32)."""
        return self.name != "wide"

    @property
    def scaled(self) -> bool:
        """Integer codes with a scale per span."""
        return self.name in _LEVELS

    def value_bytes(self, k: int) -> int:
        return {"bf16": 2 * k, "int8": k, "int4": -(-k // 2)}[self.name]

    def nbytes(self, layout: SlotLayout, dtype: torch.dtype) -> int:
        """Bytes one peer hands the all-gather, padding included."""
        if self.name == "wide":
            size = 4 * layout.k + (layout.n_always + layout.k) * dtype.itemsize
        else:
            size = layout.position_bytes + 2 * layout.n_always + self.value_bytes(layout.k)
            if self.scaled:
                size += 4 * layout.n_scales
        return -(-size // 4) * 4

    def round(self, sparse: SparseGrad, layout: SlotLayout) -> SparseGrad:
        """``sparse`` with its values as every peer will decode them (see the module docstring)."""
        return _first_row(self.round_rows(_as_rows(sparse), layout))

    def round_rows(self, sparse: SparseGrad, layout: SlotLayout) -> SparseGrad:
        """``round`` of rows: ``sparse``'s tensors are [rows, ...], one payload a row."""
        if self.name == "wide":
            return sparse
        dtype = sparse.values.dtype
        always = sparse.always.to(torch.bfloat16).to(dtype)
        if self.name == "bf16":
            return SparseGrad(always, sparse.always_positions, sparse.positions,
                              sparse.values.to(torch.bfloat16).to(dtype))
        levels = _LEVELS[self.name]
        amax = _span_amax(sparse.values, sparse.positions, layout)
        scales = torch.where(amax > 0, amax / levels, 1.0)
        per_slot = _per_slot(scales, sparse.positions, layout)
        codes = torch.round(sparse.values.float() / per_slot).clamp_(-levels, levels)
        return SparseGrad(always, sparse.always_positions, sparse.positions, (codes * per_slot).to(dtype),
                          codes=codes.to(torch.int8), scales=scales)

    def pack(self, sparse: SparseGrad, layout: SlotLayout) -> torch.Tensor:
        """One peer's uint8 payload, ``nbytes`` long, from a ``round``ed ``sparse``."""
        return self.pack_rows(_as_rows(sparse), layout).squeeze(0)

    def pack_rows(self, sparse: SparseGrad, layout: SlotLayout) -> torch.Tensor:
        """uint8 [rows, nbytes]: ``pack`` of each row of a ``round_rows``ed ``sparse``."""
        if self.name == "wide":
            return _pad4([_bytes(sparse.positions.to(torch.int32)), _bytes(sparse.always), _bytes(sparse.values)])
        rows = sparse.values.shape[0]
        values = sparse.codes if self.scaled else sparse.values.to(torch.bfloat16)
        parts = []
        if layout.encoding == "offsets":
            firsts = layout.block_firsts.expand(rows, layout.n_blocks).contiguous()
            parts.append(_bytes(torch.searchsorted(sparse.positions, firsts).to(torch.int32)))
        if self.scaled:
            parts.append(_bytes(sparse.scales))
        parts.append(_bytes(sparse.always.to(torch.bfloat16)))
        if layout.encoding == "offsets":
            parts.append(_bytes((torch.bitwise_and(sparse.positions, BLOCK - 1) - _OFFSET_BIAS).to(torch.int16)))
        elif layout.encoding == "bitmap":
            bits = _bitmap(sparse.positions, layout.numel)
            values = _in_position_order(bits, sparse.positions, values, layout.k)
        if self.name == "bf16":
            parts.append(_bytes(values))
        if layout.encoding == "bitmap":
            parts.append((bits.view(rows, -1, 8) * layout.bit_weights).sum(2, dtype=torch.uint8))
        if self.name == "int8":
            parts.append(_bytes(values))
        elif self.name == "int4":
            parts.append(_pack_nibbles(values))
        return _pad4(parts)

    def unpack(self, buffer: torch.Tensor, layout: SlotLayout, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(always values, int64 positions, selected values), in ``dtype``, from one peer's
        payload; positions None: the values are every coordinate, in order."""
        always, positions, values = self.unpack_rows(buffer.unsqueeze(0), layout, dtype)
        return always.squeeze(0), None if positions is None else positions.squeeze(0), values.squeeze(0)

    def unpack_rows(self, buffer: torch.Tensor, layout: SlotLayout, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``unpack`` of each row of ``buffer`` (uint8 [rows, bytes], each from its start): each
        of the three is [rows, ...]."""
        read, k, rows = _Reader(buffer), layout.k, buffer.shape[0]
        if self.name == "wide":
            positions = read.take(k, torch.int32).long()
            return read.take(layout.n_always, dtype), positions, read.take(k, dtype)
        starts = read.take(layout.n_blocks, torch.int32).long() if layout.encoding == "offsets" else None
        scales = read.take(layout.n_scales, torch.float32) if self.scaled else None
        always = read.take(layout.n_always, torch.bfloat16).to(dtype)
        positions = None
        if layout.encoding == "offsets":
            offsets = read.take(k, torch.int16).long() + _OFFSET_BIAS
            slots = layout.slots.expand(rows, k).contiguous()
            positions = (torch.searchsorted(starts, slots, right=True) - 1) * BLOCK + offsets
        values = read.take(k, torch.bfloat16).to(dtype) if self.name == "bf16" else None
        if layout.encoding == "bitmap":
            positions = _bitmap_positions(read.take(-(-layout.numel // 8), torch.uint8), layout)
        if self.name == "bf16":
            return always, positions, values
        codes = (read.take(k, torch.int8) if self.name == "int8"
                 else _unpack_nibbles(read.take(-(-k // 2), torch.uint8), k)).float()
        return always, positions, (codes * _per_slot(scales, positions, layout)).to(dtype)

    def add_to(self, target: torch.Tensor, buffer: torch.Tensor, layout: SlotLayout) -> None:
        """Add one peer's payload (``buffer``, read from its start) into ``target`` at its positions."""
        always, positions, values = self.unpack(buffer, layout, target.dtype)
        if positions is None:  # every coordinate, in order
            target.add_(values)
            return
        if always.numel():
            target.index_add_(0, layout.always_positions, always)
        target.index_add_(0, positions, values)

    def decode_rows(self, buffer: torch.Tensor, layout: SlotLayout, dtype: torch.dtype) -> torch.Tensor:
        """[rows, numel]: each row of ``buffer`` decoded into coordinates of its own (0 where
        nothing is sent): the payloads of several peers, or of several shards, in one pass."""
        always, positions, values = self.unpack_rows(buffer, layout, dtype)
        if positions is None:  # every coordinate, in order
            return values
        dense = torch.zeros(buffer.shape[0], layout.numel, dtype=dtype, device=buffer.device)
        if always.numel():
            dense.index_copy_(1, layout.always_positions, always)
        # a padding slot repeats a position with 0: added, not written over the real value
        return dense.scatter_add_(1, positions, values)


DENSE_INT8 = Payload("int8")  # a dense step under ``--higgs-dense-int8``: every coordinate (density 1)


def payload_format(name: str) -> Payload:
    if name not in PAYLOADS:
        raise ValueError(f"unknown payload format {name!r}; expected one of {', '.join(PAYLOADS)}")
    return Payload(name)
