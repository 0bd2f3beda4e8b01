"""Joining torch's fake process group of P ranks: Megatron builds its buffers, buckets and
shards as at P ranks, in one process, and no collective moves data.

Shared by ``project_wire.py`` (wire bytes at P up to 1,024) and ``virtual_dp.py`` (loss at
large P), each run in a process of its own: the fake group becomes the default group.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def fake_group(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake group of ``world_size`` ranks (backend ``fake``: every
    collective returns at once and moves nothing), torch's and Megatron's; left on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    new_group = dist.new_group

    def fake_new_group(*args, **kwargs):  # Megatron asks for some groups on gloo: the fake backend serves all
        kwargs.pop("backend", None)
        return new_group(*args, **kwargs)

    dist.new_group = fake_new_group
    try:
        yield
    finally:
        dist.new_group = new_group
        if dist.is_initialized():
            dist.destroy_process_group()
