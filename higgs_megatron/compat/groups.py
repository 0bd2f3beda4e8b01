"""Where megatron-core holds its process groups, and putting new ones in their place.

After a given-up sync the data-parallel groups are rebuilt (``stability.regroup``), and every
reference Megatron holds to an old group must then name the new one. megatron-core keeps them
as plain attributes: module globals of ``parallel_state`` (0.19 adds aliases of the DP groups
there, ``..._WITH_GTP_REMAT``, which are the same objects and so are replaced with them), and
attributes of the DDP chunk, its buffers and bucket groups (``HiggsDDP.group_holders``) and
of the Megatron optimizers. Replaced by identity: an attribute whose value *is* an old group,
or a list's element or a dict's value that is (``parallel_state._global_process_group_list``,
every group Megatron made, which it destroys at the end). The model's modules also hold their
groups in ``ProcessGroupCollection`` objects (``pg_collection``), whose attributes are replaced
the same way, as are the distributed optimizer's own bucket groups (``per_model_bucket_groups``,
which gather the updated parameters over the data-parallel group).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist


def group_holders(chunks: Iterable[Any], optimizers: Iterable[Any]) -> list[Any]:
    """The objects whose attributes hold the process groups of ``chunks`` (HiggsDDP) and ``optimizers``."""
    import megatron.core.parallel_state as parallel_state

    chunks, optimizers = list(chunks), list(optimizers)
    collections = {id(found): found for chunk in chunks for module in chunk.modules()
                   if (found := vars(module).get("pg_collection")) is not None}
    # The distributed optimizer's own bucket groups, for the parameters' all-gather
    gathers = {id(group): group for optimizer in optimizers
               for groups in (vars(optimizer).get("per_model_bucket_groups") or {}).values() for group in groups}
    return ([parallel_state] + [holder for chunk in chunks for holder in chunk.group_holders()] + optimizers
            + list(collections.values()) + list(gathers.values()))


def replace_groups(holders: Iterable[Any], replacement: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]]) -> None:
    """Every attribute of ``holders`` that is an old group (``replacement``: id -> (old, new))
    now holds its new one."""
    def swapped(value: Any) -> Any:
        old, new = replacement.get(id(value), (None, None))
        return new if value is old else value

    for holder in holders:
        for name, value in list(vars(holder).items()):
            if isinstance(value, list):
                value[:] = [swapped(item) for item in value]
            elif isinstance(value, dict) and not name.startswith("__"):
                value.update({key: swapped(item) for key, item in value.items()})
            elif swapped(value) is not value:
                setattr(holder, name, swapped(value))


def backend_options(group: dist.ProcessGroup):
    """The options ``group``'s backend was made with (its timeout; on NCCL its configuration
    and stream priority), read from the backend of the device it serves."""
    device = torch.device("cuda" if group._get_backend_name() == "nccl" else "cpu")  # an aborted group's too
    return group._get_backend(device).options


def group_timeout(group: dist.ProcessGroup) -> float:
    """Seconds after which a collective of ``group`` gives up."""
    return backend_options(group)._timeout.total_seconds()
