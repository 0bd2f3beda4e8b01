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
  (``compare_set``; a rank holding torch's checkpoint failure without the failed ranks'
  errors, which megatron-core gathers on one rank, records it apart, so that the rank that
  has them says it), and whether its failure was its own (``agreed``: torch's checkpoint
  steps and our own agreements raise on every rank at the same point; anything else is one
  rank's);
* every rank counts itself in when its work ends, either way, and waits until every rank
  has, except a rank whose failure was its own: it leaves at once, since the others may be
  in a collective it never joined, which gives up sooner once it is gone (at once on gloo,
  whose connection to it closes; after the group's timeout on NCCL). They then count in;
* every rank raises the same error: ``CheckpointError``, or ``RanksOutOfStep`` where some
  rank's failure was its own (the ranks' collective sequences may differ: the run cannot
  go on, where a failed save is otherwise tolerated). Where the store is rank 0's own (a
  launch without torchrun's agent store), rank 0 leaves only once every rank has read the
  failure (or the group's timeout, and a margin, has passed), so a failure of rank 0 itself
  before a collective the others are in reaches them after the group's timeout, on gloo too.

Each use's keys are under a name rank 0 draws, so that no earlier use's or launch's keys are
read as this one's; rank 0 deletes them at the next use (every rank has left the previous one
by then), so at most one use's keys (seven) stay in the store.
"""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist
# torch's checkpoint failure is a BaseException: name it, or it escapes the agreement.
from torch.distributed import DistStoreError
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from torch.distributed.checkpoint.utils import _DistWrapper

from ..launcher import store_outlives_ranks
from .manifest import CheckpointError

MARGIN = 60.0  # seconds past the group's timeout, for a rank leaving a collective to count in
_KEYS = ("count", "all", "failed", "unnamed", "out-of-step", "read", "seen")
_previous: list[str] = []  # rank 0: the last use's prefix, whose keys the next use deletes


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


def _step_wrapper(error: DcpCheckpointException) -> _DistWrapper | None:
    """The ``_DistWrapper`` in the frame that raised torch's checkpoint failure (its step's
    group, and whether it ran over one at all); None where it came from elsewhere
    (megatron-core raises it itself once it has gathered every rank's outcome)."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    wrappers = [value for value in (frame.tb_frame.f_locals.values() if frame is not None else ())
                if isinstance(value, _DistWrapper)]
    return wrappers[0] if wrappers else None


def _world_ranks(error: DcpCheckpointException, rank: int) -> Callable[[int], int]:
    """The global rank of each rank torch's checkpoint failure names: they are ranks of the
    step's own group (``_step_wrapper``). A step run without one (megatron-core 0.19 reads its
    common state on each rank alone, ``no_dist``) calls this process rank 0; a subgroup
    numbers its ranks from 0."""
    wrapper = _step_wrapper(error)
    if wrapper is None:
        return lambda failed: failed
    if not wrapper.use_dist:
        return lambda failed: rank
    return lambda failed: failed if wrapper.group is None else dist.get_global_rank(wrapper.group, failed)


class RanksOutOfStep(CheckpointError):
    """A failure that only some ranks raised inside collective work: a rank that failed alone
    skipped collectives the others entered (and left only when those gave up), so the ranks'
    collective sequences may differ from here on. Nothing was committed or restored, but the
    run cannot go on: a save failure that would otherwise be tolerated ends it."""


def agreed(error: BaseException) -> bool:
    """Whether every rank raised ``error`` at the same collective point: torch's checkpoint
    steps run over a group gather every rank's outcome before raising (one run on this rank
    alone, ``no_dist``, does not), and our own agreements raise the same ``CheckpointError``
    everywhere (one that wraps a local error is as local as its cause)."""
    cause = error.__cause__ if isinstance(error, CheckpointError) and error.__cause__ is not None else error
    if isinstance(cause, DcpCheckpointException):
        wrapper = _step_wrapper(cause)
        return wrapper is None or wrapper.use_dist
    return isinstance(cause, CheckpointError) and not isinstance(cause, RanksOutOfStep)


@contextmanager
def same_outcome_everywhere(what: str) -> Iterator[None]:
    """Run the body on every rank (collective); if it raises on any rank, every rank raises
    ``CheckpointError("<what>: rank R: <error>")`` for the first rank that failed, and
    ``RanksOutOfStep`` where some rank's failure was its own (see the module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    name = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)  # every rank has left the previous use: its keys can go
    prefix, base = f"higgs/checkpoint-outcome/{name[0]}/", dist.distributed_c10d._get_default_store()
    if rank == 0:
        for key in (old + key for old in _previous for key in _KEYS):
            base.delete_key(key)
        _previous[:] = [prefix]
    store = dist.PrefixStore(prefix, base)
    # The default store's timeout is the default group's (init_process_group gives both the same)
    timeout = base.timeout + timedelta(seconds=MARGIN)
    failure: BaseException | None = None
    try:
        yield
    except (Exception, DcpCheckpointException) as error:  # noqa: BLE001 - raised below, on every rank
        failure, said = error, describe(rank, error)
        if not agreed(error):
            store.set("out-of-step", "")
        if said is None:  # it names no rank: another rank's copy does
            store.compare_set("unnamed", "", f"rank {rank}: {type(error).__name__}: {first_line(error)}")
        else:
            store.compare_set("failed", "", said)
    if store.add("count", 1) == world:
        store.set("all", "")
    if failure is None or agreed(failure):
        # A rank that failed alone leaves at once: the others may be in a collective it never
        # joined, which gives up sooner once it is gone (gloo); they count in, then read.
        try:
            store.wait(["all"], timeout)
        except DistStoreError as error:  # its timeout (a store gone raises DistNetworkError)
            raise RanksOutOfStep(f"{what}: not every rank finished within {timeout.total_seconds():g}s") from error
    found = [key for key in ("failed", "unnamed") if store.check([key])]
    if not found:
        return
    said = store.get(found[0]).decode()
    out_of_step = store.check(["out-of-step"])
    if store.add("read", 1) == world:
        store.set("seen", "")
    if rank == 0 and not store_outlives_ranks():
        try:  # the others read the failure from this process's store: it leaves last
            store.wait(["seen"], timeout)
        except DistStoreError:
            pass
    raise (RanksOutOfStep if out_of_step else CheckpointError)(f"{what}: {said}") from failure

