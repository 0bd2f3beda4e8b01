"""Leaving a run cleanly: a signal, a time budget or an iteration count, agreed by every rank.

Megatron-LM's ``--exit-signal-handler``, ``--exit-duration-in-mins`` and ``--exit-interval``,
with its semantics, for our pretrain script (Megatron-LM's ``pretrain_gpt.py`` keeps its own,
whose saves go through the patches' rank-map hooks):

* a Slurm job or a spot node is told to go with a signal (SIGTERM, then SIGKILL after a
  grace period). With ``--exit-signal-handler`` the signal (``--exit-signal``, default
  SIGTERM) only sets a flag; at the next iteration boundary every rank learns whether any
  rank got it, and then all of them save a checkpoint (with ``--save``) and exit with
  status 0. One rank's signal is enough: schedulers do not signal every rank at once;
* ``--exit-duration-in-mins``: the same once that many minutes have passed since the run
  started, on any rank;
* ``--exit-interval N``: the same after every iteration divisible by N.

The ranks agree through one MAX all-reduce of two flags over the default group per
iteration, on ``collective_device()`` and read once, only when a signal handler or a
duration is given (the interval needs no agreement: every rank counts the same iterations).
"""

from __future__ import annotations

import argparse
import signal
import time

import torch
import torch.distributed as dist

from ..device import collective_device

SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


def add_exit_args(group: argparse._ArgumentGroup) -> None:
    """Megatron-LM's exit flags, under its names and defaults."""
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="on --exit-signal, save a checkpoint at the next iteration boundary and exit with status 0")
    group.add_argument("--exit-signal", choices=SIGNALS, default="SIGTERM",
                       help="the signal --exit-signal-handler acts on (default SIGTERM)")
    group.add_argument("--exit-duration-in-mins", type=float, default=None, metavar="MINUTES",
                       help="save a checkpoint and exit with status 0 after this many minutes of the run")
    group.add_argument("--exit-interval", type=int, default=None, metavar="ITERS",
                       help="save a checkpoint and exit with status 0 after an iteration divisible by this")


def check_exit_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag."""
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise ValueError(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ValueError(f"--exit-interval must be 1 or more, got {args.exit_interval}")
    if args.exit_signal != "SIGTERM" and not args.exit_signal_handler:
        raise ValueError(f"--exit-signal {args.exit_signal}: only with --exit-signal-handler")


class ExitConditions:
    """What ``--exit-*`` ask for; ``due(iteration)`` at every iteration boundary, on every rank.
    ``close()`` puts the previous signal handler back."""

    def __init__(self, args: argparse.Namespace, started: float | None = None) -> None:
        self.interval = args.exit_interval
        self.duration = args.exit_duration_in_mins * 60.0 if args.exit_duration_in_mins else None
        self.started = time.monotonic() if started is None else started
        self.signal = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        self.received = False
        self._previous = None
        if self.signal is not None:
            self._previous = signal.signal(self.signal, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.received = True  # acted on at the next iteration boundary, never inside a step

    def due(self, iteration: int) -> str | None:
        """Why the run should save and exit after ``iteration`` (None: go on); the same on every rank."""
        if self.signal is not None or self.duration is not None:
            flags = torch.tensor([self.received, self.duration is not None and
                                  time.monotonic() - self.started > self.duration],
                                 dtype=torch.int32, device=collective_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            signalled, overtime = flags.tolist()
            if signalled:
                return f"{self.signal.name} received"
            if overtime:
                return f"{self.duration / 60:g} minutes passed (--exit-duration-in-mins)"
        if self.interval and iteration % self.interval == 0:
            return f"iteration {iteration} (--exit-interval {self.interval})"
        return None

    def close(self) -> None:
        if self.signal is not None and self._previous is not None:
            signal.signal(self.signal, self._previous)
            self._previous = None
