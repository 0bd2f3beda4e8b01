"""The sign exchange's codec (1-bit Adam's, ``compress.agreed``'s ``sign`` rows), fused.

Three operations make a compressed step's local work, each one pass over memory in the fused
forms:

* ``encode``: a bucket's rows (its values at the plan's positions) to the wire, the residual
  (each value minus what the receivers decode) written back at the same positions;
* ``decode_sum``: the P rows an owner received, summed in row order;
* ``decode_add``: the rows gathered back, added into the bucket at their positions.

Each dispatches on the tensors, for a plan's rows at density 1 (``RowRuns``) with fp32 values:
on a CPU, the C loops of ``sign_codec.c`` (``compress.native``); on CUDA, the Triton kernels
of ``compress.sign_triton``; elsewhere, or where neither is there, the reference, the eager
torch ops of ``compress.agreed`` (``pack_rows``, ``unpack_rows``). The fused forms compute the same
values in the same order: their bytes, sums and residuals equal the reference's bit for bit
(``tests/compress/test_sign_codec.py``), so replicas stay equal whichever form a rank runs.

Stream order (CUDA): every operation runs on the current stream; nothing is read on the host.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .agreed import RowRuns, ordered_row_sum, pack_rows, row_nbytes, unpack_rows
from .native import sign_library


@lru_cache(maxsize=None)
def triton_kernels():
    """``compress.sign_triton``, or None where Triton is not installed (a CPU build of torch)."""
    try:
        from . import sign_triton
    except ImportError:
        return None
    return sign_triton


def _on_cuda(runs: RowRuns | None, values: torch.Tensor) -> bool:
    """The Triton kernels take CUDA tensors, the values in fp32, for rows at density 1."""
    return (runs is not None and values.device.type == "cuda" and values.dtype == torch.float32
            and triton_kernels() is not None)


def _fused(runs: RowRuns | None, values: torch.Tensor | None, *others: torch.Tensor) -> bool:
    """The C loops take the rows as runs, CPU tensors, contiguous, the values (if any) in fp32."""
    tensors = others if values is None else (values, *others)
    return (runs is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and (values is None or values.dtype == torch.float32) and sign_library() is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def encode(src: torch.Tensor, positions: torch.Tensor | None, real: torch.Tensor, span: int,
           left: torch.Tensor, runs: RowRuns | None = None) -> torch.Tensor:
    """uint8 [rows, row bytes]: the rows of ``src`` at ``positions`` (int64 [rows, width]; None:
    ``src`` is the rows, [rows, width]) as signs with a scale per ``span`` slots, ``real``
    (bool [rows, width]) marking the slots that are not padding (``runs``: the same rows, for
    the fused loops). ``left`` gets each value minus what is decoded from it: at the real
    slots' positions, or (``positions`` None) [rows, width] at every slot, the padding's value
    whole."""
    if _on_cuda(runs, src):
        return triton_kernels().encode(src, positions, real, span, left, runs)
    rows, width = real.shape
    wire = torch.empty(rows, row_nbytes(width, "sign", span, torch.float32), dtype=torch.uint8, device=src.device)
    if _fused(runs, src, left):
        n_runs = 0 if runs.runs is None else runs.runs.shape[0]
        if sign_library().sign_encode(src.data_ptr(), _ptr(runs.runs), n_runs, runs.used.data_ptr(), rows, width,
                                      span, wire.shape[1], wire.data_ptr(), left.data_ptr()) == 0:
            return wire
    values = src.view(rows, width) if positions is None else torch.where(
        real, src.index_select(0, positions.view(-1)).view(rows, width), 0)
    packed, rounded = pack_rows(values, "sign", span, real)
    wire.copy_(packed)
    if positions is None:
        torch.sub(values, rounded, out=left.view(rows, width))
    else:
        left.index_put_((positions.masked_select(real),), (values - rounded).masked_select(real))
    return wire


def decode_sum(wire: torch.Tensor, real_row: torch.Tensor, width: int, span: int,
               runs: RowRuns | None = None) -> torch.Tensor:
    """fp32 [1, width]: the sum of the rows ``wire`` [P, row bytes], each holding values for the
    same slots (``real_row``: bool [1, width]; ``runs``: that row's, ``RowRuns.row``), row 0
    first, then each in order."""
    if runs is not None and wire.device.type == "cuda" and triton_kernels() is not None:
        return triton_kernels().decode_sum(wire, real_row, width, span, runs)
    if _fused(runs, None, wire):
        sums = torch.empty(1, width, dtype=torch.float32)
        if sign_library().sign_decode_sum(wire.data_ptr(), runs.counts[0], wire.shape[0], width, span,
                                          wire.shape[1], sums.data_ptr()) == 0:
            return sums
    return ordered_row_sum(unpack_rows(wire, "sign", width, span, torch.float32, real_row))


def decode_add(wire: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, span: int,
               target: torch.Tensor, runs: RowRuns | None = None, overwrite: bool = False) -> None:
    """``target`` += the rows ``wire`` [P, row bytes] at ``positions`` (int64 [P, width]; the
    padding adds 0), as ``index_add_`` adds them. ``overwrite``: as if ``target`` were zeroed
    first where the rows hold a coordinate (the rest is left as it is; the fused forms write
    ``0 + value`` there, not a pass of zeros first)."""
    if _on_cuda(runs, target):
        triton_kernels().decode_add(wire, positions, real, span, target, runs, overwrite)
        return
    rows, width = real.shape
    if _fused(runs, target, wire) and runs.runs is not None:
        if sign_library().sign_decode_add(wire.data_ptr(), runs.runs.data_ptr(), runs.runs.shape[0],
                                          runs.used.data_ptr(), runs.pad.data_ptr(), rows, width, span, wire.shape[1],
                                          int(overwrite), target.data_ptr()) == 0:
            return
    if overwrite:
        target.index_fill_(0, positions.masked_select(real), 0)
    target.index_add_(0, positions.view(-1), unpack_rows(wire, "sign", width, span, target.dtype, real).view(-1))
