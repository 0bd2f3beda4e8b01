"""Where megatron-core holds its process groups, and putting new ones in their place.

After a given-up sync the data-parallel groups are rebuilt (``stability.regroup``), and every
reference Megatron holds to an old group must then name the new one. megatron-core keeps them
as plain attributes: module globals of ``parallel_state`` (0.19 adds aliases of the DP groups
there, ``..._WITH_GTP_REMAT``, which are the same objects and so are replaced with them), and
attributes of the DDP chunk, its buffers and bucket groups (``HiggsDDP.group_holders``) and
of the Megatron optimizers. Replaced by identity: an attribute whose value *is* an old group.
Groups held elsewhere (0.19's ``ProcessGroupCollection`` objects) are not reached.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch.distributed as dist


def group_holders(chunks: Iterable[Any], optimizers: Iterable[Any]) -> list[Any]:
    """The objects whose attributes hold the process groups of ``chunks`` (HiggsDDP) and ``optimizers``."""
    import megatron.core.parallel_state as parallel_state

    return [parallel_state] + [holder for chunk in chunks for holder in chunk.group_holders()] + list(optimizers)


def replace_groups(holders: Iterable[Any], replacement: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]]) -> None:
    """Every attribute of ``holders`` that is an old group (``replacement``: id -> (old, new))
    now holds its new one."""
    for holder in holders:
        for name, value in list(vars(holder).items()):
            old, new = replacement.get(id(value), (None, None))
            if value is old:
                setattr(holder, name, new)
