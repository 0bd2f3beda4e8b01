"""Faults injected on purpose: ``--inject-fault KIND@RANK:ITER[:SECONDS]``, repeatable (for the
replica kinds, RANK is the data-parallel replica's index).

* ``hang@R:I:S``  rank R stalls S seconds inside iteration I (before its forward pass), long
  enough for the others' gradient sync to time out: a progress alignment follows.
* ``slow@R:I:S``  the same stall, meant to stay within ``--higgs-step-timeout``: a warning at
  most, the step goes through.
* ``freeze@R:I``  rank R stops itself (SIGSTOP) at the start of iteration I and never returns:
  a rank stuck for good. The others give its sync up, cannot complete the step's vote, and
  exit for a restart after ``--higgs-restart-timeout``; the launcher kills the frozen rank.
* ``sigterm@R:I`` rank R is sent SIGTERM at the start of iteration I, as a scheduler preempting
  a job does: with ``--exit-signal-handler`` every rank saves and exits with status 0 after
  iteration I; without it the rank dies (the others see a lost peer and exit for a restart).
* ``crash@R:I``   rank R dies at the start of iteration I (``os._exit(CRASH_EXIT_CODE)``).
* ``nan@R:I``     rank R's loss, and so its gradients, are NaN in iteration I: the step is
  skipped on every rank.
* ``kill-replica@D:I``  every rank of data-parallel replica D (the ranks whose data-parallel
  index is D: one TP x PP model-parallel group, as a lost node takes it) is killed (SIGKILL)
  at the start of iteration I.
* ``stop-replica@D:I:S``  every rank of replica D stops (SIGSTOP) at the start of iteration I
  and is resumed (SIGCONT) S seconds later by a helper process it started: a replica stuck
  for a while, as a node under a long kernel stall or a swap storm.

A fault fires once, at its iteration or, in a process that starts past it (an elastic
replica that healed beyond it), at the first iteration it runs; in the attempt of the job that
first reaches its iteration: attempt
``TORCHELASTIC_RESTART_COUNT`` = the number of injected crashes and freezes at earlier
iterations (each costs one restart under ``torchrun --max-restarts``). So a restarted job resumes from
its checkpoint and runs through the crash's iteration again without dying again, and five
crashes in one run fire one per attempt.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

KINDS = ("hang", "slow", "freeze", "sigterm", "crash", "nan", "kill-replica", "stop-replica")
RESTARTING = ("freeze", "crash", "kill-replica")  # faults that end the job's attempt
REPLICA_KINDS = ("kill-replica", "stop-replica")  # aimed at a data-parallel replica, not a rank
TIMED = ("hang", "slow", "stop-replica")  # take SECONDS
CRASH_EXIT_CODE = 43  # distinct from Python's 1 and argparse's 2: "an injected crash"
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<rank>\d+):(?P<iteration>\d+)(?::(?P<seconds>[0-9.]+))?$")


def exit_at_once(code: int) -> None:
    """Die now, without cleanup (a process group stuck in a collective could hang it), but with
    this rank's helper processes (megatron-core's checkpoint results-queue manager), as a
    process group killed together would: an orphaned helper would hold the launcher's output
    pipes open."""
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)


class FaultSpecError(ValueError):
    """A ``--inject-fault`` value that does not parse; the message names what was expected."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int  # the data-parallel replica's index for REPLICA_KINDS
    iteration: int  # 1-based, as Megatron logs iterations
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"{self.kind}@{self.rank}:{self.iteration}" + (f":{self.seconds:g}" if self.seconds else "")


def parse_fault(spec: str, world_size: int | None = None, replicas: int | None = None) -> Fault:
    """``spec`` parsed; ``world_size`` and ``replicas`` (the data-parallel size), where given,
    bound its rank or replica."""
    match = _SPEC.match(spec.strip())
    if not match:
        raise FaultSpecError(f"--inject-fault {spec!r}: expected KIND@RANK:ITER[:SECONDS] with KIND one of "
                             f"{', '.join(KINDS)} (e.g. hang@1:5:30; for a replica kind, RANK is the "
                             "data-parallel replica: kill-replica@1:5)")
    kind, rank, iteration = match["kind"], int(match["rank"]), int(match["iteration"])
    seconds = float(match["seconds"]) if match["seconds"] else 0.0
    if kind not in KINDS:
        raise FaultSpecError(f"--inject-fault {spec!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    if iteration < 1:
        raise FaultSpecError(f"--inject-fault {spec!r}: iterations count from 1")
    if kind in TIMED and seconds <= 0:
        raise FaultSpecError(f"--inject-fault {spec!r}: {kind} needs SECONDS > 0 (e.g. {kind}@{rank}:{iteration}:10)")
    if kind not in TIMED and match["seconds"]:
        raise FaultSpecError(f"--inject-fault {spec!r}: {kind} takes no SECONDS")
    if kind in REPLICA_KINDS:
        if replicas is not None and rank >= replicas:
            raise FaultSpecError(f"--inject-fault {spec!r}: replica {rank} does not exist with data-parallel size "
                                 f"{replicas}")
    elif world_size is not None and rank >= world_size:
        raise FaultSpecError(f"--inject-fault {spec!r}: rank {rank} does not exist in a world of {world_size}")
    return Fault(kind, rank, iteration, seconds)


class FaultInjector:
    """This rank's faults; the loop calls ``before_step`` at the start of every attempt."""

    def __init__(self, faults: list[Fault], rank: int, replica: int, restarts_alone: bool = False) -> None:
        """``rank``: this process's global rank; ``replica``: its data-parallel index.
        ``restarts_alone``: elastic replicas, each its own torchrun, whose attempts count only
        their own restarting faults (the others' restart the others)."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        mine = [f for f in faults if f.rank == (replica if f.kind in REPLICA_KINDS else rank)]
        crashes = sorted({f.iteration for f in (mine if restarts_alone else faults) if f.kind in RESTARTING})
        self.pending = [f for f in mine if sum(i < f.iteration for i in crashes) == attempt]

    def before_step(self, iteration: int, on_fire=None) -> Fault | None:
        """Fire this rank's fault for ``iteration`` (1-based). Returns a ``nan`` fault for the
        caller to apply to the loss; sleeps for ``hang``/``slow``; exits for ``crash``."""
        due = [f for f in self.pending if f.iteration <= iteration]  # a replica that healed past it: now
        if not due:
            return None
        fault = due[0]
        self.pending.remove(fault)
        if on_fire is not None:
            on_fire(fault)
        if fault.kind == "crash":
            exit_at_once(CRASH_EXIT_CODE)
        if fault.kind == "kill-replica":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "stop-replica":
            # The helper is started first and outlives nothing: it resumes this process and exits.
            subprocess.Popen(["sh", "-c", f"sleep {fault.seconds:g}; kill -CONT {os.getpid()}"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.kill(os.getpid(), signal.SIGSTOP)
            return None
        if fault.kind in ("freeze", "sigterm"):
            os.kill(os.getpid(), signal.SIGSTOP if fault.kind == "freeze" else signal.SIGTERM)
            return None
        if fault.kind in ("hang", "slow"):
            time.sleep(fault.seconds)
            return None
        return fault
