"""Saving: every rank writes its shard, hashes it, and rank 0 commits the rank map.

Protocol (all ranks call ``save_checkpoint`` at the same iteration):

1. Rank 0 removes leftovers of interrupted saves (``*.tmp``) and makes ``iter_NNNNNNN.tmp``.
2. Every rank hands its sharded state to ``dist_checkpointing.save`` (torch_dist): its own
   ``__<rank>_*.distcp`` files; rank 0 also the common files. A write error on any rank is
   raised on every rank by megatron-core's result exchange.
3. Every rank hashes the files it wrote and lists the shards it held; an all-gather brings
   them, with hosts and coordinates, to rank 0, together with a "this rank failed" flag.
4. Only if no rank failed: rank 0 writes ``rank_map.json`` (atomically), renames the
   directory to ``iter_NNNNNNN``, then replaces ``latest`` (the iteration, written to a
   temporary file and renamed): the commit. Then retention removes the oldest committed
   checkpoints beyond ``keep_last``.

A crash at any point before the commit leaves ``latest`` naming the previous checkpoint;
the half-written ``.tmp`` directory is never loaded and is removed by the next save.

``save_checkpoint`` runs the protocol in one call; ``async_save.AsyncCheckpointer`` runs step
2's writing and hashing in the background and steps 3-4 once every rank's writer is done.
"""

from __future__ import annotations

import os
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

from megatron.core import dist_checkpointing, parallel_state

from .. import __version__
from .manifest import CheckpointError, FileRecord, Layout, Manifest, RankRecord
from .state import shard_records, sharded_training_state
from .validation import sha256_of

LATEST = "latest"
COMMON_FILES = (".metadata", "common.pt", "metadata.json")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


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


def shard_files(rank: int, directory: Path) -> list[Path]:
    """The torch_dist files of this rank's tensor shards."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def common_files(rank: int, directory: Path) -> list[Path]:
    """megatron-core's metadata and common state: rank 0 writes them."""
    return [directory / name for name in COMMON_FILES if (directory / name).exists()] if rank == 0 else []


@dataclass
class SaveResult:
    path: Path
    iteration: int
    seconds: float  # from the start of the save to its commit
    bytes: int


@dataclass
class _Snapshot:
    """What the rank map records about the trainer, taken when the save starts: an
    asynchronous save commits after the trainer has moved on."""
    iteration: int
    consumed_samples: int
    layout: Layout
    higgs: dict | None
    save_dir: Path
    keep_last: int | None
    started: float

    @property
    def tmp(self) -> Path:
        return self.save_dir / f"{checkpoint_name(self.iteration)}.tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _begin(trainer, save_dir: str | Path, keep_last: int | None) -> _Snapshot:
    """Step 1 of the protocol, on every rank."""
    snapshot = _Snapshot(
        iteration=trainer.iteration, consumed_samples=trainer.consumed_samples,
        layout=current_layout(trainer.args.use_distributed_optimizer),
        higgs=trainer.args.higgs_config.to_dict() if trainer.args.use_higgs else None,
        save_dir=Path(save_dir), keep_last=keep_last, started=time.perf_counter())
    if dist.get_rank() == 0:
        snapshot.save_dir.mkdir(parents=True, exist_ok=True)
        for stale in snapshot.save_dir.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        snapshot.tmp.mkdir()
    dist.barrier()
    return snapshot


def hash_files(paths: list[Path]) -> list[FileRecord]:
    return [FileRecord(path=p.name, sha256=sha256_of(p), bytes=p.stat().st_size) for p in paths]


def _commit(snapshot: _Snapshot, shards: list, files: list[FileRecord], error: str | None) -> SaveResult:
    """Steps 3 and 4 of the protocol, on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    record = RankRecord(rank=rank, host=socket.gethostname(), coords=current_coords(), files=files, shards=shards)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (record, error))
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError(f"checkpoint {snapshot.tmp} not committed: " + "; ".join(errors))
    name = checkpoint_name(snapshot.iteration)
    if rank == 0:
        manifest = Manifest(
            iteration=snapshot.iteration, consumed_samples=snapshot.consumed_samples, layout=snapshot.layout,
            ranks=[r for r, _ in gathered], higgs=snapshot.higgs,
            versions={"higgs_megatron": __version__, "megatron_core": megatron_core_version(), "torch": torch.__version__},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.write(snapshot.tmp)
        final = snapshot.save_dir / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(snapshot.tmp, final)
        _write_latest(snapshot.save_dir, snapshot.iteration)
        _fsync_dir(snapshot.save_dir)
        if snapshot.keep_last:
            for old in committed_checkpoints(snapshot.save_dir)[:-snapshot.keep_last]:
                shutil.rmtree(snapshot.save_dir / checkpoint_name(old), ignore_errors=True)
    dist.barrier()
    total = sum(f.bytes for r, _ in gathered for f in r.files)
    return SaveResult(path=snapshot.save_dir / name, iteration=snapshot.iteration,
                      seconds=time.perf_counter() - snapshot.started, bytes=total)


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
    Measured on this project's CPU machine: ``torch.save`` of 100 MB in 100 tensors takes
    116 ms of CPU with it and 53 ms without, on every rank and every save (an asynchronous
    save's writer takes that time from the training ranks when they use every core). The
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


def save_checkpoint(trainer, save_dir: str | Path, keep_last: int | None = None) -> SaveResult:
    """Save the trainer's state as a committed checkpoint, synchronously (see the module docstring)."""
    snapshot = _begin(trainer, save_dir, keep_last)
    rank = dist.get_rank()
    state = sharded_training_state(trainer)
    shards = shard_records(state)
    error, files = None, []
    try:
        with crc32_skipped():
            dist_checkpointing.save(state, str(snapshot.tmp))
        files = hash_files(shard_files(rank, snapshot.tmp) + common_files(rank, snapshot.tmp))
    except (Exception, DcpCheckpointException) as exc:  # noqa: BLE001 - reported below, on every rank
        error = f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}"
    return _commit(snapshot, shards, files, error)


def _first_line(error: BaseException) -> str:
    """torch's CheckpointException carries each failing rank's traceback; keep the errors."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":", 1)[0]]
    return "; ".join(errors) or (lines[0] if lines else type(error).__name__)


def _write_latest(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f"{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)


def committed_checkpoints(save_dir: Path) -> list[int]:
    """Iterations of the committed checkpoints under ``save_dir``, oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        if path.suffix == ".tmp" or not (path / "rank_map.json").exists():
            continue
        try:
            found.append(int(path.name[len("iter_"):]))
        except ValueError:
            continue
    return sorted(found)


def megatron_core_version() -> str:
    from megatron.core import __version__ as version

    return version
