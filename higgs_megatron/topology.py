"""Which data-parallel ranks share a node, and the process groups of the hierarchical sync.

The node of a rank is, the first that is set: ``HIGGS_NODE_ID`` (the override, for tests and
for launchers not listed here), Slurm's ``SLURM_NODEID``, torchrun's ``GROUP_RANK`` (the node
rank of a multi-node launch), else the host name. Every rank's node and data-parallel group
are all-gathered once over the default group, so every rank sees the same picture.

For each data-parallel group (every one in the job, not only this rank's: ``new_group`` is
collective over the whole world, so every rank creates every group, in the same sorted order):

* **intra-node groups**: the group's ranks on one node, in the DP group's order;
* **inter-node groups**: the ranks that stand at the same place in their node's intra group,
  one per node; these are the ranks whose traffic crosses the slow links.

The hierarchical sync needs the same number of the group's ranks on every node; otherwise
``build_node_groups`` refuses, naming the counts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

NODE_ENV = ("HIGGS_NODE_ID", "SLURM_NODEID", "GROUP_RANK")


def node_id() -> str:
    """This process's node, as the module docstring says."""
    for name in NODE_ENV:
        value = os.environ.get(name)
        if value not in (None, ""):
            return f"{name}={value}"
    return f"host={socket.gethostname()}"


@dataclass
class NodeGroups:
    """This rank's place in the two-level layout of its data-parallel group."""

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup | None  # None on a single node
    nodes: int
    ranks_per_node: int
    local_index: int  # this rank's place in its intra-node group
    instances: bool = False  # the levels are Megatron's distributed-optimizer instances

    @property
    def single_node(self) -> bool:
        return self.nodes == 1


class TopologyError(ValueError):
    """The data-parallel group does not split evenly over nodes."""


def split_by_node(ranks: list[int], node_of: dict[int, str]) -> list[list[int]]:
    """The group's ranks per node, nodes in order of their first rank."""
    by_node: dict[str, list[int]] = {}
    for rank in ranks:
        by_node.setdefault(node_of[rank], []).append(rank)
    return list(by_node.values())


def instance_groups(intra: dist.ProcessGroup, inter: dist.ProcessGroup) -> NodeGroups:
    """Megatron's distributed-optimizer instances as the two levels: the ranks of one instance
    (``intra_distributed_optimizer_instance_group``, its reduce-scatter dense) and the ranks
    holding the same shard in every instance (``inter_distributed_optimizer_instance_group``,
    where the sync compresses). Megatron's parallel state made them: no new group here."""
    return NodeGroups(intra=intra, inter=inter, nodes=dist.get_world_size(inter),
                      ranks_per_node=dist.get_world_size(intra), local_index=dist.get_rank(intra), instances=True)


def build_node_groups(dp_group: dist.ProcessGroup) -> NodeGroups:
    """Collective over the default group: every rank must call it, with its own DP group."""
    me = dist.get_rank()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (node_id(), tuple(dist.get_process_group_ranks(dp_group))))
    node_of = {rank: node for rank, (node, _) in enumerate(gathered)}
    mine = None
    for ranks in sorted({dp_ranks for _, dp_ranks in gathered}):
        per_node = split_by_node(list(ranks), node_of)
        sizes = [len(members) for members in per_node]
        if len(set(sizes)) != 1:
            raise TopologyError(f"data-parallel group {list(ranks)} has {sizes} ranks on its {len(sizes)} nodes: "
                                "the hierarchical sync needs the same number on every node")
        if len(per_node) == 1:  # one node: no new groups, the DP group is the node's
            if me in ranks:
                mine = NodeGroups(intra=dp_group, inter=None, nodes=1, ranks_per_node=sizes[0],
                                  local_index=per_node[0].index(me))
            continue
        intra = [dist.new_group(members) for members in per_node]
        inter = [dist.new_group([members[i] for members in per_node]) for i in range(sizes[0])]
        if me in ranks:
            node = next(n for n, members in enumerate(per_node) if me in members)
            local = per_node[node].index(me)
            mine = NodeGroups(intra=intra[node], inter=inter[local], nodes=len(per_node),
                              ranks_per_node=sizes[0], local_index=local)
    assert mine is not None, "this rank is in no data-parallel group"
    return mine
