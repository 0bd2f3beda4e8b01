"""Abandon, then rebuild: fresh data-parallel process groups after a gradient sync was given up on.

Why: a collective that timed out cannot be waited out (a rank that never returns would hang
its peers for ever), and a communicator left mid-collective cannot be trusted for the next
one. So a bounded wait that runs out gives the sync up (``HiggsDDP``), the step's decision
drops the step on every rank (``stability.alignment``), and then every rank of the job calls
``rebuild_process_groups`` at the same point, with every rank alive (all of them voted):

1. **Drain, bounded.** Every rank voted, so every rank has issued all of the step's
   collectives. On gloo, whose abort does not cancel a pending collective, a given-up work
   then completes within moments, and must, before its buffers are written again; on NCCL the
   aborted communicator fails it at once. A work still pending after the step timeout means
   the group is lost: ``GroupsLost`` (the job restarts).
2. **Abort** the old groups (``torch.distributed``'s ``_abort_process_group``: NCCL frees its
   communicators; every backend drops the group from c10d's registry).
3. **Create** a group for every distinct rank list of the old groups in the whole job, on every
   rank, in one order (the lists are exchanged through the job's store), with the old group's
   timeout, description and, on NCCL, options (its configuration, stream priority).
   ``dist.new_group`` names each group, and so its store prefix, from c10d's group counter:
   always fresh.
4. **Swap**: every attribute that held an old group (the model chunks, their buffers and bucket
   groups, our node groups, the Megatron optimizers, megatron-core's ``parallel_state``) now
   holds its new group. Megatron's other groups (TP, PP, the default group) are not touched:
   no wait of ours was on them.

On NCCL, ``prepare_backend`` sets NCCL's error handling to clean up only: a failed or timed-out
work's communicator is aborted, in whatever group, and the process is left to raise, where
the default tears it down.
Hangs outside the data-parallel sync are bounded by the watchdog and the vote instead
(``--higgs-restart-timeout``): the job exits with ``RESTART_EXIT_CODE`` and restarts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..compat.groups import backend_options, group_holders, group_timeout, replace_groups
from ..reduce.wire import still_pending
from ..logs import get_logger

log = get_logger(__name__)

RESTART_EXIT_CODE = 75  # EX_TEMPFAIL: try again (torchrun --max-restarts restarts the job)


class GroupsLost(RuntimeError):
    """A given-up collective did not finish even after every rank voted: restart the job."""


def publish_process(store: dist.Store, rank: int) -> None:
    """Say where this rank's process runs, for ``kill_stuck_on_this_host``."""
    store.set(f"process/{rank}", f"{socket.gethostname()} {os.getpid()}")


def kill_stuck_on_this_host(store: dist.Store, ranks: Iterable[int]) -> list[int]:
    """SIGKILL the processes of ``ranks`` (stuck ones, as a vote or the watchdog found them) that
    run on this host; returns the ranks killed. torchrun would kill them too, but with SIGTERM
    first and SIGKILL only after a 30 s grace, and a process stopped or blocked in a signal-
    handling loop does not act on SIGTERM: this saves the restart that time."""
    host, killed = socket.gethostname(), []
    for rank in ranks:
        key = f"process/{rank}"
        try:  # check first: a TCPStore's get of a missing key waits out the store's timeout
            if not store.check([key]):
                continue
            where, pid = store.get(key).decode().rsplit(" ", 1)
        except Exception:  # noqa: BLE001 - never published, or the store is gone
            continue
        pid = int(pid)
        if where == host and pid != os.getpid():
            try:
                if os.getpgid(pid) == pid:  # torchrun starts each rank in a session of its own
                    os.killpg(pid, signal.SIGKILL)  # with its helper processes, as torchrun kills it
                else:
                    os.kill(pid, signal.SIGKILL)
                killed.append(rank)
            except ProcessLookupError:
                pass
    return killed


def prepare_backend(backend: str) -> None:
    """Before the first NCCL group: a timed-out or failed work must raise, not end the process,
    and every group keeps its timeout's teardown.

    Read in torch 2.13's ``ProcessGroupNCCL`` (not yet run on a GPU): ``WorkNCCL::wait(timeout)``
    busy-waits, and past the timeout (counted from the collective's launch) aborts that
    communicator and raises ``DistBackendError``, whatever the settings. NCCL's watchdog acts on
    every group's failed or timed-out work as ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says: 3 (the
    default) and 1 end the process, 0 only logs (a hang in any other group, TP, PP, a
    checkpoint's barrier, then waits for ever), 2 (``CleanUpOnly``) aborts that group's
    communicator and leaves the process, whose waiting call then raises. 2 is the narrowest
    torch offers (no per-group switch): each group keeps its timeout, and a timed-out
    data-parallel sync leaves the process to align. ``TORCH_NCCL_DUMP_ON_TIMEOUT`` 0 keeps a
    timeout from waking the heartbeat monitor's dump path; the monitor itself stays on, for a
    watchdog that is stuck. A user's own setting of either is kept."""
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def _drain(works: Iterable[Any], timeout: float) -> None:
    for work in works:
        try:
            work.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as error:
            if still_pending(work):
                raise GroupsLost(f"a given-up gradient collective was still pending {timeout:g}s after every rank "
                                 "voted") from error
            # Failed (an aborted NCCL communicator, or a peer's abort): it writes nothing more.


Identity = tuple[tuple[int, ...], str, float, str]  # ranks, backend, timeout in seconds, description


def group_identity(group: dist.ProcessGroup) -> Identity:
    """What every rank must agree on to create ``group``'s replacement: its ranks, backend,
    timeout and description (``group_desc``: Megatron names its groups, and NCCL's logs and
    flight recorder show the name)."""
    return (tuple(dist.get_process_group_ranks(group)), dist.get_backend(group), group_timeout(group),
            group.group_desc)


def group_options(group: dist.ProcessGroup):
    """The options ``group`` was made with, for its replacement: NCCL's (its configuration,
    high-priority stream); None for gloo, which takes none through ``new_group``."""
    return backend_options(group) if dist.get_backend(group) == "nccl" else None


def _every_ranks_groups(mine: set[Identity], store: dist.Store, attempt: int, timeout: float) -> list[Identity]:
    """The union of every rank's groups (rank list, backend), in one order, through the store
    in O(N) requests in all: a group is appended once, by its lowest rank; each rank counts
    itself in; the rank that completes the count publishes ``done`` and deletes the previous
    exchange's keys (read by every rank before it took part in this one); each rank reads the
    groups once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"regroup/{attempt}/"
    own = [[list(ranks), *rest] for ranks, *rest in sorted(mine) if min(ranks) == rank]
    if own:
        store.append(prefix + "groups", json.dumps(own) + "\n")
    if store.add(prefix + "count", 1) == world:
        store.set(prefix + "done", "")
        if store.check(["regroup/previous"]):
            previous = store.get("regroup/previous").decode()
            for name in ("groups", "count", "done"):
                store.delete_key(f"regroup/{previous}/{name}")
        store.set("regroup/previous", str(attempt))
    try:
        store.wait([prefix + "done"], timedelta(seconds=timeout))
    except RuntimeError as error:  # the store's own timeout error
        raise GroupsLost(f"not every rank reached the rebuild of the data-parallel groups within {timeout:g}s") \
            from error
    lines = store.get(prefix + "groups").decode().splitlines() if store.check([prefix + "groups"]) else []
    return sorted({(tuple(ranks), *rest) for line in lines for ranks, *rest in json.loads(line)})


def rebuild_process_groups(chunks: list, optimizers: list, store: dist.Store, attempt: int,
                           timeout: float) -> float:
    """Steps 1-4 of the module docstring for the ``HiggsDDP`` chunks ``chunks`` and the Megatron
    optimizers ``optimizers``; every rank calls it together. ``attempt`` keys the store
    exchange. Returns the seconds it took."""
    started = time.monotonic()
    for chunk in chunks:
        _drain(chunk.take_abandoned_works(), timeout)
    old = {id(group): group for chunk in chunks for group in chunk.process_groups()}
    identity = {key: group_identity(group) for key, group in old.items()}
    options = {identity[key]: group_options(group) for key, group in old.items()}
    wanted = _every_ranks_groups(set(identity.values()), store, attempt, timeout)
    for group in old.values():
        try:
            distributed_c10d._abort_process_group(group)
        except ValueError:  # already dropped from the registry
            pass
    new, rank = {}, dist.get_rank()
    for ranks, name, seconds, description in wanted:  # every rank creates every group, in one order
        made = (ranks, name, seconds, description)
        group = dist.new_group(list(ranks), backend=name, timeout=timedelta(seconds=seconds),
                               pg_options=options.get(made), group_desc=description)
        if rank in ranks:
            new[made] = group
    replace_groups(group_holders(chunks, optimizers), {key: (old[key], new[identity[key]]) for key in old})
    return time.monotonic() - started
