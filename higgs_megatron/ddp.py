"""HiggsDDP: Megatron's DistributedDataParallel with a compressed data-parallel gradient sync.

Where it plugs in. Megatron's DDP keeps gradients in flat buckets, grouped into
``_ParamAndGradBucketGroup``s. On the last micro-batch, a backward hook marks each param
ready; when a group is complete, ``start_grad_sync`` launches its collective (while the
rest of backward runs), and ``finalize_model_grads`` later calls ``finish_grad_sync``.
``HiggsDDP`` builds everything exactly as Megatron does, then changes the class of each
bucket group to ``HiggsBucketGroup``, which overrides ``start_grad_sync`` (and, with several
optimizer instances only, ``finish_grad_sync``; otherwise that is Megatron's: it waits on the
handle we leave, whose ``wait`` also decompresses). Object identity, the optimizer's view of the buffers and
``isinstance(model, DistributedDataParallel)`` are untouched.

Per bucket group, per step (once, on the accumulated gradient, never per micro-batch):

1. Megatron's scaling (``gradient_scaling_factor``) and NaN checks, as before.
2. For each bucket, a path object (``grad_paths``) that launches its own collectives:
   *dense* (Megatron's own all-reduce, or reduce-scatter with the distributed optimizer; with
   ``--higgs-dense-bf16``, a compressed bucket's dense steps reduce a bf16 copy), *sparse*,
   *agreed*, *sharded* or *hierarchical*; with ``--higgs-dense-int8`` a compressed bucket's
   dense steps go through its form at density 1. ``grad_paths.BucketPaths.step_path`` picks it;
   under ``sync="auto"`` from the path ``cost_model`` predicts fastest, with costs measured at
   construction (``reduce.link_probe``) and agreed by all DP ranks. The path depends only on
   the config, those agreed costs, the bucket and the step's density (``grad_paths.DensitySchedule``),
   so every DP peer issues the same collectives in the same order with the same sizes.
3. With error feedback, ``acc = grad + residual`` on both paths; the residual left for the
   next step is staged, and settled by the next sync as it adds the residual in: committed if
   the optimizer took the step since (``HiggsOptimizer`` counts them on a ``StepLedger``),
   dropped if not, and dropped at once when every rank skips it (``rollback_residuals``). So a
   sync run again within one iteration (Megatron-LM's rerun state machine) starts from the
   same residual and counts one step. Without ``HiggsOptimizer``, each sync keeps the one
   before it.
4. The collectives are asynchronous when ``overlap_grad_reduce`` is on; the handle's
   ``wait`` finishes them and writes the summed gradient into the bucket.

Stream order (CUDA). ``start_grad_sync`` runs in Megatron's backward hook on the current
stream: the scaling, the non-finite flag, error feedback and the selection are queued there,
and the collective is launched with ``async_op`` right after; NCCL's stream waits for the
current stream at launch, so it reads the finished payload. ``finish_grad_sync`` waits on the
handle: ``work.wait()`` makes the current stream wait for the collective's end (the host goes
on), and the decompression is queued after it, so the optimizer, which runs after
``finish_grad_sync`` on the same stream, reads reduced gradients. No side stream is ours (with
several optimizer instances all of it runs on Megatron's communication stream instead, which
``finish_grad_sync`` joins back to the current stream), and
nothing between ``start_grad_sync`` and ``finish_grad_sync`` reads a device value on the host
(``host_sync`` counts such reads in the tests); the non-finite flag is read once, by the
optimizer wrapper's decision.

Invariants kept: without the distributed optimizer every ``main_grad`` holds the DP-reduced
gradient, identical on all DP ranks; with it at least this rank's shard does (the sparse
path reduces the whole bucket). Each parameter is selected on its own, which keeps TP-replicated
params identical across TP ranks (``compress.compressor``).

Mixture of experts. Megatron keeps the experts' parameters (``allreduce=False``) in buckets of
their own, ``expert_parallel_bucket_groups``, reduced over the expert-data-parallel group and
pre-scaled by Megatron (``gradient_scaling_factor``) so that the result is the same average.
They are compressed too, as a second ``_Domain``: their own group, selector (seeded by the rank
in that group, apart from the dense one's), node groups, link costs and averaging; their bucket
groups are numbered after the dense ones, so their residuals have names of their own. The
routers' expert bias, which Megatron moves after the sync, moves once per step the optimizer
takes (``expert_bias``). Several optimizer instances with experts are refused.

Several distributed-optimizer instances (``num_distributed_optimizer_instances``, Megatron's
hierarchical data parallelism) keep Megatron's protocol: the reduce-scatter inside each
instance stays dense, and the shard's all-reduce across the instances is what compresses (the
hierarchical form, its levels the instances; error feedback on this rank's shard), all on
Megatron's communication stream.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, shard_buffer

from .compat.buckets import GRAPH_REPLAY_EVENT, WAITS_FOR_GRAPH_REPLAYS
from .compress.agreed import AgreedPlan, ScoreBuffer
from .compress.compressor import BucketPlan, ParamSlot, ResidualBuffer, Selector, make_selector
from .config import HiggsConfig
from .cost_model import LinkCosts
from .device import DeviceTimer, collective_device
from .elastic.collectives import ReplicaCollectives, ReplicaGroup
from .expert_bias import KeptExpertBias
from .first_moment import FirstMoments
from .grad_paths import AgreedForm, DensitySchedule, StepLaunch
from .reduce.cast_reduce import PendingCastReduce
from .reduce.link_probe import measure_link_costs
from .reduce.param_gather import (ParamChanges, change_row_bytes, keep_agreed, own_shard, param_gather_wire,
                                  start_param_changes)
from .reduce.sparse_allreduce import PendingHierarchical, PendingSparseReduce, reduce_scatter
from .reduce.wire import Collectives, StepWaits, dense_wire_bytes, wire_bytes
from .sync_plan import NodeShape, choose_form, plan_bucket
from .topology import NodeGroups, build_node_groups, instance_groups


def dense_bytes_per_step(model: DistributedDataParallel) -> int:
    """Bytes Megatron's dense reduction hands to collectives per step: every gradient bucket."""
    return sum(bucket.grad_data.numel() * bucket.grad_data.element_size()
               for group in model.bucket_groups + model.expert_parallel_bucket_groups for bucket in group.buckets)


def megatron_dense_wire(group: _ParamAndGradBucketGroup, bucket, world: int | None = None) -> float:
    """Ring wire bytes per rank of Megatron's own data-parallel traffic for ``bucket``, one of
    ``group``'s: its gradient's reduction (``reduce.wire.dense_wire_bytes``) and, with the
    distributed optimizer, its parameters' all-gather, over the group Megatron runs them on, or
    over ``world`` ranks where given (elastic replicas, whose group is torchft's)."""
    distopt = group.ddp_config.use_distributed_optimizer
    if world is None:
        world = group.intra_distributed_optimizer_instance_size if distopt else group.data_parallel_group.size()
    grad = bucket.grad_data
    wire = dense_wire_bytes(grad.numel() * grad.element_size(), world, distopt,
                            group.ddp_config.num_distributed_optimizer_instances)
    if distopt and bucket.param_data is not None:
        wire += param_gather_wire(bucket.param_data.numel() * bucket.param_data.element_size(), world)
    return wire


def dense_wire_per_step(model: DistributedDataParallel) -> float:
    """Ring wire bytes per rank of Megatron's dense data-parallel traffic per step: every bucket."""
    return sum(megatron_dense_wire(group, bucket)
               for group in model.bucket_groups + model.expert_parallel_bucket_groups for bucket in group.buckets)


def sync_traffic(model_chunks: list) -> "SyncStats":
    """This step's gradient traffic over ``model_chunks`` (call once per step): HiggsDDP's own
    counts (``take_stats``), Megatron's whole dense buckets for a plain DDP chunk. Both
    front-ends report these."""
    total = SyncStats()
    for chunk in model_chunks:
        if isinstance(chunk, HiggsDDP):
            total.add(chunk.take_stats())
        else:
            dense, wire = dense_bytes_per_step(chunk), dense_wire_per_step(chunk)
            total.add(SyncStats(bytes_sent=dense, dense_bytes=dense, wire_bytes=wire, dense_wire_bytes=wire,
                                dense_buckets=len(chunk.bucket_groups)))
    return total


class HiggsConfigurationError(ValueError):
    """A model or DDP setting that the compressed sync does not support."""


# DDP options whose reduction is Megatron's own, which HiggsBucketGroup replaces: refused, never
# ignored. Field -> Megatron-LM's flag. (The second is megatron-core 0.19's.)
UNSUPPORTED_DDP_OPTIONS = {
    "reduce_scatter_with_fp32_accumulation": "--ddp-reduce-scatter-with-fp32-accumulation",
    "param_name_patterns_for_fp32_local_accumulation": "--ddp-param-name-patterns-for-fp32-local-accumulation",
}


@dataclass
class SyncStats:
    """Totals since the last ``HiggsDDP.take_stats()``. ``bytes_sent``/``dense_bytes``: bytes this
    rank handed to collectives, and what Megatron's dense reduction hands them; ``wire_bytes``/
    ``dense_wire_bytes``: what a ring puts on this rank's link for each (``reduce.wire``), the
    figure that holds at scale."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    wire_bytes: float = 0.0
    dense_wire_bytes: float = 0.0
    compress_seconds: float = 0.0
    sparse_buckets: int = 0
    dense_buckets: int = 0
    density: float = 1.0  # the last chunk's: every chunk of a model follows one schedule

    def add(self, other: "SyncStats") -> None:
        self.bytes_sent += other.bytes_sent
        self.dense_bytes += other.dense_bytes
        self.wire_bytes += other.wire_bytes
        self.dense_wire_bytes += other.dense_wire_bytes
        self.compress_seconds += other.compress_seconds
        self.sparse_buckets += other.sparse_buckets
        self.dense_buckets += other.dense_buckets
        self.density = other.density


_SELECTOR_SEED_STRIDE = 1 << 16  # apart from the dense domain's selector seeds (ranks), the experts'


@dataclass
class StepLedger:
    """The optimizer steps taken (updates applied), counted by the optimizer that wraps the
    chunk: a plain counter it bumps without calling in here, read by each bucket group as its
    next sync starts (``HiggsBucketGroup._last_step_kept``)."""

    taken: int = 0


@dataclass
class _Domain:
    """What differs between a chunk's two reductions: its dense parameters' over the
    data-parallel group, and its experts' (``allreduce=False``, in Megatron's
    ``expert_parallel_bucket_groups``) over the expert-data-parallel group. Each has its own
    selector (seeded apart), node groups, link costs and averaging."""

    selector: Selector | None
    nodes: NodeGroups | None = None  # with sync="auto" or "hierarchical", or several optimizer instances
    costs: LinkCosts | None = None  # with sync="auto"
    average_over: int = 1  # the group's size (x the instances), for average_in_collective on the summing paths
    sync_report: list[dict] = field(default_factory=list)  # with sync="auto": each bucket's choice


@dataclass
class _Shared:
    """State shared by all bucket groups of one HiggsDDP, of both domains."""

    config: HiggsConfig
    schedule: DensitySchedule  # the config's: the density of each step
    stats: SyncStats = field(default_factory=SyncStats)
    trace: list[tuple[str, int]] | None = None
    check_nonfinite: bool = False
    ledger: StepLedger | None = None  # with HiggsOptimizer: the steps it took (``HiggsDDP.step_ledger``)
    compress_timer: DeviceTimer = field(default_factory=DeviceTimer)
    waits: StepWaits = field(default_factory=StepWaits)  # how the step's collectives are waited for (bounded or not)
    instances: int = 1  # Megatron's num_distributed_optimizer_instances
    comm: Collectives = field(default_factory=Collectives)  # every collective of the sync, counted
    replicas: ReplicaGroup | None = None  # elastic replicas: the sync runs across them, on torchft's group
    first_moment_exchange: bool = False  # config.first_moment_exchange, read once (the hook enters no config code)
    first_moments: FirstMoments | None = None  # sync 'onebit': Adam's first moments (``set_first_moments``)

    def take_stats(self) -> "SyncStats":
        """The counts since the last call, with the compression time the device has finished
        and the wire bytes the meter counted; they start again from zero."""
        stats, self.stats = self.stats, SyncStats(density=self.stats.density)
        stats.compress_seconds = self.compress_timer.seconds()
        stats.wire_bytes = self.comm.meter.take().wire
        return stats


class _GroupHandle:
    """What ``grad_reduce_handle`` holds: dense works and the other paths' exchanges in flight.

    ``wait`` waits for them through the step's ``reduce.wire.StepWaits`` (what a wait costs,
    and what a bounded one that runs out does, is said there) and writes each bucket's sum.
    A given-up step's exchanges still issue every collective the other ranks will, and read
    nothing; the step's decision then drops the step on every rank, which rebuild the
    data-parallel groups (``stability.regroup``)."""

    def __init__(self, dense_works: list[Any],
                 sparse: list[PendingSparseReduce | PendingHierarchical | PendingCastReduce], average_over: int,
                 on_done, waits: StepWaits) -> None:
        self.dense_works = dense_works
        self.sparse = sparse
        self.average_over = average_over
        self.on_done = on_done
        self.waits = waits

    def prepare(self) -> None:
        """Start each exchange's last collective, where it has one (``PendingAgreed.prepare``)."""
        for pending in self.sparse:
            if hasattr(pending, "prepare"):
                pending.prepare(self.waits)

    def wait(self) -> None:
        for work in self.dense_works:
            if work is not None:
                self.waits.wait(work)
        for pending in self.sparse:
            pending.finish(self.waits)
            if self.average_over > 1 and not self.waits.abandoned:
                pending.target.div_(self.average_over)
        self.dense_works, self.sparse = [], []
        self.on_done()


def slot_in_bucket(param: torch.nn.Parameter, grad_data: torch.Tensor) -> ParamSlot:
    """Where ``param.main_grad`` sits in its bucket. Not ``bucket.param_to_index``: that
    counts params end to end, while the buffer pads each param's start for the distributed
    optimizer; the view's storage offset is the truth."""
    start = param.main_grad.storage_offset() - grad_data.storage_offset()
    assert 0 <= start and start + param.numel() <= grad_data.numel(), "main_grad is not a view into its bucket"
    return ParamSlot(start, start + param.numel())


def _replicated_across_tp(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is held whole, the same, by every rank of a tensor-parallel group of
    several (layer norms, a row-parallel layer's bias): an expert's over the experts' group.
    Megatron marks the parameters it shards ``tensor_model_parallel``."""
    if getattr(param, "tensor_model_parallel", False):
        return False
    expert = not getattr(param, "allreduce", True)
    size = (parallel_state.get_expert_tensor_parallel_world_size() if expert
            else parallel_state.get_tensor_model_parallel_world_size())
    return size > 1


class HiggsBucketGroup(_ParamAndGradBucketGroup):
    """A Megatron bucket group whose grad sync goes through the compressed path."""

    higgs: _Shared
    higgs_domain: _Domain
    higgs_index: int
    higgs_plans: list[BucketPlan | None]
    higgs_residuals: list[ResidualBuffer | None]
    higgs_owner_residuals: list[ResidualBuffer | None]
    higgs_steps: int  # the steps settled as kept: what the density schedule counts
    higgs_pending: int | None  # a sync ran whose step is not settled yet: the ledger's count then (0 without one)
    higgs_nonfinite: torch.Tensor | None

    def _higgs_attach(self, shared: _Shared, domain: _Domain, index: int) -> None:
        self.higgs = shared
        self.higgs_domain = domain
        self.higgs_index = index
        self.higgs_steps = 0
        self.higgs_pending = None
        self.higgs_nonfinite: torch.Tensor | None = None
        nodes = domain.nodes
        shape = None if nodes is None else NodeShape(nodes.nodes, nodes.ranks_per_node, nodes.local_index,
                                                     instances=nodes.instances)
        self.higgs_buckets = [
            plan_bucket(f"group{index}.bucket{idx}", bucket.grad_data.numel(), bucket.grad_data.dtype,
                        [replace(slot_in_bucket(param, bucket.grad_data), whole=_replicated_across_tp(param))
                         for param in bucket.params_list], shared.config,
                        shape, bucket.grad_data.device, world=self._plan_world,
                        distributed_optimizer=self.ddp_config.use_distributed_optimizer)
            for idx, bucket in enumerate(self.buckets)]
        self.higgs_residuals: list[ResidualBuffer | None] = []
        # What Megatron's dense reduction of these buckets hands to collectives and puts on the wire, per step.
        self.higgs_dense_traffic = (sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buckets),
                                    sum(megatron_dense_wire(self, b, self._plan_world) for b in self.buckets))
        self.higgs_param_changes: ParamChanges | None = None  # the parameter all-gather as changes

    def _higgs_make_residuals(self) -> None:
        """Once the forms are final: a residual per compressed bucket, the size of its plan."""
        self.higgs_residuals = [
            ResidualBuffer(paths.plan.numel, bucket.grad_data.dtype, bucket.grad_data.device)
            if paths.plan is not None and self.higgs.config.error_feedback else None
            for paths, bucket in zip(self.higgs_buckets, self.buckets)]
        self.higgs_scores = [ScoreBuffer(paths.plan.n_blocks, bucket.grad_data.device)
                             if isinstance(paths.plan, AgreedPlan) else None
                             for paths, bucket in zip(self.higgs_buckets, self.buckets)]
        # the agreed form's owners, where they round their sums for the all-gather (with the distributed
        # optimizer only 1-bit Adam's moments are gathered back)
        gathers = not self.ddp_config.use_distributed_optimizer or self.higgs.first_moment_exchange
        self.higgs_owner_residuals = [
            ResidualBuffer(paths.plan.shard + 1, torch.float32, bucket.grad_data.device)  # + where padding writes
            if isinstance(paths.plan, AgreedPlan) and self.higgs.config.error_feedback and gathers else None
            for paths, bucket in zip(self.higgs_buckets, self.buckets)]
        self.higgs_held: list[int] = []  # sharded onebit: the buckets whose synced moment this step keeps

    @property
    def higgs_plans(self) -> list[BucketPlan | None]:
        return [paths.plan for paths in self.higgs_buckets]

    def _last_step_kept(self) -> bool:
        """Whether the optimizer took the step of the last sync: then what it staged (residuals,
        agreed block scores) is the state and the step counts; else the same iteration is
        syncing again (Megatron-LM's rerun state machine) or the update was skipped, and this
        sync starts from the state before. Without a ledger, each sync follows a kept step."""
        ledger = self.higgs.ledger
        return self.higgs_pending is None or ledger is None or ledger.taken > self.higgs_pending

    def next_step(self, kept: bool | None = None) -> int:
        """The step the next sync runs (what the density schedule is read at): the steps
        counted, and the last sync's if the optimizer took it (``kept``, when already known)."""
        kept = self._last_step_kept() if kept is None else kept
        return self.higgs_steps + int(self.higgs_pending is not None and kept)

    def _rollback(self) -> None:
        """Drop what the last sync staged (every rank skipped its step)."""
        for buffer in (*self.higgs_residuals, *self.higgs_owner_residuals, *self.higgs_scores):
            if buffer is not None:
                buffer.rollback()
        if self.higgs.first_moments is not None:
            self.higgs.first_moments.release()  # a dropped step's sums (a NaN's among them) are no moment
        self.higgs_pending = None

    @property
    def _plan_world(self) -> int:
        """The ranks the plans are made for: the communication group's, or with elastic
        replicas every replica (the plans, and so every step's forms, stay the same whoever is
        in the quorum; the all-gather's size follows the quorum at each step)."""
        replicas = self.higgs.replicas
        return replicas.size if replicas is not None else self._communication_group.size()

    @property
    def _communication_group(self) -> dist.ProcessGroup:
        if self.higgs.replicas is not None:
            return self.higgs.replicas.group
        if self.ddp_config.use_distributed_optimizer:
            return self.intra_distributed_optimizer_instance_group
        return self.data_parallel_group

    def _instance_stream(self) -> contextlib.AbstractContextManager:
        """With several optimizer instances on CUDA, Megatron's protocol runs the sync on its
        communication stream (after the compute stream's work so far): the cross-instance
        collective waits there for the reduce-scatter inside the instance, never on the compute
        stream. A no-op otherwise."""
        stream = self._instance_comm_stream
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(stream)

    @property
    def _instance_comm_stream(self):
        """Megatron's communication stream, with several instances on CUDA; else None."""
        stream = getattr(self, "communication_stream", None)
        if self.higgs.instances == 1 or stream is None or not self.buckets[0].grad_data.is_cuda:
            return None
        return stream

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if self.higgs.instances == 1:
            super().finish_grad_sync(force_all_reduce)
            return
        # Megatron's returns at once for several instances (its collectives are synchronous on
        # the communication stream); ours leave a handle, whose wait also decompresses.
        self.param_gather_dispatched = False
        if self.ddp_config.overlap_grad_reduce and getattr(self, "grad_reduce_finished", False):
            return  # megatron-core 0.19: a second call in an iteration is a no-op
        if not self.ddp_config.overlap_grad_reduce or self.is_first_batch:
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        if self.grad_reduce_handle is not None:
            with self._instance_stream():
                self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        if self._instance_comm_stream is not None:
            torch.cuda.current_stream().wait_stream(self._instance_comm_stream)
        if hasattr(self, "grad_reduce_finished"):  # megatron-core 0.19's flag (its reset() clears it)
            self.grad_reduce_finished = True

    def start_param_sync(self, force_sync: bool = False) -> None:
        """The distributed optimizer's parameter all-gather, counted by the sync's meter:
        Megatron's own, or each shard's change from what every rank holds
        (``reduce.param_gather``) once the optimizer wrapper gave the main parameters a copy of
        their own and the last gather told every rank's shard."""
        changes, group = self.higgs_param_changes, self.intra_distributed_optimizer_instance_group
        if not self.ddp_config.use_distributed_optimizer or (force_sync and self.param_gather_handle is not None):
            super().start_param_sync(force_sync)  # megatron-core 0.19's layer-wise path; or the wait for one in flight
            return
        world, rank = self.intra_distributed_optimizer_instance_size, self.intra_distributed_optimizer_instance_rank
        buffers = [bucket.param_data for bucket in self.buckets]
        if changes is None or force_sync or not changes.ready:
            for buffer in buffers:
                self.higgs.comm.meter.count("all_gather", own_shard(buffer, world, rank).numel()
                                            * buffer.element_size(), world)
            if changes is not None:
                keep_agreed(changes, buffers, world, rank)
            super().start_param_sync(force_sync)
            return
        assert self.param_gather_handle is None
        async_op = self.ddp_config.overlap_param_gather
        with torch.no_grad():
            handle = start_param_changes(self.higgs.comm, group, buffers, changes, async_op)
        if async_op:
            self.param_gather_handle = handle
        else:
            handle.wait()
            self.param_gather_handle = None
        self.param_gather_dispatched = True

    def param_gather_wire(self) -> float:
        """Ring wire bytes per rank of the next ``start_param_sync`` (what the meter will count)."""
        if not self.ddp_config.use_distributed_optimizer:
            return 0.0
        world, changes = self.intra_distributed_optimizer_instance_size, self.higgs_param_changes
        if changes is not None and changes.ready:
            return sum(wire_bytes("all_gather", change_row_bytes(b.param_data.numel() // world, changes.payload), world)
                       for b in self.buckets)
        return sum(param_gather_wire(b.param_data.numel() * b.param_data.element_size(), world) for b in self.buckets)

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        with self._instance_stream(), torch.no_grad():  # it changes gradient buffers: nothing for autograd
            self._start_grad_sync(force_all_reduce)

    def _start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # Megatron's first-batch re-entry: already launched
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if WAITS_FOR_GRAPH_REPLAYS:
            self._wait_for_graph_replays()
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                             check_for_large=self.ddp_config.check_for_large_grads)
        shared, domain = self.higgs, self.higgs_domain
        kept = self._last_step_kept()  # the buffers settle as the paths add their residuals in
        for owner in self.higgs_owner_residuals:  # settled here, whatever path the bucket takes this step
            if owner is not None:
                owner.settle(kept)
        self.higgs_steps = self.next_step(kept)  # a step counts once, however often its iteration synced
        self.higgs_pending = None
        force_all_reduce = bool(force_all_reduce)  # Megatron passes a bool or None (a host value)
        if shared.trace is not None:
            shared.trace.append(("start", self.higgs_index))
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        overlap = self.ddp_config.overlap_grad_reduce
        average = self.ddp_config.average_in_collective
        density, dense = shared.schedule.at(self.higgs_steps)
        if shared.first_moment_exchange and dense and shared.first_moments is not None:
            shared.first_moments.release()  # Adam's moment moves on its own in a dense step
        elif shared.first_moment_exchange:
            self._to_local_momentum(domain.average_over if average else 1)
        dense = dense or force_all_reduce
        distributed_optimizer = self.ddp_config.use_distributed_optimizer
        launch = StepLaunch(
            stats=SyncStats(density=density if domain.selector is not None else 1.0),
            # bounded waits need a handle: every collective is launched asynchronously then
            async_op=overlap or shared.waits.timeout is not None,
            reduce_op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, force_all_reduce=force_all_reduce,
            sums=[] if shared.check_nonfinite else None, comm=shared.comm, group=self._communication_group,
            selector=domain.selector, timer=shared.compress_timer, residuals=self.higgs_residuals,
            owner_residuals=self.higgs_owner_residuals,
            scores=self.higgs_scores, kept=kept, group_index=self.higgs_index, megatron=self._megatron_collective,
            nodes=domain.nodes, waits=shared.waits,
            shard=self.intra_distributed_optimizer_instance_rank if distributed_optimizer else None)
        launch.stats.dense_bytes, launch.stats.dense_wire_bytes = self.higgs_dense_traffic
        self.higgs_held = []
        for idx, bucket in enumerate(self.buckets):
            path, step_density = self.higgs_buckets[idx].step_path(density, dense, launch.force_all_reduce,
                                                                    domain.costs)
            if isinstance(path, AgreedForm) and path.gather_moment:
                self.higgs_held.append(idx)
            try:
                pending = path.launch(launch, idx, bucket.grad_data, step_density)
            except RuntimeError as error:
                shared.waits.launch_failed(error)  # raises unless the step is given up (``StepWaits``)
                pending = None
            if pending is not None:  # None: Megatron's own work, in launch.dense_works
                launch.pending.append(pending)
        if launch.sums is not None:
            self.higgs_nonfinite = torch.isfinite(torch.stack(launch.sums)).all().logical_not()
        self.higgs_pending = shared.ledger.taken if shared.ledger is not None else 0
        shared.stats.add(launch.stats)
        handle = _GroupHandle(launch.dense_works, launch.pending, domain.average_over if average else 1,
                              on_done=self._on_sync_done, waits=shared.waits)
        if overlap:
            self.grad_reduce_handle = handle
        else:
            handle.wait()
            self.grad_reduce_handle = None

    def _to_local_momentum(self, average_over: int) -> None:
        """1-bit Adam's step (``first_moment``): each bucket becomes this rank's share of Adam's
        next first moment, before any path reads it. The shares of the moment in force add up to
        it over the group: 1/P each where the paths sum, whole where they average."""
        moments = self.higgs.first_moments
        if moments is None:
            raise HiggsConfigurationError("--higgs-sync onebit exchanges Adam's first moment: wrap the optimizer "
                                          "with higgs_megatron.wrap_optimizer before the first step")
        share = average_over / self._plan_world
        with self.higgs.compress_timer.measure(self.buckets[0].grad_data.device):
            for idx, bucket in enumerate(self.buckets):
                moments.to_local_momentum((self.higgs_index, idx), bucket.grad_data, share, average_over)

    def _wait_for_graph_replays(self) -> None:
        """megatron-core 0.19 (``compat.buckets``): a local CUDA graph's replay writes its
        parameters' gradients asynchronously to backward's hooks, and marks the end with an
        event on each; the current stream waits for those before the bucket is read (no host wait)."""
        events = {id(event): event for bucket in self.buckets for param in bucket.params_list
                  if (event := getattr(param, GRAPH_REPLAY_EVENT, None)) is not None}
        for event in events.values():
            torch.cuda.current_stream().wait_event(event)

    def _on_sync_done(self) -> None:
        moments = self.higgs.first_moments
        if self.higgs_held and self.higgs.waits.abandoned:
            moments.release()  # what a given-up sync left need not be the same on every rank
        elif self.higgs_held:
            for idx in self.higgs_held:  # the re-signed moment gathered back: the same bytes on every rank
                moments.hold((self.higgs_index, idx), self.buckets[idx].grad_data)
        if self.higgs.trace is not None:
            self.higgs.trace.append(("finish", self.higgs_index))

    def _megatron_collective(self, idx: int, grad: torch.Tensor, launch: StepLaunch):
        """Megatron's own collectives for one bucket: reduce-scatter into this rank's shard with
        the distributed optimizer, else all-reduce; with several optimizer instances, then that
        shard all-reduced across the instances, once the reduce-scatter is done."""
        group, reduce_op, async_op = self._communication_group, launch.reduce_op, launch.async_op
        if self.ddp_config.use_distributed_optimizer and not launch.force_all_reduce:
            if self.cached_grad_buffer_shard_list[idx] is None:
                self.cached_grad_buffer_shard_list[idx] = shard_buffer(
                    grad, self.intra_distributed_optimizer_instance_size)
            local = self.cached_grad_buffer_shard_list[idx][self.intra_distributed_optimizer_instance_rank]
            work = reduce_scatter(self.higgs.comm, local, grad, group, reduce_op, async_op,
                                  bounded=launch.bounded)
        else:
            local = grad
            work = self.higgs.comm.all_reduce(grad, group, op=reduce_op, async_op=async_op)
        if self.higgs.instances == 1:
            return work
        if work is not None:
            self.higgs.waits.wait(work)
        return self.higgs.comm.all_reduce(local, self.inter_distributed_optimizer_instance_group, op=reduce_op,
                                          async_op=async_op)


class HiggsDDP(DistributedDataParallel):
    """Megatron DDP whose data-parallel gradient reduction (the experts' included) is top-k with
    error feedback."""

    def __init__(self, config, ddp_config, module: torch.nn.Module, higgs_config: HiggsConfig | None = None,
                 replicas: ReplicaGroup | None = None, **kwargs) -> None:
        """``replicas``: elastic replicas (``elastic``): the gradient sync runs across them on
        torchft's group, never on Megatron's data-parallel group (size 1 inside a replica)."""
        if ddp_config.use_megatron_fsdp or ddp_config.use_custom_fsdp:
            raise HiggsConfigurationError("HiggsDDP replaces DDP's reduction; Megatron FSDP is not supported")
        for name, flag in UNSUPPORTED_DDP_OPTIONS.items():
            if getattr(ddp_config, name, None):
                raise HiggsConfigurationError(f"HiggsDDP does not support DistributedDataParallelConfig.{name} "
                                              f"(Megatron-LM's {flag}): its reduction is Megatron's own")
        super().__init__(config, ddp_config, module, **kwargs)
        instances = ddp_config.num_distributed_optimizer_instances
        if self.expert_parallel_bucket_groups and instances > 1:
            raise HiggsConfigurationError(
                "HiggsDDP does not compress expert gradients across several distributed-optimizer instances "
                f"(num_distributed_optimizer_instances={instances} with num_moe_experts set)")
        self.higgs_config = higgs_config or HiggsConfig()
        self._higgs = _Shared(config=self.higgs_config, schedule=DensitySchedule.of(self.higgs_config),
                              instances=instances, first_moment_exchange=self.higgs_config.first_moment_exchange)
        if replicas is not None:
            self._check_replicas(replicas)
            self._higgs.replicas, self._higgs.comm = replicas, ReplicaCollectives()
            self._higgs.waits.across_replicas = True
        self._higgs_domains: list[_Domain] = []
        index = 0
        for offset, groups in enumerate((self.bucket_groups, self.expert_parallel_bucket_groups)):
            if not groups:
                if offset == 1 and self._experts_elsewhere():
                    # build_node_groups is collective over the whole world: take part in the
                    # experts', for this rank's expert-data-parallel group, and keep nothing
                    build_node_groups(parallel_state.get_expert_data_parallel_group())
                continue
            domain, dp_group = self._higgs_domain(groups, seed_offset=offset * _SELECTOR_SEED_STRIDE)
            self._higgs_domains.append(domain)
            for group in groups:
                group.__class__ = HiggsBucketGroup
                group._higgs_attach(self._higgs, domain, index)
                index += 1
            if self.higgs_config.sync == "auto" and self.higgs_config.compressor != "none":
                self._higgs_plan_auto(domain, groups, dp_group, ddp_config.use_distributed_optimizer)
            for group in groups:
                group._higgs_make_residuals()
        self._higgs_bias = KeptExpertBias(self.module) if config.moe_router_enable_expert_bias else None

    def forward(self, *inputs, **kwargs):
        if self._higgs_bias is not None and self._higgs.ledger is not None:
            self._higgs_bias.settle(self._higgs.ledger.taken)
        return super().forward(*inputs, **kwargs)

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        # every bucket's last collective in flight before the first bucket decodes (the order of
        # the groups, on every rank): the all-gathers go out while the first buckets decode. On the
        # current stream, where the groups' waits run (not with several optimizer instances, whose
        # sync runs on Megatron's communication stream: the hierarchical form, nothing to prepare)
        for group in self.higgs_bucket_groups:
            if group.higgs.instances == 1 and isinstance(group.grad_reduce_handle, _GroupHandle):
                group.grad_reduce_handle.prepare()
        super().finish_grad_sync(force_all_reduce)
        if self._higgs_bias is not None and self._higgs.ledger is not None:
            self._higgs_bias.stage(self._higgs.ledger.taken)
        self._reread_params()

    @property
    def higgs_bucket_groups(self) -> list[HiggsBucketGroup]:
        """Every bucket group of this chunk: the dense parameters', then the experts'."""
        return self.bucket_groups + self.expert_parallel_bucket_groups

    @property
    def higgs_sync_report(self) -> list[dict]:
        """Under sync="auto", each bucket's choice (dense groups first, then the experts')."""
        return [entry for domain in self._higgs_domains for entry in domain.sync_report]

    def _higgs_domain(self, groups: list[_ParamAndGradBucketGroup], seed_offset: int
                      ) -> tuple[_Domain, dist.ProcessGroup]:
        """The reduction domain of ``groups`` (all over one group: the data-parallel one, or the
        expert-data-parallel one), and the group its link costs are agreed over."""
        config, instances, replicas = self.higgs_config, self._higgs.instances, self._higgs.replicas
        dp_group = (groups[0].intra_distributed_optimizer_instance_group
                    if self.ddp_config.use_distributed_optimizer else groups[0].data_parallel_group)
        # Seeded by the rank in that group (an elastic replica's index, whatever the quorum): the
        # TP ranks of one replica sample alike, so a TP-replicated parameter (same gradient on
        # each) is selected alike even where sampling falls short; the expert domain's selectors
        # draw apart from the dense one's.
        selector = None if config.compressor == "none" else make_selector(
            config.compressor, seed=seed_offset + (replicas.index if replicas is not None else dist.get_rank(dp_group)))
        if replicas is not None:  # averaged by the gradient scaling the quorum sets (``elastic.replicas``)
            return _Domain(selector=selector), dp_group
        domain = _Domain(selector=selector, average_over=dist.get_world_size(dp_group) * instances)
        if instances > 1 and config.compressor != "none":
            # Megatron's parallel state made the two levels: dense inside an instance, compressed across.
            domain.nodes = instance_groups(dp_group, groups[0].inter_distributed_optimizer_instance_group)
            dp_group = self.dp_cp_group  # the cost measurement is agreed over the whole DP group
        elif self._builds_node_groups():
            # Collective over the whole world: every rank builds its HiggsDDP chunks together (a
            # rank whose chunk has no experts joins the experts' in __init__).
            if groups is self.expert_parallel_bucket_groups:
                self._agree_on_experts(True)  # with the ranks whose chunks have none (_experts_elsewhere)
            domain.nodes = build_node_groups(dp_group)
        return domain, dp_group

    def _builds_node_groups(self) -> bool:
        """Whether the domains build node groups (collective over the whole world)."""
        config = self.higgs_config
        return (self._higgs.instances == 1 and config.sync in ("auto", "hierarchical")
                and config.compressor != "none" and self._higgs.replicas is None)

    def _check_replicas(self, replicas: ReplicaGroup) -> None:
        """Elastic replicas: what the sync across a changing quorum cannot do, refused. Only the
        forms whose plans do not depend on who takes part (dense, and each rank's own top-k
        all-gathered) run across replicas; Megatron's reduction inside a replica has nothing to
        reduce (data-parallel size 1), and the distributed optimizer nothing to shard."""
        config, ddp_config = self.higgs_config, self.ddp_config
        problems = []
        if config.compressor != "none" and config.sync not in ("sparse", "dense"):
            problems.append(f"--higgs-sync {config.sync} (across replicas: sparse or dense)")
        if ddp_config.use_distributed_optimizer:
            problems.append("the distributed optimizer (nothing to shard inside a replica)")
        if ddp_config.average_in_collective:
            problems.append("average_in_collective (the quorum's size scales the gradients)")
        if self.expert_parallel_bucket_groups:
            problems.append("experts (their expert-data-parallel group is not the replicas')")
        inside = parallel_state.get_data_parallel_world_size()
        if inside != 1:
            problems.append(f"data-parallel size {inside} inside a replica (expected 1)")
        if problems:
            raise HiggsConfigurationError(f"elastic replicas (--higgs-replicas) with {'; '.join(problems)}")

    def _experts_elsewhere(self) -> bool:
        """This chunk has no experts (a pipeline stage without MoE layers): whether another
        rank's has, where that matters (the domains build node groups). Agreed by a MAX over
        the world, which ranks with experts take part in from ``_higgs_domain``; a host read,
        once, at construction."""
        if not self._builds_node_groups():
            return False
        return bool(self._agree_on_experts(False).item())  # decides whether to enter a collective

    @staticmethod
    def _agree_on_experts(mine: bool) -> torch.Tensor:
        """Whether any rank of the world has experts (collective over the world), on the
        collective's device: read on the host only by the ranks without experts."""
        flag = torch.tensor([int(mine)], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _higgs_plan_auto(self, domain: _Domain, groups: list[HiggsBucketGroup], dp_group: dist.ProcessGroup,
                         distributed_optimizer: bool) -> None:
        """Measure the links (collective over ``dp_group``), then keep each bucket's cheaper form."""
        plans = [plan for group in groups for plan in group.higgs_plans if plan is not None]
        config = self.higgs_config
        domain.costs = measure_link_costs(
            dp_group, domain.nodes, distributed_optimizer, max(plans, key=lambda plan: plan.numel, default=None),
            config.compression_ratio, config.compressor, config.error_feedback,
            groups[0].buckets[0].grad_data.device, assume_gbps=config.link_gbps,
            assume_node_gbps=config.node_link_gbps)
        domain.sync_report = [choose_form(paths, domain.costs, config.compression_ratio)
                              for group in groups for paths in group.higgs_buckets]

    @property
    def link_costs(self) -> LinkCosts | None:
        """The agreed costs behind 'auto' over the data-parallel group (None under the other sync
        modes); the experts' domain agrees its own."""
        return self._higgs_domains[0].costs

    # --- what the loop, the optimizer wrapper and the tests ask of it -----------------

    def take_stats(self) -> SyncStats:
        """Bytes and compression time since the last call (call once per step). The time is
        that of the compressions the device has finished: it never waits for the device, so
        on a GPU a step's compression may be counted in the next call."""
        return self._higgs.take_stats()

    def trace_sync_order(self, enabled: bool = True) -> list[tuple[str, int]] | None:
        """Record ('start'|'finish', group index) events from now on; returns the live list."""
        self._higgs.trace = [] if enabled else None
        return self._higgs.trace

    def send_param_changes(self, payload: str) -> None:
        """Send the distributed optimizer's parameter all-gather as changes in ``payload``
        (``reduce.param_gather``): the optimizer wrapper's call, once the main parameters are
        apart from the buffers."""
        if not self.ddp_config.use_distributed_optimizer or payload == "dense":
            return
        for group in self.higgs_bucket_groups:
            group.higgs_param_changes = ParamChanges(payload, [None] * len(group.buckets))

    def _reread_params(self) -> None:
        """As the sync finishes, before the optimizer's step overwrites this rank's shards: after
        a load, the parameters every rank holds are read from the buffers as the reference of the
        next changes (``reduce.param_gather``)."""
        for group in self.higgs_bucket_groups:
            if group.higgs_param_changes is not None:
                group.higgs_param_changes.reread([bucket.param_data for bucket in group.buckets],
                                                 group.intra_distributed_optimizer_instance_size,
                                                 group.intra_distributed_optimizer_instance_rank)

    def set_first_moments(self, moments: FirstMoments) -> None:
        """Where sync 'onebit' reads Adam's first moments (the optimizer wrapper's)."""
        self._higgs.first_moments = moments

    def set_sync_timeout(self, seconds: float | None) -> None:
        """Give up on a step's sync when a wait for it takes longer than ``seconds`` (see
        ``take_sync_failure``). Bounded waits block the host on both backends (``reduce.wire.StepWaits``)."""
        self._higgs.waits.timeout = seconds

    @property
    def sync_timeout(self) -> float | None:
        return self._higgs.waits.timeout

    def take_sync_failure(self) -> str | None:
        """Why the last step's sync is not to be trusted (None: it completed in time); resets."""
        reason, self._higgs.waits.failed = self._higgs.waits.failed, None
        return reason

    def take_abandoned_works(self) -> list[Any]:
        """The collectives of the last step that were given up on, not drained; resets."""
        works, self._higgs.waits.abandoned = self._higgs.waits.abandoned, []
        return works

    def process_groups(self) -> list[dist.ProcessGroup]:
        """Every process group this chunk's gradient sync waits on (what a rebuild replaces)."""
        groups = [group for bucket_group in self.higgs_bucket_groups
                  for group in (getattr(bucket_group, "data_parallel_group", None),
                                getattr(bucket_group, "intra_distributed_optimizer_instance_group", None),
                                getattr(bucket_group, "inter_distributed_optimizer_instance_group", None))]
        groups += [group for domain in self._higgs_domains if domain.nodes is not None
                   for group in (domain.nodes.intra, domain.nodes.inter)]
        unique: dict[int, dist.ProcessGroup] = {}
        for group in groups:
            if group is not None:
                unique.setdefault(id(group), group)
        return list(unique.values())

    def group_holders(self) -> list[Any]:
        """The objects of this chunk that hold its process groups as attributes."""
        return [self, *self.buffers, *self.expert_parallel_buffers, *self.higgs_bucket_groups,
                *(domain.nodes for domain in self._higgs_domains if domain.nodes is not None)]

    def track_nonfinite(self, enabled: bool = True) -> None:
        self._higgs.check_nonfinite = enabled

    def nonfinite_flag(self) -> torch.Tensor:
        """A device bool: whether this rank's local gradients held a NaN/inf in the last sync.
        Not read here: the caller folds it into its one decision per step."""
        flags = [g.higgs_nonfinite for g in self.higgs_bucket_groups if g.higgs_nonfinite is not None]
        if not flags:
            return torch.zeros((), dtype=torch.bool, device=self.bucket_groups[0].buckets[0].grad_data.device)
        return torch.stack(flags).any()

    def step_ledger(self) -> StepLedger:
        """The counter the wrapping optimizer bumps for every update it applies; from now on a
        sync's staged state is kept only if the optimizer took a step after it (see the module
        docstring)."""
        if self._higgs.ledger is None:
            self._higgs.ledger = StepLedger()
        return self._higgs.ledger

    def rollback_residuals(self) -> None:
        """Forget the residuals staged by the last sync (the step was skipped everywhere)."""
        for group in self.higgs_bucket_groups:
            group._rollback()

    def _residual_buffers(self) -> dict[str, tuple[HiggsBucketGroup, ResidualBuffer]]:
        """Every residual, the agreed form's owners' included: what a rank keeps of gradient mass
        not yet sent, saved per rank and dropped on a heal."""
        return {f"group{g.higgs_index}.bucket{i}{suffix}": (g, residual)
                for g in self.higgs_bucket_groups
                for suffix, residuals in (("", g.higgs_residuals), (".owner", g.higgs_owner_residuals))
                for i, residual in enumerate(residuals) if residual is not None}

    def _score_buffers(self) -> dict[str, tuple[HiggsBucketGroup, ScoreBuffer]]:
        return {f"group{g.higgs_index}.bucket{i}.scores": (g, scores)
                for g in self.higgs_bucket_groups for i, scores in enumerate(g.higgs_scores) if scores is not None}

    def residual_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals and the agreed block scores in force (what a
        resumed run must start from), the last step settled as the optimizer left it."""
        kept = {id(g): g._last_step_kept() for g in self.higgs_bucket_groups}
        state = {name: buffer.settled(kept[id(group)]).clone()
                 for name, (group, buffer) in {**self._residual_buffers(), **self._score_buffers()}.items()}
        state["steps"] = torch.tensor([g.next_step(kept[id(g)]) for g in self.higgs_bucket_groups], dtype=torch.long)
        moments = self._higgs.first_moments
        if moments is not None:  # sharded onebit: the moment the next shares are made from
            state.update({f"group{g}.bucket{i}.moment": held.clone() for (g, i), held in moments.held.items()})
        return state

    def load_residual_state(self, state: dict[str, torch.Tensor]) -> None:
        buffers = self._residual_buffers()
        missing = sorted(set(buffers) - set(state))
        if missing:
            raise KeyError(f"error-feedback state lacks residual(s) {missing}")
        for name, (_, residual) in buffers.items():
            if state[name].numel() != residual.committed.numel():
                raise ValueError(f"error-feedback residual {name}: saved {state[name].numel()} elements, "
                                 f"this model's bucket has {residual.committed.numel()}")
            residual.load(state[name].to(residual.committed.device))
        for name, (_, scores) in self._score_buffers().items():
            if name in state and state[name].numel() == scores.committed.numel():
                scores.load(state[name].to(scores.committed.device))
        for group, steps in zip(self.higgs_bucket_groups, state["steps"].tolist()):
            group.higgs_steps, group.higgs_pending = steps, None
        moments = self._higgs.first_moments
        if moments is not None:
            moments.release()
            for group in self.higgs_bucket_groups:
                for idx, bucket in enumerate(group.buckets):
                    held = state.get(f"group{group.higgs_index}.bucket{idx}.moment")
                    if held is not None and held.numel() == bucket.grad_data.numel():
                        moments.hold((group.higgs_index, idx), held.to(bucket.grad_data.device))
        for group in self.higgs_bucket_groups:  # a load wrote the parameters (``_reread_params``)
            if group.higgs_param_changes is not None:
                group.higgs_param_changes.forget()

    def peer_residual_state(self) -> dict[str, torch.Tensor]:
        """What an elastic replica that heals from this rank takes of its error-feedback state:
        the step counts (the density schedule's position, so that both sync alike) and the
        agreed block scores, not the residuals (``adopt_peer_residual_state``)."""
        residuals = self._residual_buffers()
        return {name: value for name, value in self.residual_state().items() if name not in residuals}

    def adopt_peer_residual_state(self, state: dict[str, torch.Tensor]) -> float:
        """An elastic replica heals: the peer's ``peer_residual_state``, and zero residuals. A
        residual is gradient mass its own replica has not sent yet; a copy of the peer's would
        be sent twice, by each, so conservation holds only with zero. Returns the L2 norm of the
        residuals dropped (a host read, once per heal: the log says what was lost)."""
        kept = {id(g): g._last_step_kept() for g in self.higgs_bucket_groups}
        dropped = [residual.settled(kept[id(group)]).float().square().sum()
                   for group, residual in self._residual_buffers().values()]
        norm = float(torch.stack(dropped).sum().sqrt()) if dropped else 0.0
        zeros = {name: torch.zeros_like(residual.committed) for name, (_, residual) in self._residual_buffers().items()}
        self.load_residual_state({**state, **zeros})
        return norm
