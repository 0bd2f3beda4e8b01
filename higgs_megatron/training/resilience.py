"""The pretrain loop's side of stability: faults, progress, the watchdog and the step vote.

Per attempt of iteration i (``Trainer.train_step``):

1. ``begin(i)``: publish phase ``forward-backward``, then fire this rank's injected fault for
   i, if any (a ``hang``/``slow`` sleeps here, inside the step; a ``crash`` exits; a ``nan``
   poisons this rank's loss).
2. Forward, backward and the gradient sync run; with ``--higgs-step-timeout`` each wait for
   a sync collective is bounded (``HiggsDDP.set_sync_timeout``): a wait that runs out marks
   the step and then drains.
3. ``vote()``: every rank says whether its sync finished in time (``stability.alignment``);
   if any did not, every rank drops the step (no optimizer step, residuals rolled back) and
   runs iteration i again on the same data. That is a progress alignment: an event with its
   cause and the time it cost, and a warning when they come more often than every 10 minutes.

Without ``--higgs-step-timeout`` and ``--inject-fault`` none of this touches the store.
"""

from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist

from ..ddp import HiggsDDP
from ..logs import get_logger
from ..stability.alignment import AlignmentLog, StepVote
from ..stability.faults import Fault, FaultInjector
from ..stability.progress import ProgressBoard, Watchdog, job_store
from .metrics import MetricsLogger


log = get_logger(__name__)

_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def peer_lost(error: BaseException) -> bool:
    """Whether a collective failed because a peer process is gone (gloo's socket errors)."""
    text = str(error).lower()
    return any(marker in text for marker in _PEER_LOST)


class Resilience:
    _instances = 0

    def __init__(self, args: argparse.Namespace, log: MetricsLogger, model: list) -> None:
        self.log = log
        self.model = model
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = args.higgs_step_timeout
        self.injector = FaultInjector(args.faults, self.rank)
        self.alignments = AlignmentLog()
        self.board = self.vote_ = self.watchdog = None
        self.attempt_started = 0.0
        if self.timeout is None:
            return
        # Keys of an earlier attempt of a restarted job, or of an earlier Trainer in this process
        # (every rank builds the same Trainers in the same order), must not count.
        Resilience._instances += 1
        prefix = f"higgs/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{Resilience._instances}/"
        store = job_store(prefix)
        self.board = ProgressBoard(store, self.rank)
        self.vote_ = StepVote(store, self.rank, self.world_size)
        for chunk in model:
            if isinstance(chunk, HiggsDDP):
                chunk.set_sync_timeout(self.timeout)
        if log.is_writer:
            watch_store = dist.PrefixStore(prefix, store.underlying_store.clone())
            self.watchdog = Watchdog(watch_store, self.world_size, self.timeout, self._stalled).start()

    def watch_grad_sync(self, config, iteration) -> None:
        """Publish phase ``grad-sync`` when Megatron starts waiting for the sync, so that the
        watchdog tells the ranks that wait from the rank they wait for."""
        if self.board is None:
            return
        inner = config.finalize_model_grads_func

        def finalize(*args, **kwargs):
            self.phase(iteration(), "grad-sync")
            return inner(*args, **kwargs)

        config.finalize_model_grads_func = finalize

    def _stalled(self, message: str, stalled: list[dict]) -> None:
        self.log.event("progress_stalled", f" WARNING: {message}", stalled=stalled)

    def phase(self, iteration: int, phase: str) -> None:
        if self.board is not None:
            self.board.publish(iteration, phase)

    def begin(self, iteration: int) -> Fault | None:
        """Start an attempt of ``iteration``; returns a ``nan`` fault to apply to the loss."""
        self.attempt_started = time.monotonic()
        self.phase(iteration, "forward-backward")
        return self.injector.before_step(iteration, on_fire=self._fired)

    def _fired(self, fault: Fault) -> None:
        log.info(f" [rank {self.rank}] injecting fault {fault} at iteration {fault.iteration}")
        self.log.event("fault_injected", fault=str(fault), kind=fault.kind, rank=fault.rank,
                       iteration=fault.iteration)

    def vote(self, iteration: int) -> bool:
        """True: keep the step. False: every rank drops it (already logged)."""
        if self.vote_ is None:
            return True
        self.phase(iteration, "vote")
        reasons = [chunk.take_sync_timeout() for chunk in self.model if isinstance(chunk, HiggsDDP)]
        reason = next((r for r in reasons if r), None)
        dropped = self.vote_.decide(reason)
        if not dropped:
            return True
        for chunk in self.model:
            if isinstance(chunk, HiggsDDP):
                chunk.rollback_residuals()
        lost = time.monotonic() - self.attempt_started
        cause = "; ".join(dropped.values())
        frequent = self.alignments.record(cause, lost)
        self.log.event("progress_alignment", f" progress alignment at iteration {iteration}: step dropped on every "
                       f"rank ({cause}); {lost:.1f}s lost; {self.alignments.count} so far",
                       iteration=iteration, cause=cause, seconds_lost=lost, count=self.alignments.count)
        if frequent:
            self.log.event("alignments_frequent", " WARNING: progress alignments more often than every "
                           f"{self.alignments.too_often / 60:.0f} minutes: the cluster needs attention "
                           "(links, NICs, memory pressure)", iteration=iteration)
        return False

    def close(self, iteration: int) -> None:
        self.phase(iteration, "done")
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
