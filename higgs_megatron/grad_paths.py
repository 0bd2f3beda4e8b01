"""What each step of a bucket sends: its density (``DensitySchedule``) and its path, one
object per path, chosen each step by the bucket's ``BucketPaths``.

Every path has ``launch(step, idx, grad, density)``, which starts its collectives for bucket
``idx`` and returns what finishes them (None where Megatron's own work is left in
``step.dense_works``), and ``wire_bytes(density)``, the ring wire bytes per rank it puts on
the links it is weighed on, at its group's size (``reduce.wire``): the whole data-parallel
group's, or with a hierarchical form the slow ones across the nodes (the reduce-scatter and
all-gather inside a node are not counted there; the meter counts them). ``BucketPaths``
(made at construction by ``sync_plan.plan_bucket``) holds a bucket's forms, makes each path
object once and picks one per step (``step_path``); ``HiggsBucketGroup`` only dispatches to
it. A new path is a new class here, not a branch there.

* ``MegatronDense``: Megatron's own collective (all-reduce, or reduce-scatter with the
  distributed optimizer; then across optimizer instances);
* ``Bf16Dense``: a bf16 copy reduced, the rounding kept in the residual (``--higgs-dense-bf16``,
  ``reduce.cast_reduce``);
* ``DenseInt8``: a dense step through the bucket's form, every coordinate in int8
  (``--higgs-dense-int8``);
* the forms: ``SparseForm`` (each rank's top-k, all-gathered: ``reduce.sparse_allreduce``),
  ``AgreedForm`` (``compress.agreed``, ``reduce.agreed_reduce``), ``ShardedForm``
  (``compress.sharded``, ``reduce.sharded_reduce``) and ``HierarchicalForm`` (dense inside the
  node, this rank's slice compressed across nodes).

Stream order (CUDA): ``launch`` runs on the current stream inside Megatron's backward hook.
Error feedback, selection and packing are queued there, and the collective is launched with
``async_op`` right after; NCCL's stream waits for the current stream at launch, so it reads
the finished payload. Nothing here reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

import torch
import torch.distributed as dist

from .compress import row_codec
from .compress.agreed import AgreedPlan, ScoreBuffer, pack_rows
from .compress.compressor import BucketPlan, ResidualBuffer, Selector, pack_with_feedback
from .compress.payload import DENSE_INT8, Payload, SparseGrad
from .compress.sharded import ShardedPlan
from .cost_model import BucketShape, LinkCosts, cheapest, predict
from .device import DeviceTimer
from .reduce.agreed_reduce import launch_agreed
from .reduce.cast_reduce import launch_cast_reduce
from .reduce.sharded_reduce import launch_sharded
from .reduce.sparse_allreduce import launch_hierarchical, launch_sparse_allreduce, node_reduce_scatter
from .reduce.wire import Collectives, StepWaits, dense_wire_bytes, ring_factor
from .topology import NodeGroups


@dataclass(frozen=True)
class DensitySchedule:
    """The density each step takes (``HiggsConfig``'s schedule fields): 1 in the dense stage
    (``dense_iters`` steps) and in the variance-refresh windows, then from 1 down to
    ``compression_ratio`` over ``density_warmup_iters`` steps (geometrically), then the target.
    It lives beside the paths because both answer one question each bucket group asks at each
    hook: what this step sends. Steps are 0-based syncs, not iterations."""

    compression_ratio: float
    dense_iters: int = 0
    density_warmup_iters: int = 0
    variance_refresh_iters: int = 0

    @classmethod
    def of(cls, config: Any) -> "DensitySchedule":
        """The schedule of a ``HiggsConfig``."""
        return cls(config.compression_ratio, config.dense_iters, config.density_warmup_iters,
                   config.variance_refresh_iters)

    def refresh_window(self, step: int) -> bool:
        """Whether ``step`` is in a window of ``variance_refresh_iters``: windows start at twice
        the dense stage, then at each doubling."""
        if not self.variance_refresh_iters or step < 2 * self.dense_iters:
            return False
        start = 2 * self.dense_iters
        while 2 * start <= step:
            start *= 2
        return step - start < self.variance_refresh_iters

    def dense_stage(self, step: int) -> bool:
        """Whether ``step`` syncs dense: the dense stage, or a refresh window."""
        return step < self.dense_iters or self.refresh_window(step)

    def at(self, step: int) -> tuple[float, bool]:
        """(the density in force at ``step``, whether it is a dense step), in one pass."""
        dense = self.dense_stage(step)
        return (1.0 if dense else self._compressed_density(step)), dense

    def density(self, step: int) -> float:
        """The density in force at ``step``."""
        return self.at(step)[0]

    def _compressed_density(self, step: int) -> float:
        step -= self.dense_iters
        if step >= self.density_warmup_iters:
            return self.compression_ratio
        return self.compression_ratio ** (step / self.density_warmup_iters)


@dataclass
class StepLaunch:
    """One bucket group's ``start_grad_sync``: what every path's launch reads, and what it
    leaves for the handle that finishes the step."""

    stats: Any  # ddp.SyncStats: the bytes handed and the bucket counts of this step
    async_op: bool
    reduce_op: Any
    force_all_reduce: bool
    sums: list[torch.Tensor] | None  # the non-finite check's, one per bucket (or slice) sent
    comm: Collectives
    group: dist.ProcessGroup  # the buckets' group: the DP group, or this optimizer instance
    selector: Selector | None
    timer: DeviceTimer  # the compression's time
    residuals: list[ResidualBuffer | None]
    scores: list[ScoreBuffer | None]
    owner_residuals: list[ResidualBuffer | None]  # the agreed form's owners'; None elsewhere
    kept: bool  # whether the optimizer took the last sync's step: what it staged is kept, else dropped
    group_index: int  # the bucket group's index: with a bucket's, the selector's key (``key``)
    megatron: Callable[[int, torch.Tensor, "StepLaunch"], Any]  # Megatron's own collective for bucket idx
    shard: int | None = None  # with the distributed optimizer: this rank's shard of each bucket
    nodes: NodeGroups | None = None  # the hierarchical form's groups
    waits: StepWaits = field(default_factory=StepWaits)  # how a collective of this step is waited for
    dense_works: list[Any] = field(default_factory=list)  # Megatron's collectives' works
    pending: list[Any] = field(default_factory=list)  # the other paths' exchanges in flight (the bucket group adds them)

    @property
    def bounded(self) -> bool:
        """Waits are bounded (``--higgs-step-timeout``): every collective gets a work."""
        return self.waits.timeout is not None

    def key(self, idx: int) -> tuple[int, int]:
        """The selector's key of bucket ``idx`` (a sampled selector draws per key)."""
        return self.group_index, idx

    def check(self, sent: torch.Tensor) -> None:
        """The non-finite check, when it is on: one summing pass over what a bucket sends (the
        gradient plus its residual), before the collective reads it. A NaN or inf anywhere makes
        the sum non-finite (a finite sum that overflows only skips a step needlessly); far
        cheaper than ``torch.isfinite(grad).all()``. It stays a device flag, read once per step
        by the optimizer wrapper's decision: a read here would stall backward's launch queue."""
        if self.sums is not None:
            self.sums.append(sent.sum(dtype=torch.float32))

    def count(self, dense: bool) -> None:
        if dense:
            self.stats.dense_buckets += 1
        else:
            self.stats.sparse_buckets += 1


class GradPath(Protocol):
    name: ClassVar[str]

    def wire_bytes(self, density: float = 1.0) -> float: ...

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float) -> Any: ...


def _dense_feedback(step: StepLaunch, idx: int, grad: torch.Tensor, piece: tuple[int, int] | None) -> None:
    """A dense step of a bucket with a residual: the residual is added in (over a hierarchical
    form's slice, ``piece``), and nothing is left of it."""
    residual = step.residuals[idx]
    if residual is None:
        return
    lo, hi = piece or (0, grad.numel())
    with step.timer.measure(grad.device):
        residual.accumulate(grad.narrow(0, lo, hi - lo), step.kept)
        residual.stage_all_sent()


@dataclass(frozen=True)
class MegatronDense:
    """Megatron's own collective for the bucket (its work waited for as Megatron's). Wire:
    its ring all-reduce or reduce-scatter over ``world`` ranks; for a bucket with a
    hierarchical form, the slice's all-reduce across the nodes (what crosses the slow links,
    which the form is weighed against); with several optimizer instances, the shard's
    all-reduce across them after the reduce-scatter inside one."""

    numel: int
    itemsize: int
    world: int
    reduce_scatter: bool
    piece: tuple[int, int] | None = None  # the hierarchical form's slice, which its residual covers
    instances: int = 1  # Megatron's distributed-optimizer instances (``world`` ranks in each)
    name: ClassVar[str] = "dense"

    def wire_bytes(self, density: float = 1.0) -> float:
        return dense_wire_bytes(self.numel * self.itemsize, self.world, self.reduce_scatter, self.instances)

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float) -> None:
        _dense_feedback(step, idx, grad, self.piece)
        step.count(dense=True)
        step.check(grad)
        step.stats.bytes_sent += grad.numel() * grad.element_size()
        step.dense_works.append(step.megatron(idx, grad, step))
        return None


@dataclass(frozen=True)
class Bf16Dense:
    """A bf16 copy of the bucket reduced, the rounding kept in the residual
    (``reduce.cast_reduce``; ``--higgs-dense-bf16`` needs error feedback). Where Megatron forces
    its own all-reduce, ``BucketPaths.step_path`` takes ``megatron`` instead."""

    megatron: MegatronDense
    name: ClassVar[str] = "dense"

    def wire_bytes(self, density: float = 1.0) -> float:
        return dense_wire_bytes(self.megatron.numel * 2, self.megatron.world, self.megatron.reduce_scatter)

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float) -> Any:
        residual = step.residuals[idx]
        with step.timer.measure(grad.device):
            residual.accumulate(grad, step.kept)
            wire = grad.to(torch.bfloat16)
            residual.stage_rounded(grad, wire)
        step.count(dense=True)
        step.check(grad)
        step.stats.bytes_sent += wire.numel() * wire.element_size()
        return launch_cast_reduce(step.comm, grad, wire, step.group, step.shard, step.async_op, bounded=step.bounded)


@dataclass(frozen=True)
class SparseForm:
    """Each rank's own top-k with error feedback, all-gathered (``reduce.sparse_allreduce``).
    Wire: (P-1) payloads."""

    plan: BucketPlan
    dtype: torch.dtype
    world: int
    name: ClassVar[str] = "sparse"

    def wire_bytes(self, density: float = 1.0, payload: Payload | None = None) -> float:
        return ring_factor("all_gather", self.world) * self.plan.payload_bytes(density, self.dtype, payload)

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float,
               payload: Payload | None = None) -> Any:
        with step.timer.measure(grad.device):
            packed = pack_with_feedback(grad, self.plan, density, step.selector, step.residuals[idx],
                                        key=step.key(idx), payload=payload, kept=step.kept)
        step.stats.bytes_sent += packed.buffer.numel()
        step.count(dense=payload is DENSE_INT8)
        step.check(grad)
        return launch_sparse_allreduce(step.comm, packed, grad, step.group, async_op=step.async_op)


@dataclass(frozen=True)
class HierarchicalForm:
    """Dense reduce-scatter inside the node, then this rank's slice compressed across nodes
    (after a given-up reduce-scatter too: see ``ddp._GroupHandle``). Wire: the payloads of the
    other nodes (the links inside a node are not what it saves)."""

    plan: BucketPlan
    dtype: torch.dtype
    node_count: int  # the nodes (or optimizer instances) the slice is compressed across
    name: ClassVar[str] = "hierarchical"

    def wire_bytes(self, density: float = 1.0, payload: Payload | None = None) -> float:
        return ring_factor("all_gather", self.node_count) * self.plan.payload_bytes(density, self.dtype)

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float,
               payload: Payload | None = None) -> Any:
        # no dense int8 step through a slice (``BucketPaths.dense_in_int8``): the plan's payload only
        assert payload is None, "the hierarchical form sends its plan's payload"
        nodes, plan = step.nodes, self.plan
        step.check(grad)
        work, piece = node_reduce_scatter(step.comm, grad, nodes.intra, step.waits, bounded=step.bounded)
        with step.timer.measure(grad.device):
            packed = pack_with_feedback(piece, plan, density, step.selector, step.residuals[idx], key=step.key(idx),
                                        kept=step.kept)
        # Bytes handed to collectives: the node's reduce-scatter (and all-gather), and the payload.
        node_bytes = (1 if nodes.instances else 2) * (work.numel() - piece.numel()) * work.element_size()
        step.stats.bytes_sent += packed.buffer.numel() + node_bytes
        step.count(dense=False)
        step.check(piece)  # this rank's slice: the node's sum plus the residual
        return launch_hierarchical(step.comm, packed, work, piece, grad, nodes.intra, nodes.inter, step.async_op,
                                   gather=not nodes.instances)


@dataclass(frozen=True)
class AgreedForm:
    """Error feedback, the agreed selection and this rank's rows (``compress.agreed``), then
    the all-to-all and the scores' all-reduce (``reduce.agreed_reduce``)."""

    plan: AgreedPlan
    dtype: torch.dtype
    world: int
    gather: bool  # the summed rows all-gathered back (not with the distributed optimizer)
    gather_moment: bool = False  # sync 'onebit' with the distributed optimizer: its compressed steps' too
    name: ClassVar[str] = "agreed"

    def gathers(self, payload: Payload | None) -> bool:
        """Whether the owners' sums go back to every rank this step: without the distributed
        optimizer always; with it only in 1-bit Adam's compressed steps, whose sums are the
        first moment every rank's next share is made from (``first_moment``)."""
        return self.gather or (self.gather_moment and payload is None)

    def wire_bytes(self, density: float = 1.0, payload: Payload | None = None) -> float:
        plan, world = self.plan, self.world
        row = plan.row_bytes(density, self.dtype, payload.name if payload is not None else None)
        gather = ring_factor("all_gather", world) * row if self.gathers(payload) else 0
        return (ring_factor("all_to_all", world) * world * row + gather
                + ring_factor("all_reduce", world) * (plan.score_bytes() + plan.always_bytes(self.dtype)))

    @staticmethod
    def expected(grad: torch.Tensor, residual: ResidualBuffer | None) -> torch.Tensor:
        """What the next step would send: what is left, plus this step's gradient standing in
        for the next (what the block scores rank)."""
        if residual is None:
            return grad
        expected = grad.add(residual.staged)
        if not residual.committed_zero:
            expected.sub_(residual.committed)
        return expected

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float,
               payload: Payload | None = None) -> Any:
        plan, residual, scores, owner = self.plan, step.residuals[idx], step.scores[idx], step.owner_residuals[idx]
        value_format = payload.name if payload is not None else plan.value_format
        layout = plan.layout(density)
        with step.timer.measure(grad.device):
            if residual is not None:
                residual.accumulate(grad, step.kept)
            step.check(grad)
            scores.settle(step.kept)
            positions, real = plan.select(scores.committed, density)
            always = grad.index_select(0, plan.always_positions)  # sent whole, summed by an all-reduce
            runs = row_codec.runs_for(plan, value_format, density)
            if runs is not None and residual is not None:  # one fused pass
                left = residual.staging()
                rows = row_codec.encode(grad, positions, real, layout.span, left, runs, value_format)
                # what no row holds stays as it is, but the always-sent values, which go whole (left_after's)
                left.index_copy_(0, plan.outside_rows, grad.index_select(0, plan.outside_rows))
                left.index_add_(0, plan.always_positions, always, alpha=-1)
            else:
                values = torch.where(real, grad.index_select(0, positions.view(-1)).view(positions.shape), 0)
                rows, rounded = pack_rows(values, value_format, layout.span, real)
                if residual is not None:
                    residual.stage(grad, SparseGrad(always, plan.always_positions, positions.view(-1),
                                                    rounded.view(-1)))
            local_scores = plan.scores(self.expected(grad, residual)) if plan.scored else None
        gather = self.gathers(payload)
        step.stats.bytes_sent += (rows.numel() + plan.score_bytes() + plan.always_bytes(grad.dtype)
                                  + (rows.shape[1] if gather else 0))
        step.count(dense=payload is DENSE_INT8)
        return launch_agreed(step.comm, plan, density, value_format, positions, real, rows, always, local_scores,
                             scores, residual, owner, grad, step.group, gather, async_op=step.async_op)


def owner_density(density: float, sum_density_factor: float, payload: Payload | None = None) -> float:
    """The sharded form's owners' density for a step at ``density``: ``sum_density_factor``
    times it, at most 1; a dense int8 step (``payload``) sends every coordinate back."""
    return density if payload is not None else min(1.0, density * sum_density_factor)


@dataclass(frozen=True)
class ShardedForm:
    """Error feedback and this rank's rows, each shard's own top-k (``compress.sharded``),
    then the all-to-all, the owners' rows gathered back and the small parameters' all-reduce
    (``reduce.sharded_reduce``). Wire: about two flat payloads, whatever P."""

    plan: ShardedPlan
    dtype: torch.dtype
    world: int
    gather: bool  # the owners' rows all-gathered back (not with the distributed optimizer)
    sum_density_factor: float = 1.0
    name: ClassVar[str] = "sharded"

    def owner_density(self, density: float, payload: Payload | None = None) -> float:
        return owner_density(density, self.sum_density_factor, payload)

    def wire_bytes(self, density: float = 1.0, payload: Payload | None = None) -> float:
        plan, world = self.plan, self.world
        row = plan.row_bytes(density, self.dtype, payload)
        back = plan.row_bytes(self.owner_density(density, payload), self.dtype, payload)
        gather = ring_factor("all_gather", world) * back if self.gather else 0
        return (ring_factor("all_to_all", world) * world * row + gather
                + ring_factor("all_reduce", world) * plan.always_bytes(self.dtype))

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float,
               payload: Payload | None = None) -> Any:
        plan, residual = self.plan, step.residuals[idx]
        sum_density = self.owner_density(density, payload)  # payload: DENSE_INT8 or None
        payload = payload or plan.payload
        with step.timer.measure(grad.device):
            if residual is not None:
                residual.accumulate(grad, step.kept)
            step.check(grad)  # before the small parameters are taken out
            always = plan.take_always(grad)
            rows = plan.compress_rows(grad, density, step.selector, step.comm.rank(step.group), key=step.key(idx),
                                      payload=payload, left=residual.staging() if residual is not None else None)
        step.stats.bytes_sent += (rows.numel() + plan.always_bytes(grad.dtype)
                                  + (plan.row_bytes(sum_density, grad.dtype, payload) if self.gather else 0))
        step.count(dense=payload is DENSE_INT8)
        return launch_sharded(step.comm, plan, density, payload, step.selector, step.key(idx), rows, always, residual,
                              grad, step.group, self.gather, async_op=step.async_op, sum_density=sum_density)


FormPath = SparseForm | HierarchicalForm | AgreedForm | ShardedForm


@dataclass(frozen=True)
class DenseInt8:
    """A dense step through the bucket's form at density 1, every coordinate in int8."""

    form: FormPath
    name: ClassVar[str] = "dense-int8"

    def wire_bytes(self, density: float = 1.0) -> float:
        return self.form.wire_bytes(1.0, DENSE_INT8)

    def launch(self, step: StepLaunch, idx: int, grad: torch.Tensor, density: float) -> Any:
        return self.form.launch(step, idx, grad, 1.0, DENSE_INT8)


@dataclass
class BucketPaths:
    """One bucket's compressed forms and the path each step takes (see the module docstring)."""

    name: str
    numel: int
    dtype: torch.dtype
    candidates: dict[str, BucketPlan | AgreedPlan]
    slice: tuple[int, int] | None  # this rank's [start, end) of the bucket, with a hierarchical form
    ranks_per_node: int = 1
    world: int = 1  # the ranks of the group its collectives run over (Megatron's DP group, or one instance)
    distributed_optimizer: bool = False  # its dense step is a reduce-scatter
    gather_moment: bool = False  # sync 'onebit' with the distributed optimizer (``AgreedForm.gather_moment``)
    nodes: int = 1  # with a hierarchical form: the nodes (or optimizer instances) the slice is compressed across
    dense_bf16: bool = False  # config.dense_bf16, for a bucket with a residual, one instance, wider than bf16
    dense_int8: bool = False  # config.dense_int8, for a bucket with a residual and one instance
    paths: dict[float, str] = field(default_factory=dict)  # density -> path
    int8_verdict: bool | None = None  # under 'auto', once decided: whether int8_pays
    sum_density_factor: float = 1.0  # config.sum_density_factor: the sharded form's owner's density
    instances: int = 1  # Megatron's distributed-optimizer instances, over which a dense shard is all-reduced
    _made_paths: dict[object, Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def dense_in_bf16(self) -> bool:
        """Whether its dense steps reduce a bf16 copy: with ``dense_bf16``, where one residual
        covers the whole bucket (no hierarchical slice) to keep the rounding."""
        return self.dense_bf16 and self.slice is None

    @property
    def dense_in_int8(self) -> bool:
        """Whether its dense steps send every coordinate in int8, through its flat form at density
        1 (``dense_int8``); not with a hierarchical slice, as ``dense_in_bf16``; and only where
        that puts fewer bytes on the link than the plain dense step (an all-gather at this size).
        Decided once per form (not per step)."""
        return self._made(("dense-in-int8", self.form, self.slice), lambda: (
            self.dense_int8 and self.slice is None and self.form in ("sparse", "agreed", "sharded")
            and self.form_wire(1.0, int8=True) < self.plain_dense_wire()))

    @property
    def dense_path(self) -> MegatronDense | Bf16Dense:
        """Its plain dense step: Megatron's collective, or a bf16 copy's where its dense steps go
        in bf16. Its wire is counted, with a hierarchical form, across the nodes: the slice's
        all-reduce between them (the fast links inside a node are not what it saves)."""
        def make() -> MegatronDense | Bf16Dense:
            if self.form == "hierarchical":
                megatron = MegatronDense(self.plan.numel, self.dtype.itemsize, self.nodes, False, self.slice)
            else:
                megatron = MegatronDense(self.numel, self.dtype.itemsize, self.world, self.distributed_optimizer,
                                         instances=self.instances)
            return Bf16Dense(megatron) if self.dense_in_bf16 else megatron
        return self._made(("dense", self.form, self.slice), make)

    @property
    def form_path(self) -> FormPath | None:
        """The path of its compressed form (None: always dense)."""
        form = self.form
        if form is None:
            return None

        def make() -> FormPath:
            plan, gather = self.plan, not self.distributed_optimizer
            if form == "sparse":
                return SparseForm(plan, self.dtype, self.world)
            if form == "hierarchical":
                return HierarchicalForm(plan, self.dtype, self.nodes)
            if form == "agreed":
                return AgreedForm(plan, self.dtype, self.world, gather, self.gather_moment)
            return ShardedForm(plan, self.dtype, self.world, gather, self.sum_density_factor)
        return self._made(form, make)

    def _made(self, key: object, make: Callable[[], Any]) -> Any:
        """Made once per key (what it is made of: the form, its slice), not once a step."""
        if key not in self._made_paths:
            self._made_paths[key] = make()
        return self._made_paths[key]

    def plain_dense_wire(self) -> float:
        """Ring wire bytes per rank of the bucket's plain dense step (``dense_path``)."""
        return self.dense_path.wire_bytes()

    def dense_wire(self) -> float:
        """Ring wire bytes per rank of the bucket's dense step as it is sent."""
        return self.form_wire(1.0, int8=True) if self.dense_in_int8 else self.plain_dense_wire()

    def smaller_than_dense(self, density: float) -> bool:
        """Whether the form at ``density`` puts fewer bytes on this rank's link than the bucket's
        dense step as it is sent, at this group's size (ring wire bytes, ``reduce.wire``)."""
        return self.form_wire(density) < self.dense_wire()

    def form_wire(self, density: float, int8: bool = False) -> float:
        """Ring wire bytes per rank of the form at ``density`` (``int8``: as a dense int8 step)."""
        return self.form_path.wire_bytes(density, DENSE_INT8 if int8 else None)

    def step_path(self, density: float, dense: bool, force_all_reduce: bool, costs: LinkCosts | None
                  ) -> tuple[GradPath, float]:
        """This step's path (``path_at``, or dense in a dense stage) and the density it takes: a
        dense step goes through the form, every coordinate in int8, where ``dense_in_int8``
        and that pays (under 'auto', where the cost model says so: ``int8_pays``); Megatron's
        own collective, whatever the bucket's dense steps are, where Megatron forces it."""
        if not dense and path_at(self, density, costs) != "dense":
            return self.form_path, density
        dense_path = self.dense_path
        if force_all_reduce:
            return (dense_path.megatron if isinstance(dense_path, Bf16Dense) else dense_path), density
        if self.dense_in_int8 and self.int8_pays(costs):
            return self._made(("dense-int8", self.form), lambda: DenseInt8(self.form_path)), 1.0
        return dense_path, density

    def int8_pays(self, costs: LinkCosts | None) -> bool:
        """Whether a dense step in int8 through the form (``dense_in_int8``) is worth its
        compression: always by bytes alone (no ``costs``); under 'auto', where the cost model
        predicts it faster than the plain dense step (on a fast link it is not)."""
        if costs is None:
            return True
        if self.int8_verdict is None:
            predicted = predict(costs, self.shape(1.0, (self.form,), DENSE_INT8))
            self.int8_verdict = cheapest(predicted, allowed=("dense", self.form)) == self.form
        return self.int8_verdict

    @property
    def form(self) -> str | None:
        """The compressed form this bucket takes when it does not go dense (None: always dense)."""
        return next(iter(self.candidates), None)

    @property
    def plan(self) -> BucketPlan | None:
        return self.candidates.get(self.form) if self.form else None

    @property
    def bucket_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def shape(self, density: float, forms: tuple[str, ...], payload: Payload | None = None) -> BucketShape:
        """What the cost model needs of this bucket at ``density``, for the given forms (their
        payloads in ``payload``'s format, if given)."""
        flat, piece = self.candidates.get("sparse"), self.candidates.get("hierarchical")
        sharded = self.candidates.get("sharded") if "sharded" in forms else None
        return BucketShape(
            bucket_bytes=self.bucket_bytes, numel=self.numel,
            flat_payload_bytes=flat.payload_bytes(density, self.dtype, payload) if flat and "sparse" in forms else None,
            slice_numel=piece.numel if piece else 0,
            slice_payload_bytes=piece.payload_bytes(density, self.dtype) if piece and "hierarchical" in forms
            else None,
            ranks_per_node=self.ranks_per_node if piece else 1,
            shard_row_bytes=sharded.row_bytes(density, self.dtype, payload) if sharded else None, shards=self.world,
            gather_row_bytes=0 if sharded is None else sharded.row_bytes(
                owner_density(density, self.sum_density_factor, payload), self.dtype, payload),
            always_bytes=sharded.always_bytes(self.dtype) if sharded else 0,
            gather_rows=not self.distributed_optimizer, nodes=self.nodes, dense_int8=payload is DENSE_INT8)


def path_at(bucket: BucketPaths, density: float, costs: LinkCosts | None) -> str:
    """The bucket's path at ``density``: dense when it has no form, or when its payload would not
    be smaller than the dense gradient (whatever the sync mode: a density ramp's early steps
    would otherwise send more than dense); else its form under 'sparse'/'hierarchical', and
    the cheaper of dense and its form under 'auto' (``costs`` given)."""
    form = bucket.form
    if form is None:
        return "dense"
    if density not in bucket.paths:
        if not bucket.smaller_than_dense(density):
            bucket.paths[density] = "dense"
        elif costs is None:
            bucket.paths[density] = form
        else:
            predicted = predict(costs, bucket.shape(density, (form,)))
            bucket.paths[density] = cheapest(predicted, allowed=("dense", form))
    return bucket.paths[density]
