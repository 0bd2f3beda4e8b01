"""Process groups for a training job: the default group, then Megatron's model-parallel groups (the expert ones included).

``init_parallel`` is what Megatron-LM's ``initialize_megatron`` does for the pieces this
project needs: ``torch.distributed`` from the launcher's environment (torchrun sets
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), then
``parallel_state.initialize_model_parallel`` with the tensor and pipeline sizes, then the
model-parallel RNG seeds (distinct per TP rank for dropout, identical across DP ranks),
which ``set_seeds`` resets before each model is built.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from ..launcher import attempt_store


def init_parallel(backend: str, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                  timeout_minutes: float = 10.0, num_distributed_optimizer_instances: int = 1,
                  expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> None:
    if not dist.is_initialized():
        if torch.cuda.is_available():  # before anything allocates on a device: this rank's GPU, not GPU 0
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, timeout=timeout, **attempt_store(timeout))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )


def set_seeds(seed: int) -> None:
    """Seed the default generator and Megatron's model-parallel RNG tracker (reset first)."""
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
