"""Per-bucket path planning for the compressed sync: no process group, no Megatron. It makes
each bucket's path objects (``grad_paths``), which launch the collectives.

For each gradient bucket, ``plan_bucket`` decides once, at construction:

* its compressed **forms**: ``sparse`` (the flat all-gather reduction over the DP group),
  ``sharded`` (each rank's own top-k per shard to its owner by an all-to-all, the owners' top-k
  of their sums gathered back: ``compress.sharded``; with ``sparse``, auto's flat forms),
  ``agreed`` (every rank sends the same coordinates, summed by an all-to-all: ``compress.agreed``) and,
  where the DP group spans several nodes with several ranks each, ``hierarchical`` (dense
  inside the node, this rank's slice compressed across nodes); with several distributed-
  optimizer instances, ``hierarchical`` alone, its levels the instances; none for a bucket that always
  stays dense (compressor ``none``, ``sync="dense"``, fewer than ``min_bucket_numel``
  elements, or ``hierarchical`` on one node);
* for each form, its ``BucketPlan`` (the selection units and fixed k per density).

Under ``sync="auto"``, ``choose_form`` keeps the form the cost model predicts cheaper at the
target density; then ``path_at`` gives the path of each step (``dense`` or the form), from the
agreed link costs, cached per density. Under every mode a step whose form would put no fewer
bytes on this rank's link than the dense step, at this group's size, goes dense (the early steps of
a density ramp; the all-gather of a large group). Every input is
the same on every DP peer, so every peer plans the same paths and issues the same collectives
with the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .compress.agreed import AgreedPlan
from .compress.compressor import BucketPlan, ParamSlot
from .compress.payload import DENSE_INT8, Payload
from .compress.sharded import ShardedPlan
from .config import HiggsConfig
from .cost_model import BucketShape, LinkCosts, cheapest, predict
from .grad_paths import (AgreedForm, Bf16Dense, DenseInt8, FormPath, GradPath, HierarchicalForm, MegatronDense,
                         ShardedForm, SparseForm, owner_density)
from .reduce.sparse_allreduce import slice_range


@dataclass(frozen=True)
class NodeShape:
    """Where this rank sits among the DP group's nodes (``topology.NodeGroups`` without its groups).
    ``instances``: the levels are Megatron's distributed-optimizer instances, whose protocol is
    a reduce-scatter inside the instance and an all-reduce across: there is no flat form."""

    nodes: int
    ranks_per_node: int
    local_index: int
    instances: bool = False

    @property
    def single_node(self) -> bool:
        return self.nodes == 1


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
                return AgreedForm(plan, self.dtype, self.world, gather)
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


def plan_bucket(name: str, numel: int, dtype: torch.dtype, slots: list[ParamSlot], config: HiggsConfig,
                nodes: NodeShape | None, device: torch.device, world: int = 1,
                distributed_optimizer: bool = False) -> BucketPaths:
    """The forms and plans of one bucket over a group of ``world`` ranks (see the module docstring)."""
    compressible = (config.compressor != "none" and config.sync != "dense" and numel >= config.min_bucket_numel
                    and not (config.sync == "hierarchical" and (nodes is None or nodes.single_node)))
    # 'auto' weighs time and bytes, not loss: at the same density the agreed blocks ended 5.9%
    # above dense's loss where the ranks' own top-k ended 0.9% (docs/compression.md), so it is
    # not one of auto's forms until it converges as well. The sharded form keeps each rank's own
    # top-k, with wire bytes per rank flat in P: auto weighs it against the all-gather, which it
    # beats from three ranks on (at two they put the same wire bytes per rank on the link; ties go to the all-gather).
    forms = {"auto": ("sparse", "sharded", "hierarchical"), "sparse": ("sparse",), "agreed": ("agreed",),
             "sharded": ("sharded",), "hierarchical": ("hierarchical",)}.get(config.sync, ()) if compressible else ()
    if "sharded" in forms and config.payload == "wide" and dtype != torch.float32:
        # The owner sums in fp32 and sends its sum back: wide values are sent in the gradient's
        # dtype, so a narrower gradient would be read as another width on the way back.
        if config.sync == "sharded":
            raise ValueError(f"--higgs-sync sharded with --higgs-payload wide needs fp32 gradients (bucket {name} "
                             f"reduces {dtype}): take a blocked payload (bf16, int8, int4) or reduce in fp32")
        forms = tuple(form for form in forms if form != "sharded")
    instances = nodes is not None and nodes.instances
    if instances and forms:  # compressed across the instances only, whatever the sync mode
        forms = ("hierarchical",)
    candidates: dict[str, BucketPlan] = {}
    if "sparse" in forms:
        candidates["sparse"] = BucketPlan(numel, slots, config.min_param_numel, device, config.payload)
    if "sharded" in forms:
        candidates["sharded"] = ShardedPlan(numel, slots, config.min_param_numel, world, device, config.payload)
    if "agreed" in forms:
        candidates["agreed"] = AgreedPlan(numel, slots, config.min_param_numel, world, device, config.payload)
    hierarchy = nodes is not None and (config.sync == "hierarchical" or instances
                                       or (nodes.nodes > 1 and nodes.ranks_per_node > 1))
    piece = None
    if "hierarchical" in forms and hierarchy:  # select within this rank's slice of the node-reduced bucket
        lo, hi = slice_range(numel, nodes.ranks_per_node, nodes.local_index)
        candidates["hierarchical"] = BucketPlan(
            hi - lo, [ParamSlot(max(s.start, lo) - lo, min(s.end, hi) - lo) for s in slots
                      if s.end > lo and s.start < hi], config.min_param_numel, device, config.payload)
        piece = (min(lo, numel), min(hi, numel))  # a tiny bucket's last slice may start past its end
    return BucketPaths(name=name, numel=numel, dtype=dtype, candidates=candidates, slice=piece,
                       ranks_per_node=nodes.ranks_per_node if nodes is not None else 1, world=world,
                       distributed_optimizer=distributed_optimizer, nodes=nodes.nodes if nodes is not None else 1,
                       dense_bf16=config.dense_bf16 and bool(candidates) and not instances and dtype.itemsize > 2,
                       dense_int8=config.dense_int8 and bool(candidates) and not instances,
                       sum_density_factor=config.sum_density_factor,
                       instances=nodes.nodes if instances else 1)


def choose_form(bucket: BucketPaths, costs: LinkCosts, density: float) -> dict:
    """Under 'auto': keep the cheaper compressed form at ``density`` and drop the other plan.
    Returns what was decided, for the start-up log."""
    entry = {"bucket": bucket.name, "numel": bucket.numel, "path": "dense", "predicted_ms": {}}
    if bucket.candidates:
        predicted = predict(costs, bucket.shape(density, tuple(bucket.candidates)))
        form = cheapest(predicted, allowed=tuple(bucket.candidates))
        bucket.candidates = {form: bucket.candidates[form]}
        if form != "hierarchical":
            bucket.slice = None
        entry["path"] = cheapest(predicted, allowed=("dense", form)) if smaller_than_dense(bucket, density) else "dense"
        entry["predicted_ms"] = {path: round(seconds * 1e3, 3) for path, seconds in predicted.items()}
    return entry


def smaller_than_dense(bucket: BucketPaths, density: float) -> bool:
    """Whether the form at ``density`` puts fewer bytes on this rank's link than the bucket's
    dense step as it is sent, at this group's size (ring wire bytes, ``reduce.wire``)."""
    return bucket.form_wire(density) < bucket.dense_wire()


def path_at(bucket: BucketPaths, density: float, costs: LinkCosts | None) -> str:
    """The bucket's path at ``density``: dense when it has no form, or when its payload would not
    be smaller than the dense gradient (whatever the sync mode: a density ramp's early steps
    would otherwise send more than dense); else its form under 'sparse'/'hierarchical', and
    the cheaper of dense and its form under 'auto' (``costs`` given)."""
    form = bucket.form
    if form is None:
        return "dense"
    if density not in bucket.paths:
        if not smaller_than_dense(bucket, density):
            bucket.paths[density] = "dense"
        elif costs is None:
            bucket.paths[density] = form
        else:
            predicted = predict(costs, bucket.shape(density, (form,)))
            bucket.paths[density] = cheapest(predicted, allowed=("dense", form))
    return bucket.paths[density]
