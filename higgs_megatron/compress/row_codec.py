"""The agreed rows' codec at density 1, fused: 1-bit Adam's signs, and the dense steps' int8.

``compress.agreed``'s rows in ``sign`` (1-bit Adam's exchange) or ``int8`` (a dense step, its
stage and its refresh windows). Three operations make a step's local work, each one pass over
memory in the fused forms:

* ``encode``: a bucket's rows (its values at the plan's positions) to the wire, the residual
  (each value minus what the receivers decode) written back at the same positions;
* ``decode_sum``: the P rows an owner received, summed in row order;
* ``decode_add``: the rows gathered back, added into the bucket at their positions.

Each dispatches on the tensors, for a plan's rows at density 1 (``RowRuns``) with fp32 values:
on a CPU, the C loops of ``row_codec.c`` (``compress.native``); on CUDA, the Triton kernels
of ``compress.row_triton`` (signs; int8 there is the reference's); elsewhere, or where neither is there, the reference, the eager
torch ops of ``compress.agreed`` (``pack_rows``, ``unpack_rows``). The fused forms compute the same
values in the same order: their bytes, sums and residuals equal the reference's bit for bit
(``tests/compress/test_row_codec.py``), so replicas stay equal whichever form a rank runs.

Stream order (CUDA): every operation runs on the current stream; nothing is read on the host.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .agreed import AgreedPlan, RowRuns, ordered_row_sum, pack_rows, row_nbytes, unpack_rows
from .native import FORMAT_CODES, codec_library


@lru_cache(maxsize=None)
def triton_kernels():
    """``compress.row_triton``, or None where Triton is not installed (a CPU build of torch)."""
    try:
        from . import row_triton
    except ImportError:
        return None
    return row_triton


FORMATS = ("sign", "int8")  # the fused ones: 1-bit Adam's rows, and the dense steps'


def runs_for(plan: AgreedPlan, fmt: str, density: float) -> RowRuns | None:
    """The plan's rows as runs where the fused codec takes a step (signs or int8, every piece
    whole: density 1); None: the step is the reference's (``pack_rows``, ``unpack_rows``)."""
    return plan.row_runs if fmt in FORMATS and density == 1.0 else None


def _on_cuda(runs: RowRuns | None, device: torch.device, fmt: str, dtype: torch.dtype = torch.float32) -> bool:
    """The Triton kernels take CUDA tensors, the values in fp32, for rows at density 1 (signs)."""
    return (runs is not None and fmt == "sign" and device.type == "cuda" and dtype == torch.float32
            and triton_kernels() is not None)


def _fused(runs: RowRuns | None, values: torch.Tensor | None, *others: torch.Tensor) -> bool:
    """The C loops take the rows as runs, CPU tensors, contiguous, the values (if any) in fp32."""
    tensors = others if values is None else (values, *others)
    return (runs is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and (values is None or values.dtype == torch.float32) and codec_library() is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def encode(src: torch.Tensor, positions: torch.Tensor | None, real: torch.Tensor, span: int,
           left: torch.Tensor, runs: RowRuns | None = None, fmt: str = "sign") -> torch.Tensor:
    """uint8 [rows, row bytes]: the rows of ``src`` at ``positions`` (int64 [rows, width]; None:
    ``src`` is the rows, [rows, width]) in ``fmt`` (``FORMATS``) with a scale per ``span``
    slots, ``real`` (bool [rows, width]) marking the slots that are not padding (``runs``: the
    same rows, for the fused loops). ``left`` gets each value minus what is decoded from it:
    at the real slots' positions, or (``positions`` None) [rows, width] at every slot."""
    if _on_cuda(runs, src.device, fmt, src.dtype):
        return triton_kernels().encode(src, positions, real, span, left, runs)
    rows, width = real.shape
    wire = torch.empty(rows, row_nbytes(width, fmt, span, torch.float32), dtype=torch.uint8, device=src.device)
    if _fused(runs, src, left):
        n_runs = 0 if runs.runs is None else runs.runs.shape[0]
        library = codec_library()
        status = (library.sign_encode(src.data_ptr(), _ptr(runs.runs), n_runs, runs.used.data_ptr(), rows, width,
                                      span, wire.shape[1], wire.data_ptr(), left.data_ptr()) if fmt == "sign" else
                  library.int8_encode(src.data_ptr(), _ptr(runs.runs), n_runs, rows, width, span, wire.shape[1],
                                      wire.data_ptr(), left.data_ptr()))
        if status == 0:
            return wire
    values = src.view(rows, width) if positions is None else torch.where(
        real, src.index_select(0, positions.view(-1)).view(rows, width), 0)
    packed, rounded = pack_rows(values, fmt, span, real)
    wire.copy_(packed)
    if positions is None:
        torch.sub(values, rounded, out=left.view(rows, width))
    else:  # the real slots' coordinates written; the padding's to a spare past the end (no host sync)
        spare = torch.cat([left, left.new_zeros(1)])
        spare.index_copy_(0, torch.where(real, positions, left.numel()).view(-1), (values - rounded).view(-1))
        left.copy_(spare.narrow(0, 0, left.numel()))
    return wire


def decode_sum(wire: torch.Tensor, real_row: torch.Tensor, width: int, span: int,
               runs: RowRuns | None = None, fmt: str = "sign") -> torch.Tensor:
    """fp32 [1, width]: the sum of the rows ``wire`` [P, row bytes], each holding values for the
    same slots (``real_row``: bool [1, width]; ``runs``: that row's, ``RowRuns.row``), row 0
    first, then each in order."""
    if _on_cuda(runs, wire.device, fmt):
        return triton_kernels().decode_sum(wire, real_row, width, span, runs)
    if _fused(runs, None, wire):
        sums = torch.empty(1, width, dtype=torch.float32)
        status = codec_library().rows_decode_sum(FORMAT_CODES[fmt], wire.data_ptr(), runs.counts[0], wire.shape[0],
                                                 width, span, wire.shape[1], sums.data_ptr())
        if status == 0:
            return sums
    return ordered_row_sum(unpack_rows(wire, fmt, width, span, torch.float32, real_row))


def decode_add(wire: torch.Tensor, positions: torch.Tensor, real: torch.Tensor, span: int,
               target: torch.Tensor, runs: RowRuns | None = None, overwrite: bool = False, fmt: str = "sign") -> None:
    """``target`` += the rows ``wire`` [P, row bytes] at ``positions`` (int64 [P, width]), as
    ``index_add_`` adds them (the padding's values too: 0 for signs, what its codes say for
    int8). ``overwrite``: as if ``target`` were zeroed first at every position the rows name
    (the fused forms write ``0 + value`` there, not a pass of zeros first); the caller zeroes
    what no row holds (``AgreedPlan.outside_rows``), where a row's padding may point."""
    if _on_cuda(runs, target.device, fmt, target.dtype):
        triton_kernels().decode_add(wire, positions, real, span, target, runs, overwrite)
        return
    rows, width = real.shape
    if _fused(runs, target, wire) and runs.runs is not None:
        if codec_library().rows_decode_add(FORMAT_CODES[fmt], wire.data_ptr(), runs.runs.data_ptr(), runs.runs.shape[0],
                                           runs.used.data_ptr(), runs.pad.data_ptr(), rows, width, span, wire.shape[1],
                                           int(overwrite), target.data_ptr()) == 0:
            return
    if overwrite:  # every position the rows name (the padding's too, which add 0 there)
        target.index_fill_(0, positions.view(-1), 0)
    target.index_add_(0, positions.view(-1), unpack_rows(wire, fmt, width, span, target.dtype, real).view(-1))
