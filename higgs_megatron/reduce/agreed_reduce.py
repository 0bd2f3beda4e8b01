"""The agreed-mask reduction: an all-to-all reduce-scatter of rows, the owners' sums gathered back.

Every rank of ``group`` holds the same positions (``compress.agreed``), so row j of every
rank holds values for the same coordinates of shard j. Per bucket and step, every rank makes
the same calls with the same sizes:

1. ``launch_agreed``: an all-to-all sends row j to rank j, asynchronously; beside it, an
   all-reduce of the always-sent values (small parameters, in the gradient's dtype) and the
   bf16 all-reduce of the block scores for the next step. Wire per rank: (P-1)/P of the rows,
   2(P-1)/P of the others', none growing with P.
2. ``finish`` (after waiting for those): the owner decodes the P rows it received and sums them in fp32
   (the same sum on any rank: one rank computes it). With the distributed optimizer that sum
   is the shard of the bucket the optimizer reads, written into it; nothing more goes out.
   Without it, the owner adds its own residual to its sums, rounds them to the wire format and
   keeps the rounding in that residual (so what the rounding drops reaches a later step: two-level
   error feedback, as DoubleSqueeze and 1-bit Adam's server error), and an all-gather brings every
   owner's rounded sums to every rank, which writes them at their positions: the same bytes, so
   the same gradient, on every rank. Wire: (P-1)/P of the rows again. The owner's residual is
   its own buffer over its shard's coordinates, not the rank's residual: it holds an error of the
   *sum* over P ranks, which in a rank's next row would outweigh that rank's own share and be
   rounded again there (with signs, a scale P times too large for its row).
   ``prepare`` does this up to the all-gather and leaves it in flight; ``finish`` prepares if
   that was not done, then waits for it and decodes. ``HiggsDDP`` prepares every bucket of
   the step before it finishes the first, so the all-gathers are on the wire while the first
   buckets decode (every rank prepares in the same order, so the collectives match).

Stream order (CUDA): the rows and the scores are computed on the current stream before the
launch, NCCL's streams wait for it; ``prepare`` and ``finish`` wait and then run on the
current stream, as the sparse path's does. On failure, as ``sparse_allreduce``: in a given-up
sync the all-gather every rank will issue still goes out, and nothing is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compress import row_codec
from ..compress.agreed import AgreedPlan, ScoreBuffer, pack_rows, unpack_rows
from ..compress.compressor import ResidualBuffer
from .wire import Collectives, StepWaits, wait_works


@dataclass
class PendingAgreed:
    """The exchange in flight; ``finish`` writes the summed gradient into ``target``."""

    comm: Collectives
    group: dist.ProcessGroup
    plan: AgreedPlan
    density: float
    value_format: str
    positions: torch.Tensor  # int64 [world, width], the same on every rank
    real: torch.Tensor  # bool [world, width]: the slots that are not padding, the same on every rank
    received: torch.Tensor  # uint8 [world, row bytes]: row p is peer p's values for this rank's shard
    always: torch.Tensor  # the always-sent values, being summed
    work: object
    scores: torch.Tensor | None  # bf16 [n_blocks], being summed (None: the plan scores nothing)
    score_work: object
    always_work: object
    score_buffer: ScoreBuffer
    residual: ResidualBuffer | None
    owner_residual: ResidualBuffer | None  # fp32, this rank's shard and a spare last coordinate: the owner's rounding
    target: torch.Tensor
    gather: bool  # False: only this rank's shard of ``target`` is wanted (the distributed optimizer's)

    gathered: torch.Tensor | None = None  # the owners' rows, being all-gathered (``prepare``)
    gather_work: object = None
    prepared: bool = False

    def prepare(self, waits: StepWaits) -> None:
        """Step 2 up to the all-gather, which is left in flight: wait for the rows and the
        scores, sum this rank's shard, re-sign it and start gathering every owner's sums (with
        the distributed optimizer, all of step 2). A bucket's sync prepared before the last is
        finished puts its all-gather on the wire while those decode (``HiggsDDP``)."""
        if self.prepared:
            return
        self.prepared = True
        wait_works(self, ("work", "score_work", "always_work"), waits)
        if waits.abandoned:
            if self.gather:  # what every rank issues goes out; nothing is read
                self.gather_work = waits.launch(self.comm.all_gather, torch.empty_like(self.received),
                                                self.received.narrow(0, 0, 1), self.group)
            return
        layout, fmt, dtype = self.plan.layout(self.density), self.value_format, self.target.dtype
        rank = self.comm.rank(self.group)
        mine_real = self.real.narrow(0, rank, 1)
        runs = row_codec.runs_for(self.plan, fmt, self.density)  # fused: the same bytes as pack_rows'
        if runs is not None:
            sums = row_codec.decode_sum(self.received, mine_real, layout.width, layout.span, runs.row(rank), fmt)
        else:
            sums = unpack_rows(self.received, fmt, layout.width, layout.span, torch.float32, mine_real).sum(0, keepdim=True)
        if self.scores is not None:
            self.score_buffer.staged = self.scores.float()
        if not self.gather:
            mine = self.positions.select(0, rank)
            lo = min(rank * self.plan.shard, self.target.numel())
            hi = min(lo + self.plan.shard, self.target.numel())
            self.target.narrow(0, lo, hi - lo).zero_()
            self.target.index_add_(0, mine, sums.view(-1).to(dtype))
            self.target.index_copy_(0, self.plan.always_positions, self.always)
            return
        owner = self.owner_residual if fmt != "wide" else None
        # this rank's slots as coordinates of its shard; padding to the owner residual's spare last one
        in_shard = self.plan.in_shard(self.positions, self.real, rank, self.density)
        if owner is not None and not owner.committed_zero:
            sums.add_(owner.committed.index_select(0, in_shard).unsqueeze(0))
        if runs is not None:
            left = torch.empty_like(sums)
            wire = row_codec.encode(sums, None, mine_real, layout.span, left, runs.row(rank), fmt)
        else:
            wire, rounded = pack_rows(sums, fmt, layout.span, mine_real)
            left = sums - rounded.float()
        if owner is not None:  # what was sent leaves the residual; the coordinates not sent keep theirs
            owner.stage_replacing(in_shard, left.view(-1))
        self.gathered = torch.empty_like(self.received)
        self.gather_work = waits.launch(self.comm.all_gather, self.gathered, wire, self.group)

    def finish(self, waits: StepWaits | None = None) -> None:
        """Wait for the exchange and the scores (through ``waits``), then sum; in a given-up
        sync only the all-gather every rank issues goes out, and nothing is read."""
        waits = waits or StepWaits()
        self.prepare(waits)
        if self.gather_work is not None:
            waits.wait(self.gather_work)
            self.gather_work = None
        if self.gathered is None or waits.abandoned:
            return
        layout, fmt, dtype = self.plan.layout(self.density), self.value_format, self.target.dtype
        runs = row_codec.runs_for(self.plan, fmt, self.density)
        if runs is not None:  # every coordinate a row holds written (0 + its value), the others 0
            self.target.index_fill_(0, self.plan.outside_rows, 0)
            row_codec.decode_add(self.gathered, self.positions, self.real, layout.span, self.target, runs,
                                 overwrite=True, fmt=fmt)
        else:
            values = unpack_rows(self.gathered, fmt, layout.width, layout.span, dtype, self.real)
            self.target.zero_()
            self.target.index_add_(0, self.positions.view(-1), values.view(-1))
        self.target.index_copy_(0, self.plan.always_positions, self.always)
        self.gathered = None


def launch_agreed(comm: Collectives, plan: AgreedPlan, density: float, value_format: str, positions: torch.Tensor,
                  real: torch.Tensor, rows: torch.Tensor, always: torch.Tensor,
                  scores: torch.Tensor | None, score_buffer: ScoreBuffer, residual: ResidualBuffer | None,
                  owner_residual: ResidualBuffer | None, target: torch.Tensor, group: dist.ProcessGroup, gather: bool,
                  async_op: bool = True) -> PendingAgreed:
    """Start step 1 for ``rows`` (``pack_rows``' bytes, row j for rank j), the ``always``-sent
    values (summed in place) and this rank's block ``scores`` (fp32; None where the plan scores
    nothing: every rank's plan is the same); the caller later calls ``finish()`` on what this returns."""
    received = torch.empty_like(rows)
    work = comm.all_to_all(received, rows, group, async_op=async_op)
    # (none where the bucket has no small parameter: every rank's plan is the same)
    always_work = comm.all_reduce(always, group, async_op=async_op) if always.numel() else None
    wire_scores = None if scores is None else scores.to(torch.bfloat16)
    score_work = None if scores is None else comm.all_reduce(wire_scores, group, async_op=async_op)
    return PendingAgreed(comm, group, plan, density, value_format, positions, real, received, always,
                         work if async_op else None, wire_scores, score_work if async_op else None,
                         always_work if async_op else None, score_buffer, residual, owner_residual, target, gather)
