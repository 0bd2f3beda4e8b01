"""One decision per step: every rank keeps the step, or every rank drops it.

``StepDecision.decide`` is the only place a step is kept or dropped (torchft's
``should_commit``). Its inputs are each rank's own: whether its local gradients held a NaN or
inf (a device flag, read once here), and why its gradient sync cannot be trusted, if it
cannot (a wait ran out, a collective failed). The ranks agree through one of two channels:

* with ``--higgs-step-timeout``, the job's store (``StepVote``), which no training process
  group can block: each rank counts itself in, with its reason to drop the step if it has
  one, and waits, bounded, for the count to complete (O(N) store requests per step in all);
  a rank that does not vote in time is named in ``VoteTimeout``;
* otherwise one MAX all-reduce over the default group: no sync can time out then, so the
  non-finite flag is the only input.

A dropped step means no optimizer step, gradients discarded and error-feedback residuals as
before the step (``HiggsOptimizer``'s one rollback). A step dropped because a sync was given
up on (``Verdict.sync_failed``) is a progress alignment: the data-parallel groups are rebuilt
and the same iteration runs again on the same data. A step dropped only for non-finite
gradients is a skipped iteration, as Megatron counts them: the same data would give the
same NaN. The attempt counter only grows, so store keys never repeat within a job attempt.

``AlignmentLog`` keeps what the operator needs: how many alignments, their causes and the
time each cost, whether they come more often than once per ``too_often`` seconds, and how many
came in a row, with no step kept between them: a rank that misses the timeout on every attempt
would otherwise realign forever (``Resilience`` restarts the job after a bound).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

NONFINITE = "non-finite gradients"


class VoteTimeout(RuntimeError):
    """Some rank did not vote in time: it is stuck or gone, and the job must restart."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Verdict:
    dropped: dict[int, str]  # rank -> why it could not keep the step; empty: the step is kept
    sync_failed: bool = False  # some rank gave up on its gradient sync

    @property
    def keep(self) -> bool:
        return not self.dropped

    @property
    def cause(self) -> str:
        return "; ".join(self.dropped.values())


class StepVote:
    """The store channel of ``StepDecision``; ``timeout`` bounds the wait for the other ranks.

    O(N) store requests per step in all, whatever the world size N, and O(1) keys: each rank
    appends its rank to the attempt's ``present`` key and adds itself to its counter; only a
    rank with a reason to drop the step appends it, to one key, and counts itself as troubled
    first. The rank whose addition completes the count publishes the troubled count (``done``)
    and deletes the previous attempt's five keys, which every rank has read by then (it voted
    in this attempt after reading that verdict): a constant cost on that rank's step, not one
    per rank. Each rank waits for ``done`` and reads it; the reasons only when some rank had
    one. ``present`` is read only after a timeout, to name who did not vote."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float = 1800.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timeout
        self.attempt = 0

    @staticmethod
    def keys(attempt: int) -> list[str]:
        """Every key an attempt writes."""
        return [f"vote/{attempt}/{name}" for name in ("present", "count", "troubled", "reasons", "done")]

    def decide(self, nonfinite: bool, sync_failure: str | None) -> Verdict:
        self.attempt += 1
        prefix, store = f"vote/{self.attempt}/", self.store
        if nonfinite or sync_failure:
            store.append(prefix + "reasons", json.dumps({"rank": self.rank, "nonfinite": nonfinite,
                                                         "sync": sync_failure}) + "\n")
            store.add(prefix + "troubled", 1)
        store.append(prefix + "present", f"{self.rank},")
        if store.add(prefix + "count", 1) == self.world_size:
            store.set(prefix + "done", str(store.add(prefix + "troubled", 0)))
            for key in self.keys(self.attempt - 1) if self.attempt > 1 else ():
                store.delete_key(key)
        try:
            store.wait([prefix + "done"], timedelta(seconds=self.timeout))
        except RuntimeError as error:  # the store's own timeout error
            present = {int(rank) for rank in store.get(prefix + "present").decode().split(",") if rank}
            missing = [rank for rank in range(self.world_size) if rank not in present]
            raise VoteTimeout(f"rank(s) {missing} did not vote on step attempt {self.attempt} within "
                              f"{self.timeout:g}s (--higgs-restart-timeout)", missing) from error
        if store.get(prefix + "done") == b"0":
            return Verdict({})
        dropped, sync_failed = {}, False
        for line in sorted(store.get(prefix + "reasons").decode().splitlines()):
            vote = json.loads(line)
            sync_failed |= bool(vote["sync"])
            dropped[vote["rank"]] = "; ".join(([f"rank {vote['rank']}: {NONFINITE}"] if vote["nonfinite"] else [])
                                              + ([vote["sync"]] if vote["sync"] else []))
        return Verdict(dict(sorted(dropped.items())), sync_failed)


class StepDecision:
    """Keep or drop this step, the same on every rank (see the module docstring)."""

    rebuilds_groups = True  # a given-up sync: the data-parallel groups are rebuilt (``stability.regroup``)

    def __init__(self, vote: StepVote | None = None) -> None:
        self.vote = vote

    def decide(self, nonfinite: torch.Tensor | None, sync_failure: str | None, device: torch.device) -> Verdict:
        """``nonfinite``: this rank's device flag (None: not tracked); ``sync_failure``: why this
        rank's sync cannot be trusted. Without a vote, both travel in one MAX all-reduce on
        ``device`` (the default group's), read once."""
        if self.vote is not None:
            return self.vote.decide(bool(nonfinite) if nonfinite is not None else False, sync_failure)
        failed = torch.full((), 1.0 if sync_failure else 0.0, device=device)
        flags = torch.stack([nonfinite.float() if nonfinite is not None else torch.zeros_like(failed), failed])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite_anywhere, failed_anywhere = flags.tolist()
        reasons = ([f"some rank: {NONFINITE}"] if nonfinite_anywhere else []) + \
                  ([sync_failure or "some rank: gradient sync failed"] if failed_anywhere else [])
        return Verdict({-1: "; ".join(reasons)} if reasons else {}, sync_failed=bool(failed_anywhere))


@dataclass
class AlignmentLog:
    too_often: float = 600.0
    events: list[tuple[float, str, float]] = field(default_factory=list)  # (when, cause, seconds lost)
    in_a_row: int = 0  # alignments since the last step kept

    def record(self, cause: str, seconds_lost: float) -> bool:
        """Record one alignment; True when the previous one was less than ``too_often`` ago."""
        now = time.monotonic()
        frequent = bool(self.events) and now - self.events[-1][0] < self.too_often
        self.events.append((now, cause, seconds_lost))
        self.in_a_row += 1
        return frequent

    def step_kept(self) -> None:
        self.in_a_row = 0

    @property
    def count(self) -> int:
        return len(self.events)
