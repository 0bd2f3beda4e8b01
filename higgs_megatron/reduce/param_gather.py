"""The distributed optimizer's parameter all-gather, counted, and sent as an error-compensated change.

With Megatron's distributed optimizer each data-parallel rank updates its own shard of every
bucket, copies it into the bucket's parameter buffer, and an all-gather brings every shard to
every rank (``_ParamAndGradBucketGroup.start_param_sync``). That is as many wire bytes as the
gradient's reduce-scatter with fp32 parameters, half as many with bf16: once the gradient is
compressed, most of what is left. ``HiggsBucketGroup`` issues it here, through the sync's
``Collectives``, so the meter counts it whatever form it takes.

Sent as a change (``--higgs-param-payload int8|int4|sign``): every rank keeps ``agreed``, its
own shard as every rank holds it. A step's owner sends ``new - agreed`` as the agreed form's rows
(``compress.agreed.pack_rows``: a scale per ``SPAN`` parameters and int8/int4 codes or signs) in one
all-gather; every rank decodes every owner's row and adds it to its copy of that shard, the owner
to ``agreed``: the same fp32 add of the same bytes to the same values, so the parameters stay
bitwise equal on every rank. Nothing is lost to the rounding: the main parameters keep the exact
value, and the next change is taken from ``agreed``, so the model's parameters trail the main
ones by one step's rounding at most (error feedback through the reference, as ZeRO++'s
quantized weights do not have). It needs the main parameters apart from the buffer: fp32
parameters, whose main copy Megatron makes a view of the buffer, are given a copy of their own
by the optimizer wrapper (``separate_fp32_main_params``), which then turns this on.

Dense (Megatron's own all-gather, counted): a run's first sync (the ranks' parameters need not
be equal before it), a forced one (Megatron's ``force_sync``: a disabled pre-hook), where no
main parameters apart exist, and with payload ``dense``. After each, ``agreed`` is the shard as
gathered. After a checkpoint load, ``agreed`` is read from the loaded buffers before the next
step (``reread``), so a resumed run sends the same changes as the run it resumes.

Stream order (CUDA): the change is taken and packed on the current stream after the optimizer's
copy, the all-gather is launched asynchronously (NCCL's stream waits for the current one), and
``wait`` (Megatron's ``finish_param_sync``, or at once without ``overlap_param_gather``) makes
the current stream wait for it and queues the decoding after it, before the forward reads the
parameters. Nothing reads a device value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..compress.agreed import pack_rows, row_nbytes, row_width, unpack_rows
from .wire import Collectives, wire_bytes

PARAM_PAYLOADS = ("dense", "int8", "int4", "sign")
# Parameters per fp32 scale. Adam's steps are heavy-tailed (a rare token's row moves far while
# its span barely moves): a scale per 256 let int4 end 3.5% above dense's loss at P = 2 where
# one per 64 ended within 1% (``docs/compression.md``), for an eighth of a bit more a parameter.
SPAN = 64


def param_gather_wire(param_bytes: int, world: int) -> float:
    """Ring wire bytes per rank of Megatron's dense parameter all-gather of a bucket of ``param_bytes``."""
    return wire_bytes("all_gather", param_bytes // max(world, 1), world)


def change_row_bytes(shard: int, payload: str) -> int:
    """Bytes of one owner's row for a shard of ``shard`` parameters in ``payload``'s format."""
    return row_nbytes(row_width(shard, payload), payload, SPAN, torch.float32)


@dataclass
class ParamChanges:
    """Per bucket of a bucket group, this rank's shard as every rank holds it (None: not known
    since the last dense gather, so the next one is dense)."""

    payload: str  # PARAM_PAYLOADS other than 'dense'
    agreed: list[torch.Tensor | None] = field(default_factory=list)
    reloaded: bool = False  # a load wrote the parameters: ``agreed`` is read again before the next step

    @property
    def ready(self) -> bool:
        """Whether every bucket's shard as every rank holds it is known (a change can be sent): a
        look at the host's list, no device value read."""
        return len(self.agreed) > 0 and all(agreed is not None for agreed in self.agreed)

    def forget(self) -> None:
        """A load wrote the parameters (the same on every rank: a checkpoint's model state is
        replicated over the data-parallel group): what every rank holds is read again, from the
        buffers, before the next optimizer step overwrites this rank's shard (``reread``)."""
        self.agreed = [None] * len(self.agreed)
        self.reloaded = True

    def reread(self, param_buffers: list[torch.Tensor], world: int, rank: int) -> None:
        """Before an optimizer step (as the gradient sync finishes): after a load, each shard as
        the buffers hold it."""
        if self.reloaded:
            keep_agreed(self, param_buffers, world, rank)
            self.reloaded = False


class PendingParamGather:
    """What ``param_gather_handle`` holds: the bucket group's all-gathers in flight. ``wait``
    finishes them and, for a change, writes every shard."""

    def __init__(self, works: list[Any], finishers: list[Callable[[], None]]) -> None:
        self.works, self.finishers = works, finishers

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()
        for finish in self.finishers:
            finish()
        self.works, self.finishers = [], []


def own_shard(buffer: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's shard of a bucket's buffer, as Megatron's ``shard_buffer`` cuts it."""
    flat = buffer.view(-1)
    shard = flat.numel() // world
    return flat.narrow(0, rank * shard, shard)


def keep_agreed(changes: ParamChanges, param_buffers: list[torch.Tensor], world: int, rank: int) -> None:
    """With a dense all-gather launched: each bucket's own shard is what every rank will hold
    (an all-gather's input is final when it is launched)."""
    for idx, buffer in enumerate(param_buffers):
        mine = own_shard(buffer, world, rank)
        if changes.agreed[idx] is None:
            changes.agreed[idx] = mine.detach().clone()
        else:
            changes.agreed[idx].copy_(mine)


def start_param_changes(comm: Collectives, group: dist.ProcessGroup, param_buffers: list[torch.Tensor],
                        changes: ParamChanges, async_op: bool) -> PendingParamGather:
    """All-gather every bucket's shards of ``param_buffers`` (Megatron's equal shards, one per
    rank of ``group``) as changes from ``changes.agreed`` (see the module docstring)."""
    world, rank = dist.get_world_size(group), comm.rank(group)
    works, finishers = [], []
    for buffer, agreed in zip(param_buffers, changes.agreed):
        flat, mine = buffer.view(-1), own_shard(buffer, world, rank)
        shard = mine.numel()
        width = row_width(shard, changes.payload)
        real = torch.zeros(1, width, dtype=torch.bool, device=flat.device)
        real.narrow(1, 0, shard).fill_(True)
        change = torch.zeros(1, width, dtype=torch.float32, device=flat.device)
        change.narrow(1, 0, shard).copy_(mine).sub_(agreed)
        row, _ = pack_rows(change, changes.payload, SPAN, real)
        rows = torch.empty(world, row.shape[1], dtype=row.dtype, device=row.device)
        works.append(comm.all_gather(rows, row, group, async_op=async_op))
        finishers.append(_apply_changes(changes.payload, rows, real, flat, shard, width, world, rank, agreed))
    return PendingParamGather(works, finishers)


def _apply_changes(payload: str, rows: torch.Tensor, real: torch.Tensor, flat: torch.Tensor, shard: int, width: int,
                   world: int, rank: int, agreed: torch.Tensor):
    def finish() -> None:
        decoded = unpack_rows(rows, payload, width, SPAN, torch.float32, real.expand(world, width))
        shards = flat.view(world, shard)
        shards.select(0, rank).copy_(agreed)  # the owner's copy was the new value: back to what the others hold
        shards.add_(decoded.narrow(1, 0, shard))  # in fp32, rounded once to the parameters' dtype
        agreed.copy_(shards.select(0, rank))
    return finish
