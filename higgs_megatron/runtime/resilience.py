"""The pretrain loop's side of stability: faults, progress, the watchdog and the step's decision.

Per attempt of iteration i (``Trainer.train_step``):

1. ``begin(i)``: publish phase ``forward-backward``, then fire this rank's injected fault for
   i, if any (a ``hang``/``slow`` sleeps here, inside the step; a ``freeze`` stops the
   process; a ``crash`` exits; a ``nan`` poisons this rank's loss).
2. Forward, backward and the gradient sync run; with ``--higgs-step-timeout`` every wait for
   a sync collective is bounded (``HiggsDDP.set_sync_timeout``): a wait that runs out gives
   the sync up, without draining it.
3. ``optimizer.step()`` takes the step's one decision (``HiggsOptimizer``, through the store
   vote set here): if any rank gave its sync up, every rank drops the step, rebuilds the
   data-parallel groups and runs iteration i again on the same data (``realigned``). That is
   a progress alignment: an event with its cause and the time it cost, and a warning when
   they come more often than every 10 minutes. After ``--higgs-max-alignments-in-a-row``
   of them with no step kept between, every rank exits as in 4.
4. A rank that waits ``--higgs-restart-timeout`` for the vote, or that the watchdog sees stuck
   that long, logs why and exits with status 75 (``regroup.RESTART_EXIT_CODE``), so that
   ``torchrun --max-restarts`` restarts the job from its latest checkpoint.

Without ``--higgs-step-timeout`` and ``--inject-fault`` none of this touches the store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Iterator

import torch.distributed as dist
# torch's checkpoint failure is a BaseException
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException
from megatron.core import parallel_state

from ..ddp import HiggsDDP
from ..logs import get_logger
from ..stability.alignment import AlignmentLog, StepDecision, StepVote, Verdict, VoteTimeout
from ..stability.faults import Fault, FaultInjector, exit_at_once
from ..stability.flags import DEFAULT_ALIGNMENTS_IN_A_ROW
from ..stability.progress import ProgressBoard, Watchdog, job_store
from ..stability.regroup import RESTART_EXIT_CODE, GroupsLost, kill_stuck_on_this_host, publish_process
from .metrics import MetricsLogger


log = get_logger(__name__)


class Resilience:
    _instances = 0

    def __init__(self, step_timeout: float | None, restart_timeout: float | None, faults: list[Fault],
                 log: MetricsLogger, model: list, optimizer, max_in_a_row: int = DEFAULT_ALIGNMENTS_IN_A_ROW,
                 replica: int | None = None) -> None:
        """``step_timeout``, ``restart_timeout``, ``max_in_a_row``: ``--higgs-step-timeout``,
        ``--higgs-restart-timeout`` and ``--higgs-max-alignments-in-a-row`` (``stability.flags``);
        ``faults``: the parsed ``--inject-fault``; ``replica``: this elastic replica's index
        (``--higgs-replica-id``: the replica faults' target, each replica restarting alone)."""
        self.log = log
        self.model = model
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = step_timeout
        self.restart_timeout = restart_timeout
        self.injector = FaultInjector(faults, self.rank, parallel_state.get_data_parallel_rank() if replica is None
                                      else replica, restarts_alone=replica is not None)
        self.alignments = AlignmentLog()
        self.max_in_a_row = max_in_a_row
        self.board = self.watchdog = self.store = None
        self.attempt_started = 0.0
        self.before_orderly_restart: Callable[[], object] | None = None
        """Set by the front-end: what it finishes when every rank leaves for a restart at the
        same point, none stuck (too many alignments in a row): an asynchronous save whose
        writers are done on every rank is committed (one collective check, never a wait for
        a writer), so the restart resumes from it rather than from the one before."""
        if self.timeout is None:
            return
        # Keys of an earlier attempt of a restarted job, or of an earlier Trainer in this process
        # (every rank builds the same Trainers in the same order), must not count.
        Resilience._instances += 1
        prefix = f"higgs/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{Resilience._instances}/"
        store = self.store = job_store(prefix)
        self.board = ProgressBoard(store, self.rank)
        publish_process(store, self.rank)
        optimizer.decision = StepDecision(StepVote(store, self.rank, self.world_size, self.restart_timeout))
        for chunk in model:
            if isinstance(chunk, HiggsDDP):
                chunk.set_sync_timeout(self.timeout)
        if log.is_writer:
            watch_store = dist.PrefixStore(prefix, store.underlying_store.clone())
            # The watchdog's thread kills through its own store client: the main thread's may be
            # held by the vote's wait.
            self.watchdog = Watchdog(watch_store, self.world_size, self.timeout, self._stalled,
                                     give_up_after=self.restart_timeout,
                                     give_up=lambda message, ranks: self.restart(message, ranks, watch_store)).start()

    def watch_grad_sync(self, config, iteration) -> None:
        """Publish phase ``grad-sync`` when Megatron starts waiting for the sync, so that the
        watchdog tells the ranks that wait from the rank they wait for."""
        inner = config.finalize_model_grads_func
        if self.board is None or inner is None:  # nothing to watch, or no finalize step (a harness's own loop)
            return

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
        """Every rank a fault fires on says so (a warning: the run is disturbed on purpose)."""
        log.warning(f" [rank {self.rank}] injecting fault {fault} at iteration {fault.iteration}")
        self.log.event("fault_injected", fault=str(fault), kind=fault.kind, rank=fault.rank,
                       iteration=fault.iteration)

    @contextlib.contextmanager
    def bounded(self) -> Iterator[None]:
        """Around the step's decision: a vote that ran out, or groups that could not be rebuilt,
        end this rank for a restart."""
        try:
            yield
        except VoteTimeout as error:
            self.restart(str(error), stuck=error.missing)
        except GroupsLost as error:
            self.restart(str(error))

    def restart(self, message: str, stuck: list[int] = (), store: dist.Store | None = None) -> None:
        """Log why, kill the ``stuck`` ranks' processes on this host (``regroup.kill_stuck_on_this_host``),
        then exit with the restart status at once: a process group stuck in a collective could
        hang an orderly shutdown."""
        killed = kill_stuck_on_this_host(store or self.store, stuck) if stuck and self.board is not None else []
        text = (f"[rank {self.rank}] {message}; "
                + (f"killed the stuck rank(s) {killed} on this host; " if killed else "")
                + f"exiting with status {RESTART_EXIT_CODE} so that torchrun "
                "--max-restarts restarts the job (with --auto-resume from the latest committed checkpoint)")
        if self.log.is_writer:
            self.log.event("restart_needed", f" ERROR: {text}", rank=self.rank, reason=message)
        else:
            log.error(text)
        self.log.close()
        for handler in logging.getLogger().handlers:
            handler.flush()
        exit_at_once(RESTART_EXIT_CODE)

    def realigned(self, iteration: int, verdict: Verdict | None, regroup_seconds: float) -> bool:
        """True when every rank dropped the step because a sync was given up on (logged here):
        the iteration runs again."""
        if verdict is None or not verdict.sync_failed:
            if verdict is None or verdict.keep:
                self.alignments.step_kept()
            return False
        lost = time.monotonic() - self.attempt_started
        frequent = self.alignments.record(verdict.cause, lost)
        self.log.event("progress_alignment", f" progress alignment at iteration {iteration}: step dropped on every "
                       f"rank ({verdict.cause}); data-parallel groups rebuilt in {regroup_seconds:.2f}s; "
                       f"{lost:.1f}s lost; {self.alignments.count} so far",
                       iteration=iteration, cause=verdict.cause, seconds_lost=lost, count=self.alignments.count,
                       regroup_seconds=regroup_seconds)
        if frequent:
            self.log.event("alignments_frequent", " WARNING: progress alignments more often than every "
                           f"{self.alignments.too_often / 60:.0f} minutes: the cluster needs attention "
                           "(links, NICs, memory pressure)", iteration=iteration)
        if self.alignments.in_a_row >= self.max_in_a_row:  # every rank saw the same verdicts: all leave here
            self._finish_before_restart(iteration)
            self.restart(f"{self.alignments.in_a_row} progress alignments in a row at iteration {iteration}, no step "
                         f"kept between them (--higgs-max-alignments-in-a-row {self.max_in_a_row}; the last: "
                         f"{verdict.cause}): a rank misses --higgs-step-timeout {self.timeout:g}s on every attempt, "
                         "or the timeout is shorter than the sync itself")
        return True

    def _finish_before_restart(self, iteration: int) -> None:
        """``before_orderly_restart``, if set (collective: every rank is here), in phase
        ``checkpoint`` (the watchdog lets a commit be); a failure of it is logged, and the
        restart goes on."""
        if self.before_orderly_restart is None:
            return
        self.phase(iteration, "checkpoint")
        try:
            self.before_orderly_restart()
        except (Exception, DcpCheckpointException) as error:  # noqa: BLE001 - the restart is what matters now
            log.warning(f" [rank {self.rank}] before the restart: {type(error).__name__}: {error}")

    def close(self, iteration: int) -> None:
        self.phase(iteration, "done")
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
