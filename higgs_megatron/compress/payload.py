"""How one peer's sparse payload is laid out on the wire: the formats of ``--higgs-payload``.

A payload carries, for one bucket (or one slice of it) and one step, the values of the
always-sent coordinates and ``k`` selected (position, value) pairs. ``k`` and every section's
size depend only on the plan and the density, so every DP peer hands the collective the same
number of bytes, and nothing here reads a device value on the host.

* ``wide``: int32 positions, values in the gradient's dtype (8 bytes a pair in fp32).
* ``bf16``: positions as 16-bit offsets within blocks of 64Ki coordinates, values in bf16
  (4 bytes a pair). The selected positions are sorted, and the payload leads with each
  block's first slot (one int32 per 64Ki coordinates of the bucket), so a slot's block is
  found again by a search; an offset is its position minus its block's start.
* ``int8``: the ``bf16`` positions, values as int8 with one fp32 scale per selection unit
  (a parameter): 3 bytes a pair.

Rounding and error feedback. ``round`` replaces the values by what every peer will decode
(bf16, or int8 times its scale, back in the gradient's dtype), before the residual is staged,
so the rounding error stays in the residual: ``sent + residual == accumulated`` still holds
exactly (the residual ``acc - sent`` is exact where the two are within a factor of two,
Sterbenz; elsewhere ``sent`` is 0). The always-sent values of ``bf16`` and ``int8`` travel in
bf16.

Wire layout, one peer: the 4-byte sections first, then the 2-byte ones, then the 1-byte one,
padded to 4 bytes, so every section of every peer stays aligned inside the gathered buffer:

* ``wide``: ``[int32 positions | always values | values]``
* ``bf16``: ``[int32 block starts | bf16 always | int16 offsets | bf16 values]``
* ``int8``: ``[int32 block starts | fp32 scales | bf16 always | int16 offsets | int8 values]``
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

BLOCK = 1 << 16  # coordinates per block: a 16-bit offset addresses one
_OFFSET_BIAS = 1 << 15  # offsets in [0, BLOCK) are stored as int16 in [-2**15, 2**15)
PAYLOADS = ("wide", "bf16", "int8")


@dataclass
class SlotLayout:
    """What a payload's sections are, for one plan at one density: fixed shapes, device constants."""

    numel: int  # coordinates the positions address (the bucket, or this rank's slice)
    always_positions: torch.Tensor  # int64 [n_always]
    k: int  # selected slots
    unit_of_slot: torch.Tensor  # int64 [k]: the selection unit of each slot (slots are grouped by unit)
    n_units: int

    @property
    def n_always(self) -> int:
        return self.always_positions.numel()

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // BLOCK)

    @cached_property
    def block_firsts(self) -> torch.Tensor:
        """int64 [n_blocks]: each block's first coordinate (made once per layout, not per step)."""
        return torch.arange(self.n_blocks, device=self.unit_of_slot.device, dtype=torch.int64) * BLOCK

    @cached_property
    def slots(self) -> torch.Tensor:
        """int64 [k]: 0..k-1, what a decoder searches the block starts for."""
        return torch.arange(self.k, device=self.unit_of_slot.device, dtype=torch.int64)


@dataclass
class SparseGrad:
    """One peer's compressed bucket: ``always`` at ``always_positions``, ``values`` at
    ``positions`` (0 at padding slots), as every peer will decode them; with ``int8``, the
    codes and per-unit scales that encode ``values``."""

    always: torch.Tensor  # [n_always], acc's dtype
    always_positions: torch.Tensor  # int64 [n_always], the plan's
    positions: torch.Tensor  # int64 [k]; sorted under the blocked formats
    values: torch.Tensor  # [k], acc's dtype
    codes: torch.Tensor | None = None  # int8 [k]
    scales: torch.Tensor | None = None  # fp32 [n_units]


def _pad4(parts: list[torch.Tensor]) -> torch.Tensor:
    size = sum(p.numel() for p in parts)
    if size % 4:
        parts.append(torch.zeros(4 - size % 4, dtype=torch.uint8, device=parts[0].device))
    return torch.cat(parts)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class _Reader:
    """Consecutive typed sections of one peer's uint8 payload."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        size = n * dtype.itemsize
        section = self.buffer.narrow(0, self.at, size).view(dtype)
        self.at += size
        return section


@dataclass(frozen=True)
class Payload:
    """One wire format (see the module docstring)."""

    name: str

    @property
    def blocked(self) -> bool:
        """Positions as 16-bit offsets in blocks: the selected positions must come sorted."""
        return self.name != "wide"

    def nbytes(self, layout_numel: int, n_always: int, k: int, n_units: int, dtype: torch.dtype) -> int:
        """Bytes one peer hands the all-gather, padding included."""
        if self.name == "wide":
            size = 4 * k + (n_always + k) * dtype.itemsize
        else:
            size = 4 * -(-layout_numel // BLOCK) + 2 * n_always + 2 * k + (2 if self.name == "bf16" else 1) * k
            if self.name == "int8":
                size += 4 * n_units
        return -(-size // 4) * 4

    def round(self, sparse: SparseGrad, layout: SlotLayout) -> SparseGrad:
        """``sparse`` with its values as every peer will decode them (see the module docstring)."""
        if self.name == "wide":
            return sparse
        dtype = sparse.values.dtype
        always = sparse.always.to(torch.bfloat16).to(dtype)
        if self.name == "bf16":
            return SparseGrad(always, sparse.always_positions, sparse.positions,
                              sparse.values.to(torch.bfloat16).to(dtype))
        magnitudes = sparse.values.abs().float()
        amax = torch.zeros(layout.n_units, dtype=torch.float32, device=magnitudes.device).scatter_reduce_(
            0, layout.unit_of_slot, magnitudes, "amax")
        scales = torch.where(amax > 0, amax / 127, 1.0)
        per_slot = scales.index_select(0, layout.unit_of_slot)
        codes = torch.round(sparse.values.float() / per_slot).clamp_(-127, 127)
        return SparseGrad(always, sparse.always_positions, sparse.positions, (codes * per_slot).to(dtype),
                          codes=codes.to(torch.int8), scales=scales)

    def pack(self, sparse: SparseGrad, layout: SlotLayout) -> torch.Tensor:
        """One peer's uint8 payload, ``nbytes`` long, from a ``round``ed ``sparse``."""
        if self.name == "wide":
            return _pad4([_bytes(sparse.positions.to(torch.int32)), _bytes(sparse.always), _bytes(sparse.values)])
        starts = torch.searchsorted(sparse.positions, layout.block_firsts).to(torch.int32)
        offsets = (torch.bitwise_and(sparse.positions, BLOCK - 1) - _OFFSET_BIAS).to(torch.int16)
        parts = [_bytes(starts)]
        if self.name == "int8":
            parts.append(_bytes(sparse.scales))
        parts += [_bytes(sparse.always.to(torch.bfloat16)), _bytes(offsets)]
        parts.append(_bytes(sparse.codes if self.name == "int8" else sparse.values.to(torch.bfloat16)))
        return _pad4(parts)

    def unpack(self, buffer: torch.Tensor, layout: SlotLayout, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(always values, int64 positions, selected values), in ``dtype``, from one peer's payload."""
        read, k = _Reader(buffer), layout.k
        if self.name == "wide":
            positions = read.take(k, torch.int32).long()
            return read.take(layout.n_always, dtype), positions, read.take(k, dtype)
        starts = read.take(layout.n_blocks, torch.int32).long()
        scales = read.take(layout.n_units, torch.float32) if self.name == "int8" else None
        always = read.take(layout.n_always, torch.bfloat16).to(dtype)
        offsets = read.take(k, torch.int16).long() + _OFFSET_BIAS
        blocks = torch.searchsorted(starts, layout.slots, right=True) - 1
        positions = blocks * BLOCK + offsets
        if self.name == "bf16":
            return always, positions, read.take(k, torch.bfloat16).to(dtype)
        codes = read.take(k, torch.int8).float()
        return always, positions, (codes * scales.index_select(0, layout.unit_of_slot)).to(dtype)


def payload_format(name: str) -> Payload:
    if name not in PAYLOADS:
        raise ValueError(f"unknown payload format {name!r}; expected one of {', '.join(PAYLOADS)}")
    return Payload(name)
