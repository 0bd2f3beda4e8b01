"""``attach``: what both front-ends run under, wired once the model chunks and optimizer exist.

Our pretrain script (``training.loop.Trainer``) and Megatron-LM's ``pretrain_gpt.py`` (the
patches' ``get_megatron_optimizer``) each build Megatron's model chunks and optimizer their
own way, then call ``attach(model_chunks, optimizer, run_config, events)``. It wires, from
the typed run config (``runtime.run_config``) and nothing else:

* the optimizer wrapper (``HiggsOptimizer``, under ``--use-higgs``) and the step's one
  decision, its dropped steps told to the events;
* resilience: faults, progress phases, the watchdog, the sync's timeout, the bounded vote,
  progress alignments (``runtime.resilience``);
* elastic replicas (``--higgs-replicas``): each attempt's torchft quorum (a heal from a live
  peer, the gradients scaled to the quorum's mean) and the replicas' commit in the step's
  decision (``elastic.replicas``; our pretrain script only);
* the memory manager (``--higgs-offload``, ``runtime.offload``);
* the save schedule (``--save-interval``, ``--checkpoint-interval``);
* the events, one sink (``runtime.metrics.MetricsLogger``: log lines, JSONL, TensorBoard,
  W&B, Megatron-LM's writers as callbacks).

The front-end then runs each iteration through ``Runtime.step`` and tells it of saves
(``checkpoint_phase``, ``saved``); it keeps its loop, its flags and its checkpoint format.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

from ..checkpoint.interval import SaveSchedule
from ..ddp import HiggsConfigurationError, HiggsDDP
from ..elastic.replicas import ElasticReplicas, ReplicaCommit
from ..logs import get_logger
from ..memory import MemoryManager
from ..optimizer import wrap_optimizer
from ..stability.faults import Fault
from .metrics import MetricsLogger
from .offload import attach_offload
from .resilience import Resilience
from .run_config import RunConfig

log = get_logger(__name__)

T = TypeVar("T")


class Runtime:
    """One run's runtime (see the module docstring); built by ``attach``."""

    def __init__(self, config: RunConfig, model_chunks: list, optimizer: Any, events: MetricsLogger,
                 elastic: ElasticReplicas | None = None) -> None:
        self.config = config
        self.elastic = elastic
        self.model_chunks = model_chunks
        self.events = events
        self.iteration = 0  # the iteration ``step`` runs (or last ran)
        if config.compression is not None:
            if not any(isinstance(chunk, HiggsDDP) for chunk in model_chunks):
                # a front-end whose Megatron built its DDP another way (0.19's model builders): never a
                # dense run under a compressed run's name
                raise HiggsConfigurationError(
                    "--use-higgs: none of the model chunks is a HiggsDDP (Megatron built "
                    f"{', '.join(sorted({type(chunk).__name__ for chunk in model_chunks}))}); the gradient sync "
                    "would be Megatron's own")
            optimizer = wrap_optimizer(optimizer, model_chunks)
            optimizer.on_skip.append(self._skipped)
        self.optimizer = optimizer
        stability = config.stability
        self.resilience = Resilience(stability.higgs_step_timeout, stability.restart_after, list(stability.faults),
                                     events, model_chunks, optimizer, stability.higgs_max_alignments_in_a_row,
                                     replica=elastic.replica if elastic is not None else None)
        if elastic is not None:  # the replica's own decision first, then the replicas' commit
            optimizer.decision = ReplicaCommit(elastic, optimizer.decision)
        self.saves = SaveSchedule(config.checkpoint.save_interval, config.checkpoint.checkpoint_interval)
        self.memory = self._memory()
        self._watched = False

    def _skipped(self, verdict: Any) -> None:
        if not verdict.sync_failed:  # a dropped sync is a progress alignment: ``Resilience.realigned`` says it
            self.events.event("step_skipped", f" iteration {self.iteration}: {verdict.cause}; step skipped on every "
                              "rank (error feedback and routing biases go on from the last step taken)",
                              iteration=self.iteration, cause=verdict.cause)

    def _memory(self) -> MemoryManager | None:
        memory = self.config.memory
        if memory.block_allocator != "off" and not torch.cuda.is_available():
            self.events.event("block_allocator_ignored", " --higgs-block-allocator: no CUDA caching allocator here "
                              "(CPU run); nothing to configure")
        if memory.offload is None:
            return None
        return attach_offload(self.optimizer, self.model_chunks, memory.offload, memory.schedule,
                              on_event=self._offload_event,
                              say=lambda name, message, fields: self.events.event(name, message, **fields))

    def _offload_event(self, name: str, message: str, **fields: Any) -> None:
        """Moves differ per rank (each reads its own device): every rank logs its own line, and
        the writing rank records its own as the event."""
        line = f" [rank {dist.get_rank()}] iteration {self.iteration}: {name}:{message}"
        if self.events.is_writer:
            self.events.event(name, line, iteration=self.iteration, **fields)
        else:
            log.info(line)

    def step(self, iteration: int, attempt: Callable[[Fault | None], T]) -> T:
        """Run ``attempt(fault)`` (forward, backward and the optimizer step of ``iteration``)
        until no rank drops it, and return its result. ``fault`` is this rank's injected
        ``nan`` fault, to poison the loss with, or None. A dropped attempt is a progress
        alignment: the groups are rebuilt by then, and ``attempt`` runs again on the same data.
        A vote that ran out, or groups that could not be rebuilt, end the rank for a restart."""
        self.iteration = iteration
        if not self._watched:  # Megatron-LM sets the finalize function only as its loop starts
            self.resilience.watch_grad_sync(get_model_config(self.model_chunks[0]), lambda: self.iteration)
            self._watched = True
        while True:
            if self.elastic is not None:
                self._quorum()
            fault = self.resilience.begin(iteration)
            with self.resilience.bounded():
                result = attempt(fault)
            take_verdict = getattr(self.optimizer, "take_verdict", None)  # without --use-higgs: no decision
            if not self.resilience.realigned(iteration, take_verdict() if take_verdict else None,
                                             getattr(self.optimizer, "regroup_seconds", 0.0)):
                return result

    def _quorum(self) -> None:
        """Elastic replicas: the step's quorum, a heal said (event ``replica_healed``), and a
        change of membership (event ``replicas_changed``)."""
        elastic, before = self.elastic, self.elastic.participants
        healed = elastic.begin()
        if healed is not None:
            self.events.event("replica_healed", f" replica {elastic.replica} healed from a live peer: step "
                              f"{healed['from_step']} -> {healed['to_step']}, {healed['bytes'] / 1e6:.2f} MB received "
                              f"and loaded in {healed['quorum_seconds']:.2f}s; its own error-feedback residuals "
                              f"dropped (L2 norm {healed['residual_dropped']:.4g})", replica=elastic.replica, **healed)
        if elastic.participants != before:
            total = elastic.config.higgs_replicas
            self.events.event("replicas_changed", f" replicas in the quorum: {elastic.participants} of {total}, "
                              f"formed in {elastic.quorum_seconds:.2f}s"
                              + (f"; the samples of {total - elastic.participants} replica(s) are skipped at each "
                                 "step while they are out" if elastic.participants < total else ""),
                              iteration=self.iteration, participants=elastic.participants, replicas=total,
                              quorum_seconds=elastic.quorum_seconds)

    @property
    def alignments(self) -> int:
        """Progress alignments so far."""
        return self.resilience.alignments.count

    def checkpoint_phase(self, iteration: int) -> None:
        """A save starts: the watchdog lets a long write be, and offloaded optimizer state comes
        back for the save to read (``saved`` sends it away again)."""
        self.resilience.phase(iteration, "checkpoint")
        if self.memory is not None:
            self.memory.bring_all()

    def saved(self) -> None:
        """A save has what it needs of the state (an async save its host copy): the wall clock
        restarts, and offloaded state leaves again now, not at the end of the next step."""
        self.saves.saved()
        if self.memory is not None:
            self.memory.settle()

    def close(self, iteration: int | None = None) -> None:
        """Offloaded state back (the nvme tier's files removed), the watchdog stopped, every
        rank's phase ``done`` at ``iteration`` (default: the last ``step`` ran)."""
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        self.resilience.close(self.iteration if iteration is None else iteration)
        for handler in logging.getLogger().handlers:
            handler.flush()


def attach(model_chunks: list, optimizer: Any, config: RunConfig, events: MetricsLogger,
           elastic: ElasticReplicas | None = None) -> Runtime:
    """Wire the runtime of one run around Megatron's ``model_chunks`` and ``optimizer``; the
    optimizer the front-end must step is ``Runtime.optimizer``. ``elastic``: this replica's
    side of elastic replicas (``--higgs-replicas``), which the front-end made before its model
    (the model's sync runs on its group)."""
    return Runtime(config, model_chunks, optimizer, events, elastic)
