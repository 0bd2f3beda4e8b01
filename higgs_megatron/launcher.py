"""What the launcher says of this process: its rank and world size (torchrun's ``RANK`` and
``WORLD_SIZE``, read before any process group exists), and torchrun's agent store, scoped to
this attempt of the job."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def launcher_rank() -> int:
    """This process's rank as the launcher gave it (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def launcher_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_rank() -> int:
    """The default group's rank once it exists, else the launcher's."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else launcher_rank()


def store_outlives_ranks() -> bool:
    """Whether the job's store is torchrun's agent's (it outlives every rank), not rank 0's."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(timeout: datetime.timedelta) -> dict:
    """Under torchrun's agent store, a store scoped to this attempt of the job.

    The agent's TCPStore outlives a restart (``--max-restarts``), and torch 2.13's env://
    rendezvous adds no attempt prefix, so the restarted workers' ``new_group`` rendezvous read
    the dead workers' gloo addresses and fail ("connectFullMesh ... Connection refused").
    Prefixing every key with the restart count gives each attempt its own keys."""
    if not store_outlives_ranks():
        return {}
    rank, world_size = launcher_rank(), launcher_world_size()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"/higgs/attempt_{attempt}/", store), "rank": rank, "world_size": world_size}
