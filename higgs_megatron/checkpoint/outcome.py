"""One outcome for a piece of checkpoint work that every rank runs: the first failure on any
rank, raised on every rank, or none.

A save's steps agree through collectives of their own (``save.begin``, ``save.commit``), but a
load hands the work to code that is not ours: megatron-core's ``dist_checkpointing.load``,
the optimizer's ``load_state_dict``, Megatron-LM's loader. A rank can fail there on its own:
after the last collective (a state dict its model refuses), the others would go on to train
and hang in the first gradient reduction; before a collective the others are already in (a
file it alone cannot read), it cannot join them to say so, as a collective agreement would
need. So the failure goes through the job's store, which every rank reaches whatever
collective it is in:

* a rank whose work raised records ``rank R: <error>`` unless a rank did first
  (``compare_set``), and wakes every waiting rank (a rank holding torch's checkpoint failure
  without the failed ranks' errors, which megatron-core gathers on one rank, only counts in,
  so that the rank that has them says it);
* every rank counts itself in when its work ends, either way; the last one in wakes everyone;
* a rank still inside a collective a failed rank never joined leaves it when the collective
  gives up (at once on gloo, whose peer's connection closes when the failed rank exits; after
  the group's timeout on NCCL), counts in, and finds the failure there;
* every rank raises the same ``CheckpointError``. Where the store is rank 0's own (a launch
  without torchrun's agent store), rank 0 leaves only once every rank has counted in (or the
  group's timeout, and a margin, has passed); a failure of rank 0 itself before a collective
  the others are in then reaches them after the group's timeout, on gloo too.

At most five keys per use stay in the store (a load is once per launch), under a name rank 0 draws,
so that no earlier launch's keys are read as this one's.
"""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
# torch's checkpoint failure is a BaseException: name it, or it escapes the agreement.
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from torch.distributed.checkpoint.utils import _DistWrapper

from ..launcher import store_outlives_ranks
from .manifest import CheckpointError

MARGIN = 60.0  # seconds past the group's timeout, for a rank leaving a collective to count in


def first_line(error: BaseException) -> str:
    """torch's CheckpointException carries each failing rank's traceback; keep the errors."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return "; ".join(errors) or (lines[0] if lines else type(error).__name__)


def describe(rank: int, error: BaseException) -> str | None:
    """``rank R: <type>: <message>``; for torch's checkpoint failure (raised on every rank
    for the ranks whose step failed), each failed rank's own error, or None where this rank's
    copy does not name them (megatron-core gathers them on one rank); our own error as it is
    (it says where)."""
    if isinstance(error, CheckpointError):
        return str(error)
    if isinstance(error, DcpCheckpointException):
        world_rank = _world_ranks(error, rank)
        return "; ".join(f"rank {world_rank(failed)}: {type(exc).__name__}: {first_line(exc)}"
                         for failed, (exc, _) in sorted(error.failures.items())) or None
    return f"rank {rank}: {type(error).__name__}: {first_line(error)}"


def _world_ranks(error: DcpCheckpointException, rank: int) -> Callable[[int], int]:
    """The global rank of each rank torch's checkpoint failure names: they are ranks of the
    step's own group, held by the ``_DistWrapper`` in the frame that raised it. A step run
    without one (megatron-core 0.19 reads its common state on each rank alone, ``no_dist``)
    calls this process rank 0; a subgroup numbers its ranks from 0."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    wrappers = [value for value in (frame.tb_frame.f_locals.values() if frame is not None else ())
                if isinstance(value, _DistWrapper)]
    if not wrappers:
        return lambda failed: failed
    if not wrappers[0].use_dist:
        return lambda failed: rank
    group = wrappers[0].group
    return lambda failed: failed if group is None else dist.get_global_rank(group, failed)


def group_timeout(group: dist.ProcessGroup | None = None) -> float:
    """Seconds after which a collective of ``group`` (the default one) gives up."""
    group = group or dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    return group._get_backend(device).options._timeout.total_seconds()


@contextmanager
def same_outcome_everywhere(what: str) -> Iterator[None]:
    """Run the body on every rank (collective); if it raises on any rank, every rank raises
    ``CheckpointError("<what>: rank R: <error>")`` for the first rank that failed (see the
    module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    name = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    store = dist.PrefixStore(f"higgs/checkpoint-outcome/{name[0]}/", dist.distributed_c10d._get_default_store())
    timeout = timedelta(seconds=group_timeout() + MARGIN)
    failure: BaseException | None = None
    try:
        yield
    except (Exception, DcpCheckpointException) as error:  # noqa: BLE001 - raised below, on every rank
        failure, said = error, describe(rank, error)
        if said is None:  # it names no rank: another rank's copy does; this one counts in
            store.compare_set("unnamed", "", f"rank {rank}: {type(error).__name__}: {first_line(error)}")
        else:
            store.compare_set("failed", "", said)
            store.set("done", "")
    if store.add("count", 1) == world:
        store.set("all", "")
        store.set("done", "")
    try:
        store.wait(["done"], timeout)
    except RuntimeError as error:  # the store's own timeout
        raise CheckpointError(f"{what}: not every rank finished within {timeout.total_seconds():g}s") from error
    # "done" comes after "failed" is written, or once every rank (and so every "unnamed") is in
    found = [key for key in ("failed", "unnamed") if store.check([key])]
    if not found:
        return
    said = store.get(found[0]).decode()
    if rank == 0 and not store_outlives_ranks():
        try:  # the others may read the failure from this process's store
            store.wait(["all"], timeout)
        except RuntimeError:
            pass
    raise CheckpointError(f"{what}: {said}") from failure
