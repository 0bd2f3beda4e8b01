"""What a checkpoint holds, as megatron-core sharded state dicts, and the shards it lists.

``TrainingState`` names what a save reads and a load restores (model chunks, optimizer, LR
schedule, counters, the higgs config): the checkpoint code takes it, never a trainer object
or an argparse namespace. ``sharded_training_state`` builds from it the dict
``dist_checkpointing`` saves and loads:

* ``model``: the model chunk's ``sharded_state_dict()`` (global shapes and offsets per tensor);
* ``optimizer``: Megatron's optimizer's, with the distributed optimizer's state in Megatron's
  ``fully_reshardable`` form (it can move to another TP/PP/DP layout; ``dp_reshardable``
  cannot), written by the DP ranks that hold it (``owner_written_optimizer_state``, below), plus, under
  ``--use-higgs``, each rank's error-feedback residuals, read from the HiggsDDP chunks
  (``residual_objects``: the keys ``HiggsOptimizer.sharded_state_dict`` gives them under Megatron-LM);
* ``rng``: each rank's RNG states (torch and Megatron's tracker), a per-rank object;
* plain values (iteration, consumed samples, LR schedule): the common part, rank 0 writes it.

Per-rank state (``rng``, residuals) belongs to one global rank of one layout. Policy on
``reshard``: it is not loaded; the RNG is reseeded from ``--seed`` and the iteration, and the
residuals start from zero (as at the start of training); a ``reshard_policy`` event says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..compat.rebind import rebound
from ..ddp import HiggsDDP
from .manifest import ShardRecord

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def torch_optimizers(optimizer) -> list:
    """(Megatron optimizer, torch optimizer) pairs of a possibly wrapped (``HiggsOptimizer``),
    possibly chained optimizer: where the state a checkpoint and the memory manager read lives."""
    inner = getattr(optimizer, "inner", optimizer)
    return [(m, m.optimizer) for m in getattr(inner, "chained_optimizers", [inner])]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])


@dataclass
class TrainingState:
    """What a checkpoint saves and restores. A load writes ``iteration`` and
    ``consumed_samples`` back here; the model, optimizer and schedule are restored in place."""

    model: list  # this rank's model chunks (DDP-wrapped)
    optimizer: Any  # a MegatronOptimizer, possibly HiggsOptimizer-wrapped
    scheduler: Any  # OptimizerParamScheduler
    iteration: int
    consumed_samples: int
    use_distributed_optimizer: bool
    higgs: dict | None = None  # the HiggsConfig, as the rank map records it; None without --use-higgs
    vocab: dict | None = None  # vocab.vocab_record: the true vocabulary size behind the padded rows


def prepare_fresh_optimizer_for_load(optimizer) -> None:
    """A fresh optimizer has no state for a checkpoint to fill. Megatron's ``init_state_fn``
    makes the moments; the distributed optimizer's ``state_dict`` (torch Adam, no TE/Apex)
    also reads a per-param ``step``, which the load then overwrites with the saved one."""
    for megatron_optimizer, torch_optimizer in torch_optimizers(optimizer):
        params = [p for g in torch_optimizer.param_groups for p in g["params"]]
        if any(len(torch_optimizer.state[p]) == 0 for p in params):
            megatron_optimizer.init_state_fn(torch_optimizer, megatron_optimizer.config)
            for p in params:
                state = torch_optimizer.state[p]
                if "exp_avg" in state:
                    state.setdefault("step", torch.tensor(0.0))


def untie_adam_steps(optimizer) -> None:
    """megatron-core 0.16.1 on torch Adam (no TE/Apex): ``DistributedOptimizer.load_state_dict``
    gives every param state the *same* ``step`` tensor, and torch Adam increments each param's
    step in place, so one optimizer step would advance it once per parameter and skew Adam's
    bias correction. Give each state its own copy."""
    for _, torch_optimizer in torch_optimizers(optimizer):
        for state in torch_optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


@contextlib.contextmanager
def tolerate_torch_adam_step():
    """megatron-core 0.16.1 on torch Adam (no TE/Apex): ``DistributedOptimizer.load_state_dict``
    puts ``step`` into every param state, then its fully_reshardable loader copies *every* state
    key from the checkpoint tensors, which hold ``step`` apart: KeyError. Within this scope the
    loader copies the keys the checkpoint has (``step`` is already set from the saved groups)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_present_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            if isinstance(value, torch.Tensor):  # as megatron-core 0.19's own: non-tensor state is not copied
                destination[key].copy_(value)

    with rebound((DistributedOptimizer, "_set_main_param_and_optimizer_states", set_present_states)):
        yield


def spread_model_writes(model_sd: dict, module: torch.nn.Module) -> None:
    """Model weights are replicated across DP, and megatron-core makes DP rank 0 the writer of
    all of them, so it writes far more than the others (and, saving in the background, slows
    the loop for longest). Give each weight to one DP rank instead, balancing bytes greedily,
    largest first: the same assignment on every DP rank, which holds the same keys and shapes.
    The experts' weights (``allreduce=False``) are replicated across the expert-data-parallel
    group instead, whose rank their replica ids carry: they are spread over that group. Only
    weights whose writer is DP rank 0 move; replica ids keep their other components."""
    expert_storage = {p.data_ptr() for p in module.parameters() if not getattr(p, "allreduce", True)}
    candidates = [v for v in nested_values(model_sd) if isinstance(v, ShardedTensor)
                  and isinstance(v.replica_id, tuple) and all(r == 0 for r in v.replica_id[:-1])]
    _spread([t for t in candidates if t.data.data_ptr() not in expert_storage],
            parallel_state.get_data_parallel_rank(with_context_parallel=True),
            parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    _spread([t for t in candidates if t.data.data_ptr() in expert_storage],
            parallel_state.get_expert_data_parallel_rank(), parallel_state.get_expert_data_parallel_world_size())


def _spread(tensors: list[ShardedTensor], dp_rank: int, dp_size: int) -> None:
    """Each of ``tensors`` (replicated over a group of ``dp_size``) to one rank of the group."""
    load = [0] * dp_size
    for tensor in sorted(tensors, key=lambda t: (-t.data.numel() * t.data.element_size(), t.key, t.global_offset)):
        writer = min(range(dp_size), key=lambda r: (load[r], r))
        load[writer] += tensor.data.numel() * tensor.data.element_size()
        tensor.replica_id = (*tensor.replica_id[:-1], (dp_rank - writer) % dp_size)


def residual_objects(model: list, loading: bool = False) -> list[ShardedObject]:
    """Each HiggsDDP chunk's error-feedback residuals, as this rank's object; ``loading``: the
    slots a load fills (no read of the residuals)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return [ShardedObject(f"higgs.residuals.chunk{index}", {} if loading else chunk.residual_state(), (world,),
                          (rank,), replica_id=0)
            for index, chunk in enumerate(c for c in model if isinstance(c, HiggsDDP))]


def sharded_training_state(training: TrainingState, is_loading: bool = False, per_rank: bool = True) -> dict:
    """The sharded state dict of ``training``; ``per_rank=False`` leaves out rng and residuals.
    It reads Megatron's optimizer itself, beneath any wrapper: optimizer state offloaded by the
    memory manager must be back first (a save's ``Runtime.checkpoint_phase`` brings it)."""
    chunk = training.model[0].module
    model_sd = chunk.sharded_state_dict()
    if not is_loading:
        spread_model_writes(model_sd, chunk)
    inner = getattr(training.optimizer, "inner", training.optimizer)  # Megatron's, without HiggsOptimizer
    with owner_written_optimizer_state():
        optimizer_sd = inner.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDING)
    state = {
        "model": model_sd,
        "optimizer": optimizer_sd,
        "scheduler": training.scheduler.state_dict(),
        "iteration": training.iteration,
        "consumed_samples": training.consumed_samples,
    }
    if per_rank:
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng"] = ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)
        residuals = residual_objects(training.model, loading=is_loading)
        if residuals:
            optimizer_sd["higgs_residuals"] = residuals
    return state


def saved_state(training: TrainingState) -> tuple[dict, list[ShardRecord]]:
    """What a save of ``training`` hands ``dist_checkpointing.save``, and the tensor shards this
    rank writes of it (the rank map's record)."""
    state = sharded_training_state(training)
    return state, shard_records(state)


def is_main_replica(replica_id) -> bool:
    """Whether a shard's replica id marks the copy its rank writes (every part 0)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def shard_records(state: dict, main_replica_only: bool = True) -> list[ShardRecord]:
    """The tensor shards in a sharded state dict (by default only those this rank writes)."""
    records = []
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            if main_replica_only and not is_main_replica(value.replica_id):
                continue
            if value.flattened_range is not None:
                raise ValueError(f"{value.key}: flattened shards are not supported (use fully_reshardable)")
            records.append(ShardRecord(key=value.key, global_shape=list(value.global_shape),
                                       global_offset=list(value.global_offset),
                                       local_shape=[1] * value.prepend_axis_num + list(value.local_shape)))
    return records


# The distributed optimizer's state in model space, written by the data-parallel ranks that hold it.
#
# Megatron's ``fully_reshardable`` format stores, for every model parameter of shape (X, Y), its
# optimizer tensors (``param``, ``exp_avg``, ``exp_avg_sq``) as ShardedTensors of shape (X, Y)
# with the parameter's own TP/PP global offsets: any TP/PP/DP layout can load it. To build it,
# megatron-core 0.16.1 gathers *every* DP rank's whole optimizer shard onto every DP rank
# (``get_parameter_state_dp_zero``) and DP rank 0 writes it all. That gather is what makes its
# save slow to start (``docs/checkpoints.md``), and on the tied embedding of the last pipeline
# stage it reads past the buffer's unpadded end and pads with zeros.
#
# The same checkpoint keys, shapes and offsets need much less. A DP rank already holds, for most
# parameters it touches, the whole parameter's state: it writes those itself, as the main replica.
# Only a parameter that straddles two DP ranks' ranges is held in pieces; those pieces (at most
# DP - 1 parameters per bucket) are exchanged within the DP group, and the rank holding the
# parameter's first element writes the joined tensor. Every piece of state is written exactly
# once, writes are spread over the DP ranks, and the files are Megatron's ``fully_reshardable``
# format (its loader reads them). For loading, each rank asks for the whole tensors of the
# parameters it holds a piece of, without Megatron's DP-world-sized buffers (and their warning).

PREFIX = "optimizer.state"


def _local_states(optimizer, model_param) -> dict[str, torch.Tensor]:
    """This rank's flat piece of each optimizer tensor of ``model_param`` (``step`` lives in the
    param groups, as in Megatron's format)."""
    return {key: value.detach().reshape(-1)
            for key, value in optimizer._get_main_param_and_optimizer_states(model_param).items()
            if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0}


def _replica_id(replica_id, key: str, owner: bool):
    """The model parameter's replica id with its data-parallel component (the last) replaced:
    0 on the DP rank that holds the parameter's first element (the owner), 1 elsewhere."""
    if not isinstance(replica_id, tuple):
        raise ValueError(f"{key}: expected a (pp, tp, dp) replica id, got {replica_id!r}")
    return (*replica_id[:-1], 0 if owner else 1)


def owner_param_state(optimizer, model_sharded_state_dict, is_loading: bool = False) -> dict[int, dict]:
    """``DistributedOptimizer.sharded_param_state_fully_reshardable`` without the all-DP gather
    (see the module docstring). Saving: collective over the optimizer's DP group. Loading: every
    rank asks for the whole tensors of the parameters it holds any piece of, as Megatron's loader
    expects, without allocating the DP world's buffers."""
    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata = {sh.data: sh for sh in nested_values(model_sd)}
    whole: dict[int, tuple[torch.nn.Parameter, dict[str, torch.Tensor], bool]] = {}
    pieces: list[tuple[int, int, dict[str, torch.Tensor]]] = []
    index = -1
    params = {}
    for gbuf_idx, gbuf_range_maps in enumerate(optimizer.gbuf_ranges):
        for bucket_maps in gbuf_range_maps.values():
            local = ChainMap(*(bucket_map["param_map"] for bucket_map in bucket_maps))
            # The buffer's own order: the same on every DP rank, and the one Megatron's loader uses.
            for model_param in optimizer.buffers[gbuf_idx].param_index_map:
                index += 1
                params[index] = model_param
                if model_param not in local:
                    continue
                held = local[model_param]["param"]
                states = _local_states(optimizer, model_param)
                if is_loading:
                    whole[index] = (model_param, {k: torch.empty(model_param.numel(), dtype=v.dtype, device=v.device)
                                                  for k, v in states.items()}, held.start == 0)
                elif held.start == 0 and held.end == model_param.numel():
                    whole[index] = (model_param, states, True)
                else:
                    pieces.append((index, held.start, states))

    if not is_loading:
        _join_pieces(optimizer.data_parallel_group, pieces, params, whole)
    return _sharded(whole, metadata, _in_first_instance())


def _in_first_instance() -> bool:
    """Whether this rank is in the first distributed-optimizer instance. With several, every
    instance holds the whole optimizer state (its DP group is the instance's): the first's
    owners write it, and the others' are replicas."""
    group = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    return group is None or dist.get_rank(group) == 0


def _join_pieces(group, pieces: list, params: dict, whole: dict) -> None:
    """Send the pieces of parameters that straddle DP ranks to the rank holding each one's first
    element, which joins them into ``whole``. Only (index, start, length) is all-gathered; the
    tensors travel point to point, each once."""
    world = dist.get_world_size(group)
    layout: list = [None] * world
    dist.all_gather_object(layout, [(index, start, next(iter(states.values())).numel())
                                    for index, start, states in pieces], group=group)
    holders: dict[int, list[tuple[int, int, int]]] = {}  # index -> [(start, length, group rank)]
    for group_rank, rank_pieces in enumerate(layout):
        for index, start, length in rank_pieces:
            holders.setdefault(index, []).append((start, length, group_rank))
    me = dist.get_rank(group)
    mine = {index: states for index, _, states in pieces}
    operations, received = [], {}
    for index in sorted(holders):
        parts = sorted(holders[index])
        owner = parts[0][2]
        if me not in (p[2] for p in parts):
            continue
        keys = sorted(mine[index])
        for start, length, holder in parts[1:]:
            if me == holder:
                operations += [dist.P2POp(dist.isend, mine[index][k].contiguous(),
                                          dist.get_global_rank(group, owner), group) for k in keys]
            elif me == owner:
                buffers = {k: torch.empty(length, dtype=mine[index][k].dtype, device=mine[index][k].device)
                           for k in keys}
                received.setdefault(index, []).append((start, buffers))
                operations += [dist.P2POp(dist.irecv, buffers[k], dist.get_global_rank(group, holder), group)
                               for k in keys]
    if operations:
        for request in dist.batch_isend_irecv(operations):
            request.wait()
    for index, parts in received.items():
        parts = sorted([(0, mine[index]), *parts], key=lambda part: part[0])
        states = {key: torch.cat([part[1][key] for part in parts]) for key in parts[0][1]}
        model_param = params[index]
        numel = next(iter(states.values())).numel()
        if numel != model_param.numel():
            raise RuntimeError(f"optimizer state of parameter {index}: DP pieces hold {numel} of "
                               f"{model_param.numel()} elements")
        whole[index] = (model_param, states, True)


def _sharded(whole: dict, metadata: dict, first_instance: bool) -> dict[int, dict]:
    """ShardedTensors with the model parameter's key, global shape and offsets."""
    model_space_state = {}
    for index, (model_param, states, owner) in sorted(whole.items()):
        try:
            sharded = metadata[model_param]
        except KeyError:
            raise ValueError(f"parameter {index} of the distributed optimizer is not in the model's "
                             "sharded state dict (build it with keep_vars=True)") from None
        tensors = {}
        for key, value in states.items():
            data = value.view(sharded.data.shape)
            replace = dict(key=f"{PREFIX}.{key}.{sharded.key}", data=data, dtype=data.dtype,
                           replica_id=_replica_id(sharded.replica_id, sharded.key, owner and first_instance))
            if isinstance(sharded, ShardedTensorFactory):
                replace.pop("dtype")
            tensors[key] = dataclasses.replace(sharded, **replace)
            tensors[key].validate_metadata_integrity()
        model_space_state[index] = tensors
    return model_space_state


@contextlib.contextmanager
def owner_written_optimizer_state() -> Iterator[None]:
    """Within this scope, ``fully_reshardable`` state of a ``DistributedOptimizer`` is built by
    :func:`owner_param_state`, for saving and loading; Megatron's loader then fills it in.
    Saving also skips the ``gc.collect()`` megatron-core runs after its gather: it takes the
    loop's time, and nothing it would collect is allocated here."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_state_dict = DistributedOptimizer.sharded_state_dict

    def sharded_param_state(self, model_sharded_state_dict, is_loading=False, metadata=None):
        return owner_param_state(self, model_sharded_state_dict, is_loading)

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, sharding_type=None, metadata=None):
        fully = (metadata or {}).get("distrib_optim_sharding_type") == "fully_reshardable"
        if is_loading or sharding_type is not None or not fully or self.ddp_config.use_megatron_fsdp:
            return original_state_dict(self, model_sharded_state_dict or {}, is_loading, sharding_type, metadata)
        state_dict = self.state_dict()  # param groups and scaler: the common part, as megatron-core's
        state_dict["param_state"] = owner_param_state(self, model_sharded_state_dict)
        state_dict["param_state_sharding_type"] = "fully_reshardable"
        return state_dict

    with rebound((DistributedOptimizer, "sharded_param_state_fully_reshardable", sharded_param_state),
                 (DistributedOptimizer, "sharded_state_dict", sharded_state_dict)):
        yield
