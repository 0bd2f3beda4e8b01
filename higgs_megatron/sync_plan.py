"""Per-bucket planning for the compressed sync, at construction: no process group, no Megatron.
It makes each bucket's ``grad_paths.BucketPaths``, which picks and launches a path each step.

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
target density; then ``grad_paths.path_at`` gives the path of each step (``dense`` or the form), from the
agreed link costs, cached per density. Under every mode a step whose form would put no fewer
bytes on this rank's link than the dense step, at this group's size, goes dense (the early steps of
a density ramp; the all-gather of a large group). Every input is
the same on every DP peer, so every peer plans the same paths and issues the same collectives
with the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compress.agreed import AgreedPlan
from .compress.compressor import BucketPlan, ParamSlot
from .compress.sharded import ShardedPlan
from .config import HiggsConfig
from .cost_model import LinkCosts, cheapest, predict
from .grad_paths import BucketPaths
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
             "sharded": ("sharded",), "hierarchical": ("hierarchical",),
             "onebit": ("agreed",)}.get(config.sync, ()) if compressible else ()
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
        candidates["agreed"] = AgreedPlan(numel, slots, config.min_param_numel, world, device, config.payload,
                                          scored=config.compression_ratio < 1.0)
    hierarchy = nodes is not None and (config.sync == "hierarchical" or instances
                                       or (nodes.nodes > 1 and nodes.ranks_per_node > 1))
    piece = None
    if "hierarchical" in forms and hierarchy:  # select within this rank's slice of the node-reduced bucket
        lo, hi = slice_range(numel, nodes.ranks_per_node, nodes.local_index)
        candidates["hierarchical"] = BucketPlan(
            hi - lo, [ParamSlot(max(s.start, lo) - lo, min(s.end, hi) - lo, s.whole) for s in slots
                      if s.end > lo and s.start < hi], config.min_param_numel, device, config.payload)
        piece = (min(lo, numel), min(hi, numel))  # a tiny bucket's last slice may start past its end
    return BucketPaths(name=name, numel=numel, dtype=dtype, candidates=candidates, slice=piece,
                       ranks_per_node=nodes.ranks_per_node if nodes is not None else 1, world=world,
                       distributed_optimizer=distributed_optimizer,
                       gather_moment=distributed_optimizer and config.first_moment_exchange, nodes=nodes.nodes if nodes is not None else 1,
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
        entry["path"] = cheapest(predicted, allowed=("dense", form)) if bucket.smaller_than_dense(density) else "dense"
        entry["predicted_ms"] = {path: round(seconds * 1e3, 3) for path, seconds in predicted.items()}
    return entry
