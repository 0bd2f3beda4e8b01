"""The distributed optimizer's state in model space, written by the data-parallel ranks that hold it.

Megatron's ``fully_reshardable`` format stores, for every model parameter of shape (X, Y), its
optimizer tensors (``param``, ``exp_avg``, ``exp_avg_sq``) as ShardedTensors of shape (X, Y)
with the parameter's own TP/PP global offsets: any TP/PP/DP layout can load it. To build it,
megatron-core 0.16.1 gathers *every* DP rank's whole optimizer shard onto every DP rank
(``get_parameter_state_dp_zero``) and DP rank 0 writes it all. That gather is what makes its
save slow to start (23% of a synchronous save stalls the loop, against 2% for
``dp_reshardable``), and on the tied embedding of the last pipeline stage it reads past the
buffer's unpadded end and pads with zeros.

The same checkpoint keys, shapes and offsets need much less. A DP rank already holds, for most
parameters it touches, the whole parameter's state: it writes those itself, as the main replica.
Only a parameter that straddles two DP ranks' ranges is held in pieces; those pieces (at most
DP - 1 parameters per bucket) are exchanged within the DP group, and the rank holding the
parameter's first element writes the joined tensor. Every piece of state is written exactly
once, writes are spread over the DP ranks, and the files are Megatron's ``fully_reshardable``
format (its loader reads them). For loading, each rank asks for the whole tensors of the
parameters it holds a piece of, without Megatron's DP-world-sized buffers (and their warning).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import ChainMap
from typing import Iterator

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

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
    return _sharded(whole, metadata)


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


def _sharded(whole: dict, metadata: dict) -> dict[int, dict]:
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
                           replica_id=_replica_id(sharded.replica_id, sharded.key, owner))
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
    Saving also skips the ``gc.collect()`` megatron-core runs after its gather (half a second
    of the loop's time on a 13M-parameter model, for nothing allocated here)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_param_state = DistributedOptimizer.sharded_param_state_fully_reshardable
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

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state
    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    try:
        yield
    finally:
        DistributedOptimizer.sharded_param_state_fully_reshardable = original_param_state
        DistributedOptimizer.sharded_state_dict = original_state_dict
