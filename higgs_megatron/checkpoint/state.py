"""What a checkpoint holds, as megatron-core sharded state dicts, and the shards it lists.

``TrainingState`` names what a save reads and a load restores (model chunks, optimizer, LR
schedule, counters, the higgs config): the checkpoint code takes it, never a trainer object
or an argparse namespace. ``sharded_training_state`` builds from it the dict
``dist_checkpointing`` saves and loads:

* ``model``: the model chunk's ``sharded_state_dict()`` (global shapes and offsets per tensor);
* ``optimizer``: the optimizer's, with the distributed optimizer's state in Megatron's
  ``fully_reshardable`` form (it can move to another TP/PP/DP layout; ``dp_reshardable``
  cannot), written by the DP ranks that hold it (``optimizer_shards``), plus, under
  HiggsOptimizer, each rank's error-feedback residuals;
* ``rng``: each rank's RNG states (torch and Megatron's tracker), a per-rank object;
* plain values (iteration, consumed samples, LR schedule): the common part, rank 0 writes it.

Per-rank state (``rng``, residuals) belongs to one global rank of one layout. Policy on
``reshard``: it is not loaded; the RNG is reseeded from ``--seed`` and the iteration, and the
residuals start from zero (as at the start of training); a ``reshard_policy`` event says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from ..optimizer import torch_optimizers
from .manifest import ShardRecord
from .optimizer_shards import owner_written_optimizer_state

SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


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
            destination[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_present_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def spread_model_writes(model_sd: dict, dp_rank: int, dp_size: int) -> None:
    """Model weights are replicated across DP, and megatron-core makes DP rank 0 the writer of
    all of them, so it writes far more than the others (and, saving in the background, slows
    the loop for longest). Give each weight to one DP rank instead, balancing bytes greedily,
    largest first: the same assignment on every DP rank, which holds the same keys and shapes.
    Only weights whose writer is DP rank 0 move; replica ids keep their other components."""
    candidates = [v for v in nested_values(model_sd) if isinstance(v, ShardedTensor)
                  and isinstance(v.replica_id, tuple) and all(r == 0 for r in v.replica_id[:-1])]
    load = [0] * dp_size
    for tensor in sorted(candidates, key=lambda t: (-t.data.numel() * t.data.element_size(), t.key,
                                                     t.global_offset)):
        writer = min(range(dp_size), key=lambda r: (load[r], r))
        load[writer] += tensor.data.numel() * tensor.data.element_size()
        tensor.replica_id = (*tensor.replica_id[:-1], (dp_rank - writer) % dp_size)


def sharded_training_state(training: TrainingState, is_loading: bool = False, per_rank: bool = True) -> dict:
    """The sharded state dict of ``training``; ``per_rank=False`` leaves out rng and residuals."""
    chunk = training.model[0].module
    model_sd = chunk.sharded_state_dict()
    if not is_loading:
        spread_model_writes(model_sd, parallel_state.get_data_parallel_rank(with_context_parallel=True),
                            parallel_state.get_data_parallel_world_size(with_context_parallel=True))
    with owner_written_optimizer_state():
        optimizer_sd = training.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=SHARDING)
    if not per_rank:
        optimizer_sd.pop("higgs_residuals", None)
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
    return state


def _is_main_replica(replica_id) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


def shard_records(state: dict, main_replica_only: bool = True) -> list[ShardRecord]:
    """The tensor shards in a sharded state dict (by default only those this rank writes)."""
    records = []
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            if main_replica_only and not _is_main_replica(value.replica_id):
                continue
            if value.flattened_range is not None:
                raise ValueError(f"{value.key}: flattened shards are not supported (use fully_reshardable)")
            records.append(ShardRecord(key=value.key, global_shape=list(value.global_shape),
                                       global_offset=list(value.global_offset),
                                       local_shape=[1] * value.prepend_axis_num + list(value.local_shape)))
    return records
