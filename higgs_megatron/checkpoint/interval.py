"""Saving by wall-clock time, decided by all ranks together: both front-ends' ``--checkpoint-interval``.

Ranks' clocks disagree by a little, and a save is collective: ``due`` MAX-reduces each
rank's "my clock says so" over the default group, so the first rank whose clock passes the
interval decides for all and every rank saves at the same iteration.
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
