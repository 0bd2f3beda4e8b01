"""Writing a checkpoint and committing it: the protocol both front-ends share.

``save_checkpoint`` runs all of it for our pretrain loop (``async_save.AsyncCheckpointer``:
steps 2 and 3 in the background); the Megatron-LM patches write with Megatron-LM's own save
and then call ``commit``. All ranks take part, at the same iteration:

1. ``begin``: rank 0 removes leftovers of interrupted saves (``*.tmp``) and makes
   ``iter_NNNNNNN.tmp``.
2. Every rank hands its sharded state (``state.py``) to ``dist_checkpointing.save``
   (torch_dist): its own ``__<rank>_*.distcp`` files; rank 0 also the common files. A write
   error on any rank is raised on every rank by megatron-core's result exchange.
3. Every rank hashes the files it wrote (``hash_files``) and lists the shards it held.
4. ``commit``: every rank's record (host, coordinates, files with SHA-256, shards held) and
   error, if any, are all-gathered; any error raises ``CheckpointError`` on every rank, and
   nothing is committed. Rank 0 writes ``rank_map.json`` (atomically) into the directory that
   holds the files; for a checkpoint written into ``iter_NNNNNNN.tmp``, it then renames it to
   ``iter_NNNNNNN``, replaces ``latest`` (written to a temporary file and renamed), and
   removes the oldest committed checkpoints beyond ``keep_last``. A checkpoint written in
   place (Megatron-LM's own save, which moves its own tracker) is committed by its rank map.

The running job's layout and this rank's place in it (``manifest.current_layout``,
``manifest.current_coords``) are read from megatron-core's ``parallel_state`` at the moment
of the save, as the rank map records them.

A crash at any point before the commit leaves ``latest`` naming the previous checkpoint; a
directory without its rank map, or still named ``.tmp``, is never loaded, and the next save
removes it.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
# torch's checkpoint failure is a BaseException: name it, or it escapes the commit protocol.
from torch.distributed.checkpoint.api import CheckpointException as DcpCheckpointException

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from .. import __version__
from ..compat.checkpointing import writer_errors
from ..compat.rebind import rebound
from ..compat.versions import MEGATRON_CORE_VERSION
from .manifest import (CHECKPOINT_NAME, LATEST, CheckpointError, FileRecord, Manifest, RankRecord, ShardRecord,
                       committed_checkpoints, current_coords, current_layout, sha256_of)
from .state import TrainingState, saved_state

COMMON_FILES = (".metadata", "common.pt", "metadata.json")


def shard_files(rank: int, directory: Path) -> list[Path]:
    """The torch_dist files of this rank's tensor shards."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def common_files(rank: int, directory: Path) -> list[Path]:
    """megatron-core's metadata and common state: rank 0 writes them."""
    return [directory / name for name in COMMON_FILES if (directory / name).exists()] if rank == 0 else []


def hash_files(paths: list[Path]) -> list[FileRecord]:
    return [FileRecord(path=p.name, sha256=sha256_of(p), bytes=p.stat().st_size) for p in paths]


@dataclass
class SaveResult:
    path: Path
    iteration: int
    seconds: float  # from the start of the save to its commit
    bytes: int


@dataclass
class PendingCheckpoint:
    """What the rank map records, taken when the save starts (an asynchronous save commits
    after training has moved on), and where the files go."""

    iteration: int
    consumed_samples: int
    use_distributed_optimizer: bool  # the layout is read at the commit (``manifest.current_layout``)
    higgs: dict | None
    save_dir: Path
    keep_last: int | None = None
    in_place: bool = False
    """True: the files are written into ``iter_NNNNNNN`` itself and someone else moves the
    pointer (Megatron-LM); False: into ``iter_NNNNNNN.tmp``, renamed at the commit."""
    started: float = 0.0
    vocab: dict | None = None  # vocab.vocab_record: the true size behind the padded rows

    @property
    def final(self) -> Path:
        return self.save_dir / CHECKPOINT_NAME.format(self.iteration)

    @property
    def directory(self) -> Path:
        """Where the files are written."""
        return self.final if self.in_place else self.save_dir / f"{CHECKPOINT_NAME.format(self.iteration)}.tmp"


def begin(pending: PendingCheckpoint) -> PendingCheckpoint:
    """Before the files are written (every rank, for a ``.tmp`` save): rank 0 removes what
    interrupted saves left and makes the directory; a barrier."""
    pending.started = pending.started or time.perf_counter()
    if dist.get_rank() == 0:
        pending.save_dir.mkdir(parents=True, exist_ok=True)
        for stale in pending.save_dir.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        pending.directory.mkdir()
    dist.barrier()
    return pending


def commit(pending: PendingCheckpoint, shards: list[ShardRecord], files: list[FileRecord],
           error: str | None = None) -> SaveResult:
    """Commit a checkpoint whose files this rank wrote (``files``) or failed to (``error``);
    collective (see the module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    record = RankRecord(rank=rank, host=socket.gethostname(), coords=current_coords(), files=files, shards=shards)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (record, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError(f"checkpoint {pending.directory} not committed: " + "; ".join(errors))
    if rank == 0:
        Manifest(
            iteration=pending.iteration, consumed_samples=pending.consumed_samples,
            layout=current_layout(pending.use_distributed_optimizer),
            ranks=[r for r, _ in gathered], higgs=pending.higgs,
            versions={"higgs_megatron": __version__, "megatron_core": MEGATRON_CORE_VERSION, "torch": torch.__version__},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"), vocab=pending.vocab,
        ).write(pending.directory)
        if not pending.in_place:
            if pending.final.exists():
                shutil.rmtree(pending.final)
            os.replace(pending.directory, pending.final)
            write_latest(pending.save_dir, pending.iteration)
            _fsync_dir(pending.save_dir)
            if pending.keep_last:
                for old in committed_checkpoints(pending.save_dir)[:-pending.keep_last]:
                    shutil.rmtree(pending.save_dir / CHECKPOINT_NAME.format(old), ignore_errors=True)
    dist.barrier()
    return SaveResult(path=pending.final, iteration=pending.iteration, bytes=sum(f.bytes for r, _ in gathered
                                                                                 for f in r.files),
                      seconds=time.perf_counter() - pending.started)


def write_latest(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pending_checkpoint(training: TrainingState, save_dir: str | Path, keep_last: int | None) -> PendingCheckpoint:
    """The rank map's view of ``training`` now, for a save into ``save_dir``."""
    return PendingCheckpoint(iteration=training.iteration, consumed_samples=training.consumed_samples,
                             use_distributed_optimizer=training.use_distributed_optimizer, higgs=training.higgs,
                             save_dir=Path(save_dir), keep_last=keep_last, vocab=training.vocab)


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


@contextmanager
def thread_results_queue() -> Iterator[None]:
    """A fresh thread queue for the results of one megatron-core save, planned inside this scope.

    megatron-core's writer takes its results queue from a module global, made on first use as a
    queue of a spawned ``multiprocessing`` manager: a process start and its imports, seconds on
    the first save of every launch and restart of a job. Only the process that runs
    ``write_preloaded_data_multiproc`` puts into that queue (its forked writers report through
    a local queue), and for our saves that is the training process (a synchronous save) or a
    thread of it (an asynchronous one), so a thread queue serves. It is in place only while the
    save is planned (the writer keeps its own reference), so megatron-core's process-based saves
    elsewhere still get theirs, and a failed save leaves nothing behind for the next."""
    with rebound((filesystem_async, "_results_queue", queue.Queue())):
        yield


def save_checkpoint(training: TrainingState, save_dir: str | Path, keep_last: int | None = None) -> SaveResult:
    """Save ``training`` as a committed checkpoint, synchronously (see the module docstring)."""
    pending = begin(pending_checkpoint(training, save_dir, keep_last))
    rank = dist.get_rank()
    state, shards = saved_state(training)
    error, files = None, []
    try:
        with crc32_skipped(), thread_results_queue(), writer_errors() as logged:
            dist_checkpointing.save(state, str(pending.directory))
        files = hash_files(shard_files(rank, pending.directory) + common_files(rank, pending.directory))
    except (Exception, DcpCheckpointException) as exc:  # noqa: BLE001 - reported below, on every rank
        said = first_line(exc)
        error = f"rank {rank}: {type(exc).__name__}: {said}" + "".join(
            f"; {line}" for line in dict.fromkeys(logged) if line not in said)
    return commit(pending, shards, files, error)


def first_line(error: BaseException) -> str:
    """torch's CheckpointException carries each failing rank's traceback; keep the errors."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return "; ".join(errors) or (lines[0] if lines else type(error).__name__)
