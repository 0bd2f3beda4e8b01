"""The gradient sync's collectives on a torchft process group.

Across elastic replicas, the data-parallel group is torchft's: a wrapper that torchft
rebuilds in place at every quorum (``configure``), with a plain gloo or NCCL group inside
(``parent``). ``torch.distributed``'s functions cannot take the wrapper: it is registered with
no backend, so ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` refuse it, and
torchft's own gloo wrapper refuses reduce-scatter outright. The group inside takes every
collective the sync issues. ``ReplicaCollectives`` therefore issues each one on the current
inner group, through its methods (``allreduce``, ``_reduce_scatter_base``,
``_allgather_base``, ``alltoall_base``) inside the wrapper's context, its work wrapped by the
wrapper as the wrapper's own methods wrap theirs, and counts it like ``wire.Collectives``
counts its own. Every path of the sync (dense, sparse all-gather, agreed, sharded) then runs unchanged.
The inner group is looked up at each call, never kept, since a quorum replaces it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from ..reduce.wire import Collectives


@dataclass(frozen=True)
class ReplicaGroup:
    """What the gradient sync needs of the elastic replicas: torchft's group across them (the
    wrapper, rebuilt in place at every quorum), how many replicas the job has (the plans are
    made for all of them) and this replica's index (its selectors' seed)."""

    group: Any
    size: int
    index: int


def inner_group(group):
    """The group torchft's wrapper holds now (its ``parent``); ``group`` itself if it is a
    plain one. One level only: a wrapper around a wrapper (the Manager's own
    ``ManagedProcessGroup``, which averages and reports errors itself) is refused."""
    inner = getattr(group, "parent", group)
    if hasattr(inner, "parent"):
        raise TypeError(f"{type(group).__name__} wraps {type(inner).__name__}, itself a torchft wrapper: pass "
                        "torchft's ProcessGroupGloo or ProcessGroupNCCL")
    return inner


class ReplicaCollectives(Collectives):
    """``wire.Collectives`` over a torchft group (see the module docstring). Each collective
    runs in the wrapper's context and its work goes through the wrapper's own wrapping (on
    NCCL, torchft's abort of a collective past its timeout), as the wrapper's own methods do."""

    def rank(self, group) -> int:
        return inner_group(group).rank()

    def issue(self, kind: str, output: torch.Tensor, input: torch.Tensor, group, op, async_op: bool):
        inner = inner_group(group)
        run_context = getattr(group, "_run_context", contextlib.nullcontext)
        wrap = getattr(group, "_wrap_work", lambda work, options: work)
        with run_context():
            if kind == "all_reduce":
                options = dist.AllreduceOptions()
                options.reduceOp = op
                work = inner.allreduce([output], options)
            elif kind == "reduce_scatter":
                options = dist.ReduceScatterOptions()
                options.reduceOp = op
                work = inner._reduce_scatter_base(output, input, options)
            elif kind == "all_gather":
                options = AllgatherOptions()  # torch.distributed does not re-export it
                work = inner._allgather_base(output, input, options)
            else:
                options = dist.AllToAllOptions()
                work = inner.alltoall_base(output, input, [], [], options)
            work = wrap(work, options)
        if async_op:
            return work
        work.wait()
        return None
