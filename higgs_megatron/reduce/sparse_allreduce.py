"""Sparse all-reduce by all-gather: every DP peer sends k (position, value) pairs, all sum them.

Protocol, per bucket and step (all peers of ``group`` take part, in the same order):

1. the payload (``compress.payload``, in the plan's format: positions, the values of the
   always-sent coordinates, whose positions every peer knows, and the selected values, in one
   uint8 buffer padded to 4 bytes); its size is the same on every peer.
2. ``all_gather_into_tensor`` of that buffer, asynchronously: the call returns at once and
   the gather runs while backward goes on.
3. ``finish`` (after ``wait``): zero the bucket, then for each peer in rank order decode its
   payload and ``index_add_`` its always-sent values and its selected values at their positions
   (or, where a payload carries every coordinate in order, add it). Within
   one peer's payload a position holds at most one real value: a padding slot may repeat a
   position, but it adds an exact 0, so the order of the adds within a peer (atomic on a
   GPU) cannot change the sum. Every peer adds the same payloads in the same peer order, so
   the result is bitwise identical on every peer.

The hierarchical reduction (dense inside a node, compressed across nodes) builds on it. Per
bucket and step, every DP rank makes the same calls with the same sizes:

1. ``node_reduce_scatter``: reduce-scatter the bucket inside the node (dense, and waited for
   at once: the node's links are the fast ones). This rank then holds its node's sum of one 1/L slice
   of the bucket (L ranks per node; the bucket is zero-padded to a multiple of L).
2. The caller applies error feedback and selects on that slice, k scaled to the slice: the
   compressed payload a node sends is the size of one rank's flat payload, not L of them.
3. ``launch_hierarchical``: the sparse all-gather above, across nodes, among the ranks that
   hold the same slice (one per node), asynchronous: it overlaps the rest of backward.
4. ``PendingHierarchical.finish``: every node's payloads summed into the slice, then the
   slices all-gathered inside the node back into the whole bucket: identical on every DP rank.

On failure: ``finish`` raises what the collective raised; the bucket is left as it was. In a
sync given up on (``wire.StepWaits``: a bounded wait ran out) ``finish`` reads nothing
gathered, and still issues the collectives the other ranks will.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compress.payload import Packed, Payload, SlotLayout
from .wire import Collectives, StepWaits, wait_works


@dataclass
class PendingSparseReduce:
    """An all-gather in flight; ``finish`` writes the summed gradient into ``target``."""

    work: object
    gathered: torch.Tensor
    world: int
    payload: Payload
    layout: SlotLayout
    target: torch.Tensor

    def finish(self, waits: StepWaits | None = None) -> None:
        """Wait for the gather (through ``waits``: e.g. bounded), then sum it into ``target``;
        in a given-up sync nothing of it is read (its positions may be any bytes)."""
        wait_works(self, ("work",), waits)
        if waits is not None and waits.abandoned:
            return
        per_peer = self.gathered.view(self.world, -1)
        self.target.zero_()
        for peer in range(self.world):
            self.payload.add_to(self.target, per_peer.select(0, peer), self.layout)


def gather_payloads(comm: Collectives, payload: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    """(the gathered buffer, the work): every peer's payload, end to end in rank order."""
    gathered = torch.empty(dist.get_world_size(group) * payload.numel(), dtype=torch.uint8, device=payload.device)
    return gathered, comm.all_gather(gathered, payload, group, async_op=async_op)


def launch_sparse_allreduce(comm: Collectives, packed: Packed, target: torch.Tensor, group: dist.ProcessGroup,
                            async_op: bool = True) -> PendingSparseReduce:
    """Start the gather of ``packed`` (``compress.compressor.pack_with_feedback``); the caller
    later calls ``finish()`` on what this returns."""
    gathered, work = gather_payloads(comm, packed.buffer, group, async_op)
    return PendingSparseReduce(work=work if async_op else None, gathered=gathered, world=dist.get_world_size(group),
                               payload=packed.payload, layout=packed.layout, target=target)


def slice_range(numel: int, ranks_per_node: int, local_index: int) -> tuple[int, int]:
    """[start, end) of this rank's slice in the padded bucket."""
    size = -(-numel // ranks_per_node)
    return local_index * size, (local_index + 1) * size


def reduce_scatter(comm: Collectives, shard: torch.Tensor, buffer: torch.Tensor, group: dist.ProcessGroup,
                   op=dist.ReduceOp.SUM, async_op: bool = True, bounded: bool = False):
    """``shard``, this rank's slice of ``buffer`` (a view into it), gets that slice reduced over
    ``group``; returns the work (None when not ``async_op``). ``bounded``: the caller waits
    with a timeout. Gloo's reduce-scatter work ignores a wait's timeout (it waits for the
    slowest peer however long), so there an in-place all-reduce of the whole buffer does it:
    its wait is bounded, the slice gets the same sum, and the rest of ``buffer`` is reduced
    too, which nobody reads (a distributed optimizer reads its own shard; the hierarchical
    path overwrites the other slices)."""
    if bounded and dist.get_backend(group) == "gloo":
        return comm.all_reduce(buffer, group, op=op, async_op=async_op)
    return comm.reduce_scatter(shard, buffer, group, op=op, async_op=async_op)


def node_reduce_scatter(comm: Collectives, grad: torch.Tensor, intra: dist.ProcessGroup,
                        waits: StepWaits, bounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded work buffer, this rank's slice of it holding the node's sum), waited for
    through ``waits``; ``bounded`` as in ``reduce_scatter``."""
    ranks = dist.get_world_size(intra)
    size = -(-grad.numel() // ranks)
    work = grad if size * ranks == grad.numel() else torch.cat(
        [grad, torch.zeros(size * ranks - grad.numel(), dtype=grad.dtype, device=grad.device)])
    piece = work.view(ranks, size).select(0, dist.get_rank(intra))
    waits.wait(reduce_scatter(comm, piece, work, intra, bounded=bounded))
    return work, piece


class PendingHierarchical:
    """The cross-node gather in flight; ``finish`` completes step 4 of the hierarchical protocol into ``target``."""

    def __init__(self, comm: Collectives, sparse: PendingSparseReduce, work: torch.Tensor, piece: torch.Tensor,
                 target: torch.Tensor, intra: dist.ProcessGroup, gather: bool = True) -> None:
        self.comm, self.sparse, self.work, self.piece, self.target, self.intra = comm, sparse, work, piece, target, intra
        self.gather = gather  # False: only this rank's slice of ``target`` is wanted (the distributed optimizer's shard)

    def finish(self, waits: StepWaits | None = None) -> None:
        """As ``PendingSparseReduce.finish``; the node's all-gather goes out in a given-up sync
        too (every rank of the node issues it; what it carries is not used)."""
        waits = waits or StepWaits()
        self.sparse.finish(waits)  # the slice now holds the sum over all nodes
        if self.gather:
            waits.issue(self.comm.all_gather, self.work, self.piece, self.intra)
        if waits.abandoned or self.work.data_ptr() == self.target.data_ptr():
            return
        if self.gather:
            self.target.copy_(self.work.narrow(0, 0, self.target.numel()))
        else:  # the padded work buffer's slice back into the bucket, where it overlaps
            start = self.piece.storage_offset() - self.work.storage_offset()
            end = min(start + self.piece.numel(), self.target.numel())
            if end > start:
                self.target.narrow(0, start, end - start).copy_(self.piece.narrow(0, 0, end - start))


def launch_hierarchical(comm: Collectives, packed: Packed, work: torch.Tensor, piece: torch.Tensor,
                        target: torch.Tensor, intra: dist.ProcessGroup, inter: dist.ProcessGroup,
                        async_op: bool = True, gather: bool = True) -> PendingHierarchical:
    pending = launch_sparse_allreduce(comm, packed, piece, inter, async_op=async_op)
    return PendingHierarchical(comm, pending, work, piece, target, intra, gather)
