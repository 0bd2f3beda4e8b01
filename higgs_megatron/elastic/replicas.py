"""Elastic data-parallel replicas: torchft's quorum, healing and commit under our step.

The job is R replicas (``--higgs-replicas``), each one torchrun of TP x PP ranks with
data-parallel size 1 inside, and one torchft Lighthouse. Per attempt of an iteration
(``Runtime.step``):

1. ``begin``: torchft's quorum (``Manager.start_quorum``, synchronous). Replicas whose
   heartbeats stopped are left out; a replica behind the newest step (restarted, or woken
   from a stop) receives the whole training state from a live peer here, before its forward
   pass (``heal_state``/``load_healed``), and takes part in this step. The gradients are then
   scaled by 1 / (replicas in the quorum), so that the sum across them is their mean: each
   step averages over the replicas that take part.
2. Forward, backward, and the gradient sync across the quorum on torchft's group (every
   bucket, ``ddp.HiggsDDP`` with ``replicas``); a lost peer or a collective past its timeout
   gives the sync up (``reduce.wire.StepWaits.across_replicas``) instead of ending the rank.
3. ``ReplicaCommit.decide``: the replica's own ranks agree first (``StepDecision``), then the
   replicas exchange two flags (non-finite gradients, a given-up sync), then torchft's
   ``should_commit``. A step given up anywhere is not committed, and the iteration runs again
   with the next quorum (nothing rolled back); non-finite gradients anywhere skip the step on
   every replica, as without replicas.

What a replica misses while it is out is skipped, not re-queued: the global batch's share of
a missing replica (its ``--micro-batch-size`` x micro-batches) is not trained on, and each
step logs its participants, its global batch and the samples skipped. A healed replica
starts with zero error-feedback residuals: a residual is gradient mass its replica has not
sent yet, and a copy of the peer's would be sent twice. The peer's density schedule position
comes with the state, so every replica's step has the same form.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values

from ..checkpoint.manifest import committed_checkpoints
from ..checkpoint.state import restore_rng_state, rng_state
from ..logs import get_logger
from ..stability.alignment import StepDecision, Verdict
from ..stability.progress import job_store
from .collectives import ReplicaCollectives, ReplicaGroup
from .flags import ElasticConfig

log = get_logger(__name__)

START_WAIT = 120.0  # seconds a fresh job's first step waits for every replica
REPLICA_PREFIX = "replica_"  # torchft reads a replica's index from the trailing digits of its id


def tensor_bytes(state: dict) -> int:
    """Bytes of the tensors in a nested state (what a heal moves)."""
    return sum(value.numel() * value.element_size() for value in nested_values(state)
               if isinstance(value, torch.Tensor))


def _replica_store(timeout: timedelta) -> tuple[str, int, dist.TCPStore | None]:
    """A store for this replica's torchft Manager, new in each attempt of the torchrun: rank 0
    serves it (the server it returns must live as long as the Manager) and publishes its
    address under the attempt's key (torchrun's own store keeps the keys of earlier attempts,
    whose Manager address another rank could read first)."""
    key = f"higgs/elastic/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/store"
    store, server = job_store(""), None
    if dist.get_rank() == 0:
        server = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False, timeout=timeout)
        store.set(key, f"{socket.gethostname()}:{server.port}")
    store.wait([key], timeout)
    host, port = store.get(key).decode().rsplit(":", 1)
    return host, int(port), server


class ElasticReplicas:
    """This rank's side of the elastic replicas (see the module docstring)."""

    def __init__(self, config: ElasticConfig, backend: str, step_timeout: float | None) -> None:
        # torchft logs a line per quorum and per commit, from its servers and from Python: warnings only
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.WARNING)

        self.config = config
        self.timeout = timedelta(seconds=step_timeout or 60.0)
        group = ProcessGroupNCCL(timeout=self.timeout) if backend == "nccl" else ProcessGroupGloo(timeout=self.timeout)
        self.replica_group = ReplicaGroup(group, config.higgs_replicas, config.higgs_replica_id)
        self.manager = None
        self.participants = config.higgs_replicas
        self.quorum_seconds = 0.0  # the last quorum's, with its rebuild of the group and any heal
        self.healed: dict | None = None  # the last heal (step, seconds, bytes), until ``begin`` reports it
        self._scaled: list[tuple[Any, float]] = []
        self._fresh = self._fresh_scaling = True  # before the first quorum
        self._chunks: list = []
        self._save_state: Callable[[], dict] | None = None
        self._load_state: Callable[[dict], float] | None = None
        self._store_server: dist.TCPStore | None = None

    @property
    def replica(self) -> int:
        return self.config.higgs_replica_id

    def start(self, model_chunks: list, state: Callable[[], dict], load_state: Callable[[dict], float],
              step: int) -> None:
        """Join the Lighthouse at ``step`` (the iteration this replica resumes from: 0, or its
        checkpoint's). ``state``/``load_state``: the front-end's training state, sent to and
        received from a peer when one heals (``load_state`` returns the L2 norm of the
        error-feedback residuals it dropped)."""
        from torchft import Manager

        self._save_state, self._load_state = state, load_state
        self._chunks = model_chunks
        self._scaled = [(bucket, bucket.gradient_scaling_factor) for chunk in model_chunks
                        for group in chunk.higgs_bucket_groups for bucket in group.buckets]
        host, port, self._store_server = _replica_store(self.timeout)
        self.manager = Manager(
            pg=self.replica_group.group, load_state_dict=self._heal, state_dict=self._heal_state,
            min_replica_size=self.config.higgs_min_replicas, use_async_quorum=False, timeout=self.timeout,
            quorum_timeout=max(self.timeout, timedelta(seconds=60)), rank=dist.get_rank(),
            world_size=dist.get_world_size(), store_addr=host, store_port=port,
            lighthouse_addr=self.config.lighthouse, replica_id=f"{REPLICA_PREFIX}{self.replica}",
            init_sync=False)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def _drain(self) -> None:
        """The collectives a given-up sync left behind, ended before this attempt's backward
        writes the buffers they reduce in place: a step not committed anywhere makes torchft's
        next quorum a new one, which aborts the group they ran on, so each ends at once (its
        error is the old group's, and ignored). Bounded by the step timeout all the same."""
        for chunk in self._chunks:
            for work in chunk.take_abandoned_works():
                try:
                    work.wait(self.timeout)
                except RuntimeError:
                    pass

    def _wait_for_all(self) -> None:
        """A fresh job (every replica in the quorum at step 0) waits up to ``START_WAIT`` for
        every replica, rather than train alone while the others start: each try is a quorum
        and an empty, uncommitted step on every replica in it, all at their first step."""
        manager, deadline = self.manager, time.monotonic() + START_WAIT
        while (manager.current_step() == 0 and manager.num_participants() < self.config.higgs_replicas
               and time.monotonic() < deadline):
            manager.report_error(RuntimeError("waiting for every replica to start"))
            manager.should_commit()
            time.sleep(0.2)
            manager.start_quorum()
        self._fresh = False

    def _heal_state(self) -> dict:
        """What a peer that heals receives: the front-end's state and this rank's RNG."""
        return {"training": self._save_state(), "rng": rng_state()}

    def _heal(self, state: dict) -> None:
        started = time.perf_counter()
        dropped = self._load_state(state["training"])
        restore_rng_state(state["rng"])
        self.healed = {"bytes": tensor_bytes(state), "seconds": time.perf_counter() - started,
                       "residual_dropped": dropped}

    def begin(self) -> dict | None:
        """The step's quorum (a heal, if this replica is behind); the gradients scaled to the
        quorum's mean. Returns the heal's record when this replica healed, else None."""
        started = time.perf_counter()
        step = self.manager.current_step()
        self.manager.start_quorum()
        self._drain()
        if self._fresh:
            self._wait_for_all()
        participants = self.manager.num_participants()
        if participants != self.participants or self._fresh_scaling:  # set again only when the quorum's size changes
            for bucket, factor in self._scaled:
                bucket.gradient_scaling_factor = factor / participants
            self._fresh_scaling = False
        self.participants = participants
        self.quorum_seconds = time.perf_counter() - started
        healed, self.healed = self.healed, None
        if healed is not None:
            healed.update(from_step=step, to_step=self.manager.current_step(), quorum_seconds=self.quorum_seconds)
        return healed

    def saves(self, save_dir: str, iteration: int) -> bool:
        """Whether this replica writes the job's checkpoint of ``iteration``: the first in the
        quorum, unless ``save_dir`` already holds one as new (a replica that lags the job, as
        one that woke after the others ended alone in its quorum, never replaces the job's
        newer checkpoints). The replicas hold the same state, so one copy is the job's; it
        goes to the one --save directory, and every replica resumes from it. Rank 0 of the
        replica decides for its ranks (the save is collective among them)."""
        if self.manager.participating_rank() != 0:
            return False
        newest = [max(committed_checkpoints(Path(save_dir)), default=0) if dist.get_rank() == 0 else 0]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(newest, src=0)
        if newest[0] >= iteration:
            log.warning(f" replica {self.replica}: not saving iteration {iteration}: {save_dir} already holds "
                        f"iteration {newest[0]} (this replica is behind the job)")
            return False
        return True

    def check_identical(self, model_chunks: list) -> bool | None:
        """Whether every replica in the quorum holds bitwise the same parameters (each rank
        against the same rank of the others: a hash of its parameters' bytes, all-gathered);
        None when there is nothing to compare (a quorum of one) or the exchange failed (a
        replica lost). A host read: only every ``--check-weight-hash-across-dp-replicas-interval``
        iterations."""
        if self.participants < 2:
            return None
        digest = hashlib.sha256()
        device = None
        for chunk in model_chunks:
            for param in chunk.parameters():
                device = param.device
                digest.update(param.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        mine = torch.tensor([int.from_bytes(digest.digest()[:8], "little", signed=True)], dtype=torch.int64,
                            device=device)
        gathered = torch.zeros(self.participants, dtype=torch.int64, device=device)
        try:
            ReplicaCollectives().all_gather(gathered, mine, self.replica_group.group)
        except RuntimeError as error:
            log.warning(f" replica {self.replica}: weight check across replicas skipped: {error}")
            return None
        return bool((gathered == mine).all())

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


class ReplicaCommit:
    """The step's one decision across replicas (see the module docstring, step 3): drop-in for
    ``StepDecision`` in ``HiggsOptimizer``. ``vote`` is the replica's own store vote, if any."""

    rebuilds_groups = False  # a quorum rebuilds torchft's group; Megatron's groups inside are fine

    def __init__(self, replicas: ElasticReplicas, inside: StepDecision) -> None:
        self.replicas, self.inside = replicas, inside
        self.vote = inside.vote

    def decide(self, nonfinite: torch.Tensor | None, sync_failure: str | None, device: torch.device) -> Verdict:
        verdict = self.inside.decide(nonfinite, sync_failure, device)
        manager, group = self.replicas.manager, self.replicas.replica_group.group
        flags = torch.tensor([float(not verdict.keep and not verdict.sync_failed), float(verdict.sync_failed)],
                             device=device)
        cause = verdict.cause if verdict.sync_failed else None
        try:  # every replica issues it, whatever its sync did, so that none waits for a missing one
            ReplicaCollectives().all_reduce(flags, group, op=dist.ReduceOp.MAX)
        except RuntimeError as error:
            cause = cause or f"replica {self.replicas.replica}: the step's flags: {str(error).splitlines()[0][:200]}"
            flags[1] = 1.0
        nonfinite_anywhere, failed_anywhere = flags.tolist()
        if failed_anywhere:
            cause = cause or "another replica gave its gradient sync up"
            manager.report_error(RuntimeError(cause))
        if not manager.should_commit():
            return Verdict({-1: cause or f"replica {self.replicas.replica}: not committed (quorum below "
                                         f"--higgs-min-replicas, or an error)"}, sync_failed=True)
        if nonfinite_anywhere:
            return Verdict({-1: verdict.cause or "some replica: non-finite gradients"})
        return Verdict({})
