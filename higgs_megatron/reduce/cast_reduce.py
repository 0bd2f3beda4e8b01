"""A dense bucket reduced in bf16: the collective runs on a rounded copy, written back after.

Used for the dense steps of a compressed bucket under ``--higgs-dense-bf16`` (the dense stage
and the early steps of a density ramp). The caller rounds the accumulated gradient (the
gradient plus its error-feedback residual) to bf16 and stages ``acc - rounded`` as the new
residual, so what this rank's rounding drops arrives in a later step, as what top-k leaves
does. The sum over peers is then taken in bf16, as Megatron's ``--grad-reduce-in-bf16`` and
PyTorch's bf16 compression hook take it; that rounding is the same on every peer's result
and is not fed back.

With the distributed optimizer the collective is a reduce-scatter, and only this rank's
shard is written back (the optimizer reads no other). Stream order is the sparse path's: the
rounding is queued on the current stream before the launch, the copy back after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sparse_allreduce import reduce_scatter
from .wire import Collectives, StepWaits, wait_works


@dataclass
class PendingCastReduce:
    """A bf16 collective in flight; ``finish`` copies its result into ``target``."""

    work: object
    wire: torch.Tensor  # the part of the bf16 copy that holds this rank's result
    target: torch.Tensor  # the same part of the bucket

    def finish(self, waits: StepWaits | None = None) -> None:
        """Wait (through ``waits``), then copy the result into ``target``; in a given-up sync
        nothing is read (its one collective went out)."""
        wait_works(self, ("work",), waits)
        if waits is None or not waits.abandoned:
            self.target.copy_(self.wire)


def launch_cast_reduce(comm: Collectives, grad: torch.Tensor, wire: torch.Tensor, group: dist.ProcessGroup, shard: int | None,
                       async_op: bool = True, bounded: bool = False) -> PendingCastReduce:
    """Reduce ``wire`` (``grad`` rounded to bf16) over ``group`` with a sum: all of it, or with
    ``shard`` (this rank's index in ``group``) a reduce-scatter into that shard (the bucket's
    size is a multiple of the group's, as Megatron pads it for the distributed optimizer);
    ``bounded`` as in ``reduce_scatter``."""
    if shard is None:
        work = comm.all_reduce(wire, group, async_op=async_op)
        return PendingCastReduce(work if async_op else None, wire, grad)
    size = wire.numel() // dist.get_world_size(group)
    local = wire.narrow(0, shard * size, size)
    work = reduce_scatter(comm, local, wire, group, async_op=async_op, bounded=bounded)
    return PendingCastReduce(work if async_op else None, local, grad.narrow(0, shard * size, size))
