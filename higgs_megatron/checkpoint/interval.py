"""When a save is due, for both front-ends: every ``--save-interval`` iterations, and every
``--checkpoint-interval`` seconds of wall-clock time, decided by all ranks together.

Ranks' clocks disagree by a little, and a save is collective: ``WallClockInterval.due``
MAX-reduces each rank's "my clock says so" over the default group, so the first rank whose
clock passes the interval decides for all and every rank saves at the same iteration.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..device import collective_device


class WallClockInterval:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.last = time.monotonic()

    def due(self) -> bool:
        """Collective: whether ``seconds`` have passed since the last ``reset`` on any rank."""
        mine = torch.tensor([float(time.monotonic() - self.last >= self.seconds)], device=collective_device())
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return bool(mine.item() > 0)

    def reset(self) -> None:
        """A save has just been made (by this trigger or any other)."""
        self.last = time.monotonic()


class SaveSchedule:
    """``--save-interval`` by iteration count and ``--checkpoint-interval`` by wall clock: our
    loop asks ``due``; under Megatron-LM, which saves on its own interval, the patches ask
    ``by_wall_clock`` only where ``by_iteration`` is not. ``saved`` after any save restarts the
    wall clock."""

    def __init__(self, save_interval: int | None, checkpoint_interval: float | None) -> None:
        self.save_interval = save_interval or 0
        self.wall_clock = WallClockInterval(checkpoint_interval) if checkpoint_interval else None

    def by_iteration(self, iteration: int) -> bool:
        return bool(self.save_interval) and iteration % self.save_interval == 0

    def by_wall_clock(self) -> bool:
        """Collective when ``--checkpoint-interval`` is given: every rank calls it at the same iteration."""
        return self.wall_clock is not None and self.wall_clock.due()

    def due(self, iteration: int) -> bool:
        """Whether to save after ``iteration`` (the iteration count alone where it decides:
        the same on every rank, so the wall clock's collective is skipped on all of them)."""
        return self.by_iteration(iteration) or self.by_wall_clock()

    def saved(self) -> None:
        if self.wall_clock is not None:
            self.wall_clock.reset()
