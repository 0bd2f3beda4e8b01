"""The sign codec on CUDA: Triton kernels, one pass per operation, equal to the reference.

What ``compress.row_codec`` dispatches to for CUDA tensors (Triton ships with CUDA builds of
torch). Each program handles one span of one row, so a span's scale is computed where its
values are: the sum of magnitudes by halving (``compress.agreed.halving_sum``'s order: a
reshape to (2, h) summed over its first axis adds slots i and i + h), the count of real slots,
their quotient correctly rounded (``div_rn``); the owner's sum adds the rows in order. The
bytes, sums and residuals equal the reference's bit for bit
(``tests/compress/test_row_triton.py`` runs these kernels in Triton's interpreter and compiles
them for a GPU).

Stream order: every kernel is launched on the current stream, reads what the stream wrote
before it and reads nothing on the host. The positions are the plan's rows (int64 [rows,
width]), each real slot's coordinate unique, so ``decode_add``'s read-add-write of a
coordinate has one writer; the padding's 0 is added after it as ``index_add_`` adds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .agreed import RowRuns, row_nbytes


@triton.jit
def _encode(src, positions, real, wire, scales, left, width, n_scales, row_bytes,
            SPAN: tl.constexpr, P2: tl.constexpr, LOG2: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    j = tl.arange(0, P2)
    slot = s * SPAN + j
    inside = (j < SPAN) & (slot < width)
    at = r * width + slot
    is_real = tl.load(real + at, mask=inside, other=0) != 0
    if ROWS:  # the values are the rows: the padding's own values
        v = tl.load(src + at, mask=inside, other=0.0)
    else:  # at the plan's positions: the padding 0
        coordinate = tl.load(positions + at, mask=inside & is_real, other=0)
        v = tl.load(src + coordinate, mask=inside & is_real, other=0.0)
    total = tl.where(is_real, tl.abs(v), 0.0)
    for i in tl.static_range(LOG2):
        total = tl.sum(tl.reshape(total, (2, P2 >> (i + 1))), axis=0)
    count = tl.sum(is_real.to(tl.int32), axis=0)
    scale = tl.where(count > 0, tl.math.div_rn(tl.sum(total, axis=0), count.to(tl.float32)), 1.0)
    tl.store(scales + r * (row_bytes // 4) + s, scale)
    positive = v >= 0
    weights = tl.where(positive & inside, 1 << (j % 8), 0)
    packed = tl.sum(tl.reshape(weights, (P2 // 8, 8)), axis=1)
    byte = tl.arange(0, P2 // 8)
    tl.store(wire + r * row_bytes + 4 * n_scales + (s * SPAN) // 8 + byte, packed.to(tl.uint8),
             mask=(byte * 8 < SPAN) & (s * SPAN + byte * 8 < width))
    decoded = tl.where(positive, scale, -scale)
    if ROWS:
        tl.store(left + at, v - tl.where(is_real, decoded, 0.0), mask=inside)
    else:
        tl.store(left + coordinate, v - decoded, mask=inside & is_real)


@triton.jit
def _decoded(wire, scales, real_row, r, s, width, n_scales, row_bytes, SPAN: tl.constexpr, P2: tl.constexpr):
    """Row r's span s: the scale with each slot's bit's sign, 0 at the padding."""
    j = tl.arange(0, P2)
    slot = s * SPAN + j
    inside = (j < SPAN) & (slot < width)
    is_real = tl.load(real_row + slot, mask=inside, other=0) != 0
    scale = tl.load(scales + r * (row_bytes // 4) + s)
    byte = tl.load(wire + r * row_bytes + 4 * n_scales + slot // 8, mask=inside, other=0).to(tl.int32)
    positive = ((byte >> (slot % 8)) & 1) != 0
    return tl.where(is_real, tl.where(positive, scale, -scale), 0.0), inside


@triton.jit
def _decode_sum(wire, scales, real_row, sums, rows, width, n_scales, row_bytes, SPAN: tl.constexpr,
                P2: tl.constexpr):
    s = tl.program_id(0)
    total, inside = _decoded(wire, scales, real_row, 0, s, width, n_scales, row_bytes, SPAN, P2)
    for r in range(1, rows):
        value, inside = _decoded(wire, scales, real_row, r, s, width, n_scales, row_bytes, SPAN, P2)
        total = total + value
    tl.store(sums + s * SPAN + tl.arange(0, P2), total, mask=inside)


@triton.jit
def _decode_add(wire, scales, positions, real, target, width, n_scales, row_bytes, SPAN: tl.constexpr,
                P2: tl.constexpr, OVERWRITE: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    value, inside = _decoded(wire, scales, real + r * width, r, s, width, n_scales, row_bytes, SPAN, P2)
    slot = s * SPAN + tl.arange(0, P2)
    is_real = tl.load(real + r * width + slot, mask=inside, other=0) != 0
    coordinate = tl.load(positions + r * width + slot, mask=inside & is_real, other=0)
    if OVERWRITE:  # as if zeroed first: 0 + value
        held = tl.zeros_like(value)
    else:
        held = tl.load(target + coordinate, mask=inside & is_real, other=0.0)
    tl.store(target + coordinate, held + value, mask=inside & is_real)


def _shape(span: int) -> dict[str, int]:
    p2 = 1 << max(0, span - 1).bit_length()
    return {"SPAN": span, "P2": max(p2, 8)}


def encode(src: torch.Tensor, positions: torch.Tensor | None, real: torch.Tensor, span: int,
           left: torch.Tensor, runs: RowRuns | None = None) -> torch.Tensor:
    """``compress.row_codec.encode`` (fp32 values; ``runs`` unused: the kernel reads ``positions``)."""
    rows, width = real.shape
    n_scales = -(-width // span)
    wire = torch.zeros(rows, row_nbytes(width, "sign", span, torch.float32), dtype=torch.uint8, device=src.device)
    shape = _shape(span)
    _encode[(rows, n_scales)](src, src if positions is None else positions, real, wire, wire.view(torch.float32), left,
                              width, n_scales, wire.shape[1], LOG2=shape["P2"].bit_length() - 1,
                              ROWS=positions is None, **shape)
    return wire


def decode_sum(wire: torch.Tensor, real_row: torch.Tensor, width: int, span: int,
               runs: RowRuns | None = None) -> torch.Tensor:
    """``compress.row_codec.decode_sum`` (``runs`` unused)."""
    sums = torch.empty(1, width, dtype=torch.float32, device=wire.device)
    n_scales = -(-width // span)
    _decode_sum[(n_scales,)](wire, wire.view(torch.float32), real_row, sums, wire.shape[0], width, n_scales,
                             wire.shape[1], **_shape(span))
    return sums


def decode_add(wire: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, span: int, target: torch.Tensor,
               runs: RowRuns | None = None, overwrite: bool = False) -> None:
    """``compress.row_codec.decode_add`` (an fp32 ``target``)."""
    rows, width = real.shape
    n_scales = -(-width // span)
    _decode_add[(rows, n_scales)](wire, wire.view(torch.float32), positions, real, target, width, n_scales,
                                  wire.shape[1], OVERWRITE=overwrite, **_shape(span))
    if runs is not None and runs.pads.numel():  # the padding's 0, as index_add_ adds it (it makes a -0 a +0)
        target.index_add_(0, runs.pads, torch.zeros(runs.pads.shape, dtype=target.dtype, device=target.device))
