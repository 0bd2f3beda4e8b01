"""Progress alignment: every rank keeps a step, or every rank drops it.

Per attempt of a step (torchft's per-step commit vote, on the store rather than a process
group, so a group that can no longer be trusted does not decide it): after forward,
backward and the gradient sync, each rank writes ``vote/<attempt>/<rank>`` = ``ok`` or the
reason it cannot keep the step (its sync timed out, it failed); then it waits for every
rank's vote and reads them all. One reason anywhere drops the step everywhere: no optimizer
step, gradients discarded, error-feedback residuals back to what they were, and the same
iteration runs again on the same data, so every DP replica stays identical. The attempt
counter only grows, so keys never repeat within a job attempt.

``AlignmentLog`` keeps what the operator needs: how many alignments, their causes and the
time each cost, and whether they come more often than once per ``too_often`` seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


class StepVote:
    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: float = 1800.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timedelta(seconds=timeout)
        self.attempt = 0

    def decide(self, reason: str | None) -> dict[int, str]:
        """Vote (None = keep); returns {rank: reason} of every rank that wants the step dropped."""
        self.attempt += 1
        prefix = f"vote/{self.attempt}/"
        self.store.set(prefix + str(self.rank), reason or "ok")
        keys = [prefix + str(rank) for rank in range(self.world_size)]
        self.store.wait(keys, self.timeout)
        votes = {rank: self.store.get(key).decode() for rank, key in enumerate(keys)}
        return {rank: vote for rank, vote in votes.items() if vote != "ok"}


@dataclass
class AlignmentLog:
    too_often: float = 600.0
    events: list[tuple[float, str, float]] = field(default_factory=list)  # (when, cause, seconds lost)

    def record(self, cause: str, seconds_lost: float) -> bool:
        """Record one alignment; True when the previous one was less than ``too_often`` ago."""
        now = time.monotonic()
        frequent = bool(self.events) and now - self.events[-1][0] < self.too_often
        self.events.append((now, cause, seconds_lost))
        return frequent

    @property
    def count(self) -> int:
        return len(self.events)
