"""Hierarchical reduction: dense inside a node, compressed across nodes.

Per bucket and step, every DP rank makes the same calls with the same sizes:

1. ``node_reduce_scatter``: reduce-scatter the bucket inside the node (dense and synchronous:
   the node's links are the fast ones). This rank then holds its node's sum of one 1/L slice
   of the bucket (L ranks per node; the bucket is zero-padded to a multiple of L).
2. The caller applies error feedback and selects on that slice, k scaled to the slice: the
   compressed payload a node sends is the size of one rank's flat payload, not L of them.
3. ``launch``: the sparse all-gather of ``sparse_allreduce`` across nodes, among the ranks that
   hold the same slice (one per node), asynchronous: it overlaps the rest of backward.
4. ``finish``: every node's payloads summed into the slice, then the slices all-gathered
   inside the node back into the whole bucket: identical on every DP rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sparse_allreduce import PendingSparseReduce, launch_sparse_allreduce


def slice_range(numel: int, ranks_per_node: int, local_index: int) -> tuple[int, int]:
    """[start, end) of this rank's slice in the padded bucket."""
    size = -(-numel // ranks_per_node)
    return local_index * size, (local_index + 1) * size


def node_reduce_scatter(grad: torch.Tensor, intra: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded work buffer, this rank's slice of it holding the node's sum)."""
    ranks = dist.get_world_size(intra)
    size = -(-grad.numel() // ranks)
    work = grad if size * ranks == grad.numel() else torch.cat(
        [grad, torch.zeros(size * ranks - grad.numel(), dtype=grad.dtype, device=grad.device)])
    piece = work.view(ranks, size).select(0, dist.get_rank(intra))
    dist.reduce_scatter_tensor(piece, work, group=intra)
    return work, piece


class PendingHierarchical:
    """The cross-node gather in flight; ``finish`` completes steps 4 into ``target``."""

    def __init__(self, sparse: PendingSparseReduce, work: torch.Tensor, piece: torch.Tensor,
                 target: torch.Tensor, intra: dist.ProcessGroup) -> None:
        self.sparse, self.work, self.piece, self.target, self.intra = sparse, work, piece, target, intra

    def wait(self, waiter=None) -> None:
        self.sparse.wait(waiter)

    def finish(self) -> None:
        self.sparse.finish()  # the slice now holds the sum over all nodes
        dist.all_gather_into_tensor(self.work, self.piece, group=self.intra)
        if self.work.data_ptr() != self.target.data_ptr():
            self.target.copy_(self.work.narrow(0, 0, self.target.numel()))


def launch(always_positions: torch.Tensor, always: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
           work: torch.Tensor, piece: torch.Tensor, target: torch.Tensor, intra: dist.ProcessGroup,
           inter: dist.ProcessGroup, async_op: bool = True) -> PendingHierarchical:
    sparse = launch_sparse_allreduce(always_positions, always, positions, values, piece, inter, async_op=async_op)
    return PendingHierarchical(sparse, work, piece, target, intra)
