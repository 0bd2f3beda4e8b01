"""The rank map: one human-readable JSON file per checkpoint, ``rank_map.json``.

Schema (version 1)::

    {"schema_version": 1, "iteration": 100, "consumed_samples": 800, "created": "...",
     "layout": {"world_size": 4, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                "data_parallel_size": 2, "context_parallel_size": 1, "expert_model_parallel_size": 1,
                "use_distributed_optimizer": true},
     "ranks": [{"rank": 0, "host": "node-a", "coords": {"tp": 0, "pp": 0, "dp": 0, "cp": 0, "ep": 0},
                "files": [{"path": "__0_0.distcp", "sha256": "...", "bytes": 123}],
                "shards": [{"key": "decoder.layers.0.mlp.linear_fc1.weight",
                            "global_shape": [256, 64], "global_offset": [0, 0], "local_shape": [128, 64]}]}],
     "higgs": {...} | null, "versions": {"higgs_megatron": "...", "megatron_core": "...", "torch": "..."},
     "vocab": {"vocab_size": 257, "make_vocab_size_divisible_by": 128, "padded_vocab_size": 384} | null}

``vocab`` (absent from older rank maps, read as null) is the true vocabulary size behind the
padded embedding rows (``load.vocab_record``). Files are named relative to the checkpoint directory. ``shards`` lists the tensor shards a
rank saved as the main replica (replicas are not written twice), so over all ranks they
tile every saved tensor exactly once.

Also here, what a rank map is read against: the names of checkpoint directories and which
are committed (``committed_checkpoints``: those holding a rank map), the running job's
layout and this rank's place in it (``current_layout``, ``current_coords``, read from
megatron-core's ``parallel_state`` at the moment of the save or load), and the files'
hashes (``sha256_of``, ``verify_files``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist
from megatron.core import parallel_state

SCHEMA_VERSION = 1
MANIFEST_NAME = "rank_map.json"
LATEST = "latest"
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's pointer
CHECKPOINT_NAME = "iter_{:07d}"  # an iteration's directory, Megatron-LM's name for it


class CheckpointError(RuntimeError):
    """Anything wrong with saving, finding, validating or loading a checkpoint."""


@dataclass
class FileRecord:
    path: str
    sha256: str
    bytes: int


@dataclass
class ShardRecord:
    key: str
    global_shape: list[int]
    global_offset: list[int]
    local_shape: list[int]


@dataclass
class Layout:
    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    use_distributed_optimizer: bool = False
    # Each changes how parameters and their error-feedback residuals are laid out, so a change
    # is a reshard. The expert tensor-parallel size is recorded only where it is not the
    # tensor-parallel size (None: the same), so a dense model never names it.
    virtual_pipeline_model_parallel_size: int | None = None
    num_distributed_optimizer_instances: int = 1
    expert_tensor_parallel_size: int | None = None


@dataclass
class RankRecord:
    rank: int
    host: str
    coords: dict[str, int]
    files: list[FileRecord] = field(default_factory=list)
    shards: list[ShardRecord] = field(default_factory=list)


@dataclass
class Manifest:
    iteration: int
    consumed_samples: int
    layout: Layout
    ranks: list[RankRecord]
    higgs: dict | None
    versions: dict[str, str]
    created: str
    schema_version: int = SCHEMA_VERSION
    vocab: dict | None = None
    save_id: str | None = None  # the save that wrote it (``save.begin``); absent from older rank maps

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> "Manifest":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{source}: not valid JSON ({error})") from None
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise CheckpointError(f"{source}: schema version {version!r}, this higgs-megatron reads {SCHEMA_VERSION}")
        try:
            ranks = [RankRecord(rank=r["rank"], host=r["host"], coords=r["coords"],
                                files=[FileRecord(**f) for f in r["files"]],
                                shards=[ShardRecord(**s) for s in r["shards"]]) for r in raw["ranks"]]
            return cls(iteration=raw["iteration"], consumed_samples=raw["consumed_samples"],
                       layout=Layout(**raw["layout"]), ranks=ranks, higgs=raw.get("higgs"),
                       versions=raw["versions"], created=raw["created"], schema_version=version,
                       vocab=raw.get("vocab"), save_id=raw.get("save_id"))
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"{source}: missing or malformed field ({error})") from None

    @classmethod
    def read(cls, checkpoint_dir: str | Path) -> "Manifest":
        path = Path(checkpoint_dir) / MANIFEST_NAME
        if not path.exists():
            raise CheckpointError(f"{path}: no rank map: the checkpoint was never committed")
        return cls.from_json(path.read_text(), str(path))

def sha256_of(path: Path, chunk: int = 1 << 22, fsync: bool = False) -> str:
    """The SHA-256 a file record holds, read in chunks; with ``fsync``, the same handle then
    fsynced, so that the bytes hashed are the bytes made durable (fsync flushes a file's dirty
    pages whatever the handle's mode)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def file_record(path: Path) -> FileRecord:
    """A just-written file's record: hashed and fsynced from one handle."""
    return FileRecord(path=path.name, sha256=sha256_of(path, fsync=True), bytes=path.stat().st_size)


def verify_files(checkpoint_dir: Path, manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """Check this rank's share of all files against the rank map (file i is checked by rank i
    mod world); a missing file or a mismatch is named with the rank that wrote it."""
    records: list[tuple[FileRecord, int]] = [(f, r.rank) for r in manifest.ranks for f in r.files]
    problems = []
    for index, (record, writer) in enumerate(sorted(records, key=lambda x: x[0].path)):
        if index % world_size != rank:
            continue
        path = checkpoint_dir / record.path
        try:
            if sha256_of(path) != record.sha256:
                problems.append(f"{path}: SHA-256 does not match the rank map (written by rank {writer})")
        except FileNotFoundError:
            problems.append(f"{path}: missing (written by rank {writer})")
        except OSError as error:  # reported like any other problem, so no rank is left waiting for this one
            problems.append(f"{path}: unreadable ({error.strerror}; written by rank {writer})")
    return problems


def committed_checkpoints(save_dir: Path) -> list[int]:
    """Iterations of the committed checkpoints under ``save_dir`` (those with a rank map), oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        if path.suffix == ".tmp" or not (path / MANIFEST_NAME).exists():
            continue
        try:
            found.append(int(path.name[len("iter_"):]))
        except ValueError:
            continue
    return sorted(found)


def current_layout(use_distributed_optimizer: bool) -> Layout:
    tp, expert_tp = (parallel_state.get_tensor_model_parallel_world_size(),
                     parallel_state.get_expert_tensor_parallel_world_size())
    return Layout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        use_distributed_optimizer=use_distributed_optimizer,
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        num_distributed_optimizer_instances=_optimizer_instances(),
        expert_tensor_parallel_size=None if expert_tp == tp else expert_tp,
    )


def _optimizer_instances() -> int:
    """Megatron's num_distributed_optimizer_instances: the data-parallel ranks over those of
    one instance."""
    instance = parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False)
    if instance is None:
        return 1
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True) // instance.size()


def current_coords() -> dict[str, int]:
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank()}
