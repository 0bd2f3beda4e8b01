"""Saving, synchronously: every rank writes its shard and hashes it, then ``commit``.

Protocol (all ranks call ``save_checkpoint`` at the same iteration):

1. ``commit.begin``: rank 0 removes leftovers of interrupted saves (``*.tmp``) and makes
   ``iter_NNNNNNN.tmp``.
2. Every rank hands its sharded state to ``dist_checkpointing.save`` (torch_dist): its own
   ``__<rank>_*.distcp`` files; rank 0 also the common files. A write error on any rank is
   raised on every rank by megatron-core's result exchange.
3. Every rank hashes the files it wrote and lists the shards it held; ``commit.commit``
   gathers them and, only if no rank failed, writes the rank map, renames the directory and
   moves ``latest`` (see ``commit``).

A crash at any point before the commit leaves ``latest`` naming the previous checkpoint;
the half-written ``.tmp`` directory is never loaded and is removed by the next save.

``async_save.AsyncCheckpointer`` runs step 2's writing and hashing in the background and step
3 once every rank's writer is done.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
# torch's checkpoint failure is a BaseException: name it, or it escapes the commit protocol.
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException

from megatron.core import dist_checkpointing

from .commit import PendingCheckpoint, SaveResult, begin, commit, common_files, hash_files, shard_files
from .commit import current_layout
from .state import TrainingState, shard_records, sharded_training_state


def pending_checkpoint(training: TrainingState, save_dir: str | Path, keep_last: int | None) -> PendingCheckpoint:
    """The rank map's view of ``training`` now, for a save into ``save_dir``."""
    return PendingCheckpoint(iteration=training.iteration, consumed_samples=training.consumed_samples,
                             layout=current_layout(training.use_distributed_optimizer), higgs=training.higgs,
                             save_dir=Path(save_dir), keep_last=keep_last)


_crc32_lock = threading.Lock()
_crc32_users = 0
_crc32_before = True


@contextmanager
def crc32_skipped() -> Iterator[None]:
    """``torch.save`` without its per-record CRC32 while inside (torch's own switch,
    ``torch.serialization.set_crc32_options``). The files load as before with
    torch, which never reads the CRC32 (a flipped byte in a tensor loads silently); zip tools
    such as ``unzip -t`` report the zeros as mismatches.

    Why: every shard file is hashed with SHA-256 into the rank map and checked before
    anything is loaded, so the zip records' CRC32 is a second, unread checksum of the same bytes.
    Skipping it halves ``torch.save``'s CPU time (``docs/experiments/checkpoint_writer.md``), on
    every rank and every save (an asynchronous save's writer takes that time from the training
    ranks when they use every core). The
    switch is process-wide: while an asynchronous save writes, a ``torch.save`` on another
    thread skips CRC32 too, and a change made to the switch meanwhile is undone when the last
    user leaves and restores the value it found."""
    global _crc32_users, _crc32_before
    with _crc32_lock:
        if _crc32_users == 0:
            _crc32_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32_users += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_users -= 1
            if _crc32_users == 0:
                torch.serialization.set_crc32_options(_crc32_before)


def save_checkpoint(training: TrainingState, save_dir: str | Path, keep_last: int | None = None) -> SaveResult:
    """Save ``training`` as a committed checkpoint, synchronously (see the module docstring)."""
    pending = begin(pending_checkpoint(training, save_dir, keep_last))
    rank = dist.get_rank()
    state = sharded_training_state(training)
    shards = shard_records(state)
    error, files = None, []
    try:
        with crc32_skipped():
            dist_checkpointing.save(state, str(pending.directory))
        files = hash_files(shard_files(rank, pending.directory) + common_files(rank, pending.directory))
    except (Exception, DcpCheckpointException) as exc:  # noqa: BLE001 - reported below, on every rank
        error = f"rank {rank}: {type(exc).__name__}: {first_line(exc)}"
    return commit(pending, shards, files, error)


def first_line(error: BaseException) -> str:
    """torch's CheckpointException carries each failing rank's traceback; keep the errors."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return "; ".join(errors) or (lines[0] if lines else type(error).__name__)
