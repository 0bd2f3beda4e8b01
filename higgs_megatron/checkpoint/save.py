"""Writing a checkpoint and committing it: the protocol both front-ends share.

``save_checkpoint`` runs all of it for our pretrain loop (``async_save.AsyncCheckpointer``:
steps 2 and 3 in the background); the Megatron-LM patches write with Megatron-LM's own save
and then call ``commit``. All ranks take part, at the same iteration:

1. ``begin``: rank 0 draws this save's id (``save_id``: this launch's name, ``launch_name``,
   and a random part), removes what interrupted saves of this launch or of ended ones left
   (another job's saves in progress are left alone, and named), and makes
   ``iter_NNNNNNN.<save id>.tmp``; the id, or rank 0's error, is broadcast, so every rank
   raises the same ``CheckpointError`` or none does.
2. Every rank hands its sharded state (``state.py``) to ``dist_checkpointing.save``
   (torch_dist), whose plan is written by megatron-core's per-file writer on this process
   (``write_buckets``): its own ``__<rank>_*.distcp`` files; rank 0 also the common files.
3. Every rank hashes and fsyncs the files it wrote, named by the writer's plan (never by a
   listing of the directory), from one handle each (``manifest.file_record``). A failure on
   any rank in steps 2 and 3 is raised on every rank (``outcome.same_outcome_everywhere``:
   through the store, since a rank can fail alone before a collective the others are in),
   and nothing is committed; a failure only some ranks raised (``RanksOutOfStep``) ends the
   run, since their collectives may be out of step.
4. ``commit``: every rank's record (host, coordinates, files with SHA-256, shards held) is
   gathered on rank 0 (not on every rank: records grow with the job). Rank 0
   writes ``rank_map.json`` durably into the directory that holds the files, fsyncs that
   directory, and, for a ``.tmp`` save, puts it at ``iter_NNNNNNN`` (``durable.replace_dir``:
   an existing one is swapped out in one step, never removed first), fsyncs the save
   directory, then replaces ``latest`` (temporary file, fsync, rename, directory fsync) and
   removes the oldest committed checkpoints beyond ``keep_last``. Its outcome (its own error,
   if any) is broadcast: every rank raises the same ``CheckpointError``, or none. A
   checkpoint written in place (Megatron-LM's own save, which moves its own tracker) is
   committed by its rank map and the directory fsyncs.

The running job's layout and this rank's place in it (``manifest.current_layout``,
``manifest.current_coords``) are read from megatron-core's ``parallel_state`` at the moment
of the save, as the rank map records them.

A crash at any point before the commit leaves ``latest`` naming the previous checkpoint; a
directory without its rank map, or still named ``.tmp``, is never loaded, and the next save
removes it once its launch has ended. ``docs/checkpoints.md`` says what each fsync guards.
"""

from __future__ import annotations

import fcntl
import os
import queue
import secrets
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
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from .. import __version__
from ..compat.checkpointing import async_save_options, is_megatron_writer, writer_errors
from ..compat.rebind import rebound
from ..compat.versions import MEGATRON_CORE_VERSION
from ..logs import get_logger
from .durable import fsync_dir, remove_tree, replace_dir, write_durably
from .manifest import (CHECKPOINT_NAME, LATEST, MANIFEST_NAME, CheckpointError, FileRecord, Layout, Manifest,
                       RankRecord, ShardRecord, committed_checkpoints, current_coords, current_layout, file_record)
from .outcome import describe, same_outcome_everywhere
from .state import TrainingState, saved_state

log = get_logger(__name__)

COMMON_FILES = (".metadata", "common.pt", "metadata.json")


@contextmanager
def planned_files() -> Iterator[list[Path]]:
    """The shard files megatron-core's writer plans inside the scope, as its plan names them:
    for a save whose writer we do not run (Megatron-LM's own, written by its forked processes
    or its async worker), what this rank hashes at the commit; never a listing of the
    directory, where another writer's files could be."""
    names: list[Path] = []
    plan = FileSystemWriterAsync.get_save_function_and_args

    def recorded(writer):
        names.extend(Path(bucket[0]) for bucket in writer.write_buckets or ())
        return plan(writer)

    with rebound((FileSystemWriterAsync, "get_save_function_and_args", recorded)):
        yield names


def common_files(rank: int, directory: Path) -> list[Path]:
    """megatron-core's metadata and common state: rank 0 writes them."""
    return [directory / name for name in COMMON_FILES if (directory / name).exists()] if rank == 0 else []


def hash_files(paths: list[Path]) -> list[FileRecord]:
    """Each file's record, hashed and fsynced from one handle."""
    return [file_record(path) for path in paths]


_LOCK = ".higgs-launch-{}.lock"
_held: dict[Path, tuple[str, int]] = {}  # save directory: this launch's name in it, the descriptor holding its lock


def launch_name(save_dir: Path) -> str:
    """Rank 0's name for this launch of the job in ``save_dir``, drawn on its first save there,
    with a lock (``flock``) held on ``.higgs-launch-<name>.lock`` while the process lives: the
    ``.tmp`` directories named after a launch whose lock can be taken are an ended launch's
    leftovers (this job's before a restart, or another's), and those of a live one are
    another job's saves in progress, never touched."""
    if save_dir not in _held:
        name = secrets.token_hex(4)
        fd = os.open(save_dir / _LOCK.format(name), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _held[save_dir] = (name, fd)
    return _held[save_dir][0]


def _ended(save_dir: Path, launch: str) -> bool:
    """Whether the launch ``launch`` holds its lock no longer (taken and released here)."""
    lock = save_dir / _LOCK.format(launch)
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    lock.unlink(missing_ok=True)
    return True


def remove_leftovers(save_dir: Path, launch: str) -> list[str]:
    """Remove the ``.tmp`` directories of this launch and of ended ones, and the ended ones'
    locks; the names of those left, a live launch's (another job writing into the same
    directory)."""
    prefix, suffix = _LOCK.split("{}")
    for lock in save_dir.glob(_LOCK.format("*")):
        name = lock.name[len(prefix):-len(suffix)]
        if name != launch:
            _ended(save_dir, name)  # removes the lock of an ended launch
    live = []
    for stale in sorted(save_dir.glob("iter_*.tmp")):
        owner = stale.name.split(".")[1].split("-")[0] if stale.name.count(".") == 2 else None
        if owner is None or owner == launch or not (save_dir / _LOCK.format(owner)).exists():
            remove_tree(stale)  # owner None: a release before save ids
        else:
            live.append(stale.name)
    return live


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
    save_id: str = ""  # drawn by ``begin``: the launch's name and a random part

    @property
    def final(self) -> Path:
        return self.save_dir / CHECKPOINT_NAME.format(self.iteration)

    @property
    def directory(self) -> Path:
        """Where the files are written."""
        return self.final if self.in_place else self.save_dir / f"{self.final.name}.{self.save_id}.tmp"


def begin(pending: PendingCheckpoint) -> PendingCheckpoint:
    """Before the files are written (every rank, collective): rank 0 draws the save id,
    removes this job's interrupted saves and makes the directory (see the module docstring)."""
    pending.started = pending.started or time.perf_counter()
    outcome: list = [None, None]  # the save id, rank 0's error
    if dist.get_rank() == 0:
        try:
            pending.save_dir.mkdir(parents=True, exist_ok=True)
            launch = launch_name(pending.save_dir)
            outcome[0] = pending.save_id = f"{launch}-{secrets.token_hex(2)}"
            live = remove_leftovers(pending.save_dir, launch)
            if live:
                log.warning(f" WARNING: {pending.save_dir} holds saves in progress of another job, left alone: "
                            f"{', '.join(live)}")
            if not pending.in_place:
                pending.directory.mkdir()
        except OSError as error:
            outcome[1] = f"rank 0: {type(error).__name__}: {error}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise CheckpointError(f"checkpoint of iteration {pending.iteration} not begun: {outcome[1]}")
    pending.save_id = outcome[0]
    return pending


def commit(pending: PendingCheckpoint, shards: list[ShardRecord], files: list[FileRecord]) -> SaveResult:
    """Commit a checkpoint whose files every rank wrote (``files``: this rank's); collective
    (see the module docstring)."""
    rank = dist.get_rank()
    record = RankRecord(rank=rank, host=socket.gethostname(), coords=current_coords(), files=files, shards=shards)
    gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(record, gathered, dst=0)
    outcome: list = [None, 0]  # rank 0's error, the bytes committed
    if rank == 0:
        outcome[1] = sum(f.bytes for r in gathered for f in r.files)
        try:
            commit_files(pending, gathered, current_layout(pending.use_distributed_optimizer))
        except OSError as failure:
            outcome[0] = f"rank 0: {type(failure).__name__}: {failure}"
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(f"checkpoint {pending.directory} not committed: {outcome[0]}")
    return SaveResult(path=pending.final, iteration=pending.iteration, bytes=outcome[1],
                      seconds=time.perf_counter() - pending.started)


def commit_files(pending: PendingCheckpoint, ranks: list[RankRecord], layout: Layout) -> None:
    """Rank 0's part of the commit, each step durable before the next (the module docstring)."""
    manifest = Manifest(
        iteration=pending.iteration, consumed_samples=pending.consumed_samples, layout=layout,
        ranks=ranks, higgs=pending.higgs,
        versions={"higgs_megatron": __version__, "megatron_core": MEGATRON_CORE_VERSION, "torch": torch.__version__},
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), vocab=pending.vocab,
        save_id=pending.save_id or f"{launch_name(pending.save_dir)}-{secrets.token_hex(2)}",  # in place: drawn now
    )
    write_durably(pending.directory / MANIFEST_NAME, manifest.to_json())  # the file, then the directory's entry
    if pending.in_place:
        fsync_dir(pending.save_dir)
        return
    replace_dir(pending.directory, pending.final, pending.directory.with_suffix(".replaced"))
    write_latest(pending.save_dir, pending.iteration)
    if pending.keep_last:
        for old in committed_checkpoints(pending.save_dir)[:-pending.keep_last]:
            remove_tree(pending.save_dir / CHECKPOINT_NAME.format(old))


def write_latest(save_dir: Path, iteration: int) -> None:
    write_durably(save_dir / LATEST, f"{iteration}\n")


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


def write_buckets(transform_list: list, buckets: list, results_queue) -> list[FileRecord]:
    """megatron-core's per-file writer for each bucket of a save's plan, on this thread, then
    the record of each file it wrote, hashed and fsynced from the name the plan gives it: not
    from a listing of the directory, so nothing another writer put there is certified. The
    write results go where megatron-core's finalization reads them (which raises a failed
    bucket's error on every rank); no records then."""
    results: dict | Exception = {}
    local, count = queue.Queue(), queue.Queue()
    with crc32_skipped():
        for index, bucket in enumerate(buckets):
            count.put(index)
            FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, local, count, True)
            _, written = local.get()
            if isinstance(written, Exception):
                results = written
                break
            results[index] = written
    records = [] if isinstance(results, Exception) else hash_files([Path(bucket[0]) for bucket in buckets])
    results_queue.put(results)
    return records


def megatron_writer_args(request) -> list:
    """The leading arguments megatron-core bound to its writer in an async save request
    (``transform_list``), after checking that the writer is megatron-core's."""
    write = request.async_fn  # partial(<megatron-core's multi-bucket writer>, transform_list, use_msc)
    if not is_megatron_writer(write):
        raise RuntimeError(f"unexpected megatron-core async writer {write!r} (see higgs_megatron.compat)")
    return write.args[0]


def save_checkpoint(training: TrainingState, save_dir: str | Path, keep_last: int | None = None) -> SaveResult:
    """Save ``training`` as a committed checkpoint, synchronously (see the module docstring):
    megatron-core's save, its writer run here through ``write_buckets``. A failure on any rank
    while writing is raised on every rank (``outcome.same_outcome_everywhere``), nothing committed."""
    pending = begin(pending_checkpoint(training, save_dir, keep_last))
    rank = dist.get_rank()
    state, shards = saved_state(training)
    with same_outcome_everywhere(f"checkpoint {pending.directory} not committed"):
        with crc32_skipped(), thread_results_queue(), writer_errors() as logged:
            try:
                request = dist_checkpointing.save(state, str(pending.directory), async_sharded_save=True,
                                                  **async_save_options())
                written: list[FileRecord] = []
                transform_list = megatron_writer_args(request)
                request._replace(async_fn=lambda _rank, buckets, results: written.extend(
                    write_buckets(transform_list, buckets, results))).execute_sync()
            except (Exception, DcpCheckpointException) as exc:  # noqa: BLE001 - with what megatron-core's writer logged
                said = describe(rank, exc)
                if said is None:  # names no failed rank: the rank whose copy does says it
                    raise
                raise CheckpointError(said + "".join(f"; {line}" for line in dict.fromkeys(logged)
                                                     if line not in said)) from exc
        files = written + hash_files(common_files(rank, pending.directory))
    return commit(pending, shards, files)
