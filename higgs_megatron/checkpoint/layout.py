"""The running job's layout and this rank's place in it, as the rank map records them.

Both front-ends (our pretrain loop and the Megatron-LM patches) describe a checkpoint with
these two functions, read from megatron-core's ``parallel_state`` at the moment of the save
or load.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron.core import parallel_state

from .manifest import Layout


def current_layout(use_distributed_optimizer: bool) -> Layout:
    return Layout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_distributed_optimizer=use_distributed_optimizer,
    )


def current_coords() -> dict[str, int]:
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank()}
