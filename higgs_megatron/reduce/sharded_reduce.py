"""The sharded reduction: each rank's top-k of each shard to its owner by an all-to-all, the
owners' top-k of their sums gathered back (``compress.sharded`` holds the tensor code).

Per bucket and step, every rank makes the same calls with the same sizes:

1. ``launch_sharded``: an all-to-all sends row j (this rank's payload for shard j) to rank j,
   asynchronously; beside it, an all-reduce of the small parameters' values. Wire per rank:
   (P-1)/P of the P rows, each about 1/P of a flat payload, and 2(P-1)/P of the small ones.
2. ``finish`` (after waiting for those): the owner sums its shard in fp32, in rank order: its own
   accumulated gradient there (never sent) and the P-1 rows it received. With the
   distributed optimizer that sum is the shard of the bucket the optimizer reads, written
   into it; nothing more goes out. Without it, the owner selects the top ``sum_density``
   (``density`` unless given) of its sum, keeps the rest in its own residual (so what it
   drops reaches a later step: error feedback on the sum), and an all-gather brings every
   owner's row to every rank, which decodes them into their shards: the same bytes, so the
   same gradient, on every rank. Wire: (P-1) rows of about 1/P of a flat payload (at
   ``sum_density``). The small parameters' sums go in last.

Stream order (CUDA): the rows are made on the current stream before the launch, and NCCL's
stream waits for it; ``finish`` waits and then runs on the current stream, as the sparse path's
does. On failure, as ``sparse_allreduce``: in a given-up sync ``finish`` still issues the
all-gather every rank will issue, and reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compress.compressor import ResidualBuffer, Selector
from ..compress.payload import Payload
from ..compress.sharded import ShardedPlan
from .wire import Collectives, StepWaits, wait_works


@dataclass
class PendingSharded:
    """The all-to-all in flight; ``finish`` writes the summed gradient into ``target``."""

    comm: Collectives
    group: dist.ProcessGroup
    plan: ShardedPlan
    density: float
    payload: Payload
    selector: Selector
    key: object
    received: torch.Tensor  # uint8 [world, row bytes]: row p is peer p's payload for this rank's shard
    always: torch.Tensor  # the small parameters' values, being summed
    work: object
    residual: ResidualBuffer | None
    target: torch.Tensor
    gather: bool  # False: only this rank's shard of ``target`` is wanted (the distributed optimizer's)
    always_work: object
    sum_density: float  # of the owner's selection of its sum (with ``gather``)

    def finish(self, waits: StepWaits | None = None) -> None:
        """Wait for the all-to-all and the small parameters' all-reduce (through ``waits``), then
        sum; in a given-up sync only the all-gather every rank issues goes out, and nothing is read."""
        waits = waits or StepWaits()
        wait_works(self, ("work", "always_work"), waits)
        if waits.abandoned:
            if self.gather:
                row = torch.zeros(self.plan.row_bytes(self.sum_density, self.target.dtype, self.payload),
                                  dtype=torch.uint8, device=self.received.device)
                gathered = torch.empty(self.plan.world * row.numel(), dtype=torch.uint8, device=row.device)
                waits.issue(self.comm.all_gather, gathered, row, self.group)
            return
        rank = self.comm.rank(self.group)
        lo, hi = self.plan.bounds[rank]
        total = self.plan.sum_shard(rank, self.target.narrow(0, lo, hi - lo), self.received, self.density,
                                    self.payload)
        if not self.gather:
            self.target.narrow(0, lo, hi - lo).copy_(total)
        else:
            row = self.plan.compress_sum(rank, total, self.sum_density, self.selector, self.key, self.payload)
            if self.residual is not None:  # what the owner did not send of the sum
                self.residual.staged.narrow(0, lo, hi - lo).copy_(total)
            gathered = torch.empty(self.plan.world * row.numel(), dtype=torch.uint8, device=row.device)
            waits.issue(self.comm.all_gather, gathered, row, self.group)
            self.plan.add_gathered(self.target, gathered.view(self.plan.world, -1), self.sum_density, self.payload)
        self.target.index_copy_(0, self.plan.always_positions, self.always)


def launch_sharded(comm: Collectives, plan: ShardedPlan, density: float, payload: Payload, selector: Selector,
                   key: object, rows: torch.Tensor, always: torch.Tensor, residual: ResidualBuffer | None,
                   target: torch.Tensor, group: dist.ProcessGroup, gather: bool, async_op: bool = True,
                   sum_density: float | None = None) -> PendingSharded:
    """Start step 1 for ``rows`` (``ShardedPlan.compress_rows``, row j for rank j) and the small
    parameters' values ``always`` (summed in place); the caller later calls ``finish()`` on
    what this returns."""
    received = torch.empty_like(rows)
    work = comm.all_to_all(received, rows, group, async_op=async_op)
    # (none where the bucket has no small parameter: every rank's plan is the same)
    always_work = comm.all_reduce(always, group, async_op=async_op) if always.numel() else None
    return PendingSharded(comm, group, plan, density, payload, selector, key, received, always,
                          work if async_op else None, residual, target, gather,
                          always_work if async_op else None, density if sum_density is None else sum_density)
