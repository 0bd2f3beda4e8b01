"""The commit protocol both front-ends share: files hashed, the rank map gathered and written,
the directory renamed, ``latest`` moved, old checkpoints retired; and the running job's
layout and this rank's place in it (``current_layout``, ``current_coords``), read from
megatron-core's ``parallel_state`` at the moment of the save or load, as the rank map
records them.

Every rank calls ``commit`` for a ``PendingCheckpoint`` once its files are on disk:

1. every rank's record (host, coordinates, files with SHA-256, shards held) and error, if
   any, are all-gathered; any error raises ``CheckpointError`` on every rank, and nothing is
   committed;
2. rank 0 writes ``rank_map.json`` (atomically) into the directory that holds the files;
3. for a checkpoint written into ``iter_NNNNNNN.tmp`` (our pretrain loop), rank 0 renames it
   to ``iter_NNNNNNN``, then replaces ``latest`` (written to a temporary file and renamed),
   then removes the oldest committed checkpoints beyond ``keep_last``. A checkpoint written
   in place (Megatron-LM's own save, which moves its own tracker) is committed by step 2.

A crash before the commit leaves ``latest`` naming the previous checkpoint; a directory
without its rank map, or still named ``.tmp``, is never loaded.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from .. import __version__
from .manifest import (MANIFEST_NAME, CheckpointError, FileRecord, Layout, Manifest, RankRecord, ShardRecord,
                       sha256_of)

LATEST = "latest"
COMMON_FILES = (".metadata", "common.pt", "metadata.json")


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


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_files(rank: int, directory: Path) -> list[Path]:
    """The torch_dist files of this rank's tensor shards."""
    return sorted(directory.glob(f"__{rank}_*.distcp"))


def common_files(rank: int, directory: Path) -> list[Path]:
    """megatron-core's metadata and common state: rank 0 writes them."""
    return [directory / name for name in COMMON_FILES if (directory / name).exists()] if rank == 0 else []


def hash_files(paths: list[Path]) -> list[FileRecord]:
    return [FileRecord(path=p.name, sha256=sha256_of(p), bytes=p.stat().st_size) for p in paths]


def committed_checkpoints(save_dir: Path) -> list[int]:
    """Iterations of the committed checkpoints under ``save_dir``, oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        if path.suffix == ".tmp" or not (path / MANIFEST_NAME).exists():
            continue
        try:
            found.append(int(path.name[len("iter_"):]))
        except ValueError:
            continue
    return sorted(found)


def megatron_core_version() -> str:
    from megatron.core import __version__ as version

    return version


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
    layout: Layout
    higgs: dict | None
    save_dir: Path
    keep_last: int | None = None
    in_place: bool = False
    """True: the files are written into ``iter_NNNNNNN`` itself and someone else moves the
    pointer (Megatron-LM); False: into ``iter_NNNNNNN.tmp``, renamed at the commit."""
    started: float = 0.0

    @property
    def final(self) -> Path:
        return self.save_dir / checkpoint_name(self.iteration)

    @property
    def directory(self) -> Path:
        """Where the files are written."""
        return self.final if self.in_place else self.save_dir / f"{checkpoint_name(self.iteration)}.tmp"


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
            iteration=pending.iteration, consumed_samples=pending.consumed_samples, layout=pending.layout,
            ranks=[r for r, _ in gathered], higgs=pending.higgs,
            versions={"higgs_megatron": __version__, "megatron_core": megatron_core_version(), "torch": torch.__version__},
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ).write(pending.directory)
        if not pending.in_place:
            if pending.final.exists():
                shutil.rmtree(pending.final)
            os.replace(pending.directory, pending.final)
            write_latest(pending.save_dir, pending.iteration)
            _fsync_dir(pending.save_dir)
            if pending.keep_last:
                for old in committed_checkpoints(pending.save_dir)[:-pending.keep_last]:
                    shutil.rmtree(pending.save_dir / checkpoint_name(old), ignore_errors=True)
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
