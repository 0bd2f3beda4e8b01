"""Loading: pick a committed checkpoint, validate its rank map, then load and restore.

Order (every rank, collectively): read ``latest`` (or ``--checkpoint-version N``) -> read the
rank map -> layout check (``same-sharding``: any difference stops the load, each named;
``reshard``: every shard this rank needs must be covered by saved shards) -> SHA-256 of
every file, shared out across ranks -> only then ``dist_checkpointing.load``. Every failure
is agreed on by all ranks (an all-gather of the problems) and raised as ``CheckpointError``
before any model or optimizer state has been touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron.core import dist_checkpointing

from .manifest import CheckpointError, Manifest
from .save import LATEST, checkpoint_name, committed_checkpoints, current_layout
from .state import (prepare_fresh_optimizer_for_load, restore_rng_state, shard_records, sharded_training_state,
                    tolerate_torch_adam_step, untie_adam_steps)
from .validation import layout_differences, uncovered_shards, verify_files

RECOVERY_MODES = ("same-sharding", "reshard")


@dataclass
class LoadResult:
    path: Path
    manifest: Manifest
    resharded: bool


def find_checkpoint(load_dir: str | Path, version: int | None = None) -> Path | None:
    """The committed checkpoint to load: ``version`` if given, else the one ``latest`` names."""
    load_dir = Path(load_dir)
    if version is not None:
        path = load_dir / checkpoint_name(version)
        if version not in committed_checkpoints(load_dir):
            available = ", ".join(map(str, committed_checkpoints(load_dir))) or "none"
            raise CheckpointError(f"--checkpoint-version {version}: {path} is not a committed checkpoint "
                                  f"(committed: {available})")
        return path
    latest = load_dir / LATEST
    if not latest.exists():
        return None
    try:
        iteration = int(latest.read_text().strip())
    except ValueError:
        raise CheckpointError(f"{latest}: expected an iteration number") from None
    path = load_dir / checkpoint_name(iteration)
    if not (path / "rank_map.json").exists():
        raise CheckpointError(f"{latest} names iteration {iteration}, but {path} is not a committed checkpoint")
    return path


def agree(local_problems: list[str], what: str) -> None:
    """All ranks learn every rank's problems; raise the same error everywhere."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_problems)
    problems = sorted({p for rank_problems in gathered for p in rank_problems})
    if problems:
        raise CheckpointError(f"{what}:\n  " + "\n  ".join(problems))


def load_checkpoint(trainer, load_dir: str | Path, recovery_mode: str = "same-sharding",
                    version: int | None = None) -> LoadResult | None:
    """Restore ``trainer`` from the chosen checkpoint; None when ``load_dir`` holds none."""
    if recovery_mode not in RECOVERY_MODES:
        raise CheckpointError(f"--recovery-mode {recovery_mode!r}: expected one of {', '.join(RECOVERY_MODES)}")
    path = find_checkpoint(load_dir, version)
    if path is None:
        return None
    manifest = Manifest.read(path)
    differences = layout_differences(manifest.layout, current_layout(trainer.args.use_distributed_optimizer))
    resharded = bool(differences)
    if differences and recovery_mode == "same-sharding":
        raise CheckpointError(f"{path} was saved with another layout; --recovery-mode same-sharding "
                              "refuses to load it (use --recovery-mode reshard to move to this layout):\n  "
                              + "\n  ".join(differences))
    prepare_fresh_optimizer_for_load(trainer.optimizer)
    state = sharded_training_state(trainer, is_loading=True, per_rank=not resharded)
    agree(uncovered_shards(manifest, shard_records(state, main_replica_only=False)) if resharded else [],
           f"{path} cannot be resharded to this layout")
    agree(verify_files(path, manifest, dist.get_rank(), dist.get_world_size()), f"{path} failed its integrity check")

    loaded = dist_checkpointing.load(state, str(path))
    trainer.model[0].module.load_state_dict(loaded["model"])
    optimizer_state = loaded["optimizer"]
    residuals = optimizer_state.pop("higgs_residuals", None)
    inner = getattr(trainer.optimizer, "inner", trainer.optimizer)
    with tolerate_torch_adam_step():
        inner.load_state_dict(optimizer_state)
    untie_adam_steps(trainer.optimizer)
    if residuals is not None:
        trainer.optimizer.load_higgs_residuals(residuals)
    trainer.scheduler.load_state_dict(loaded["scheduler"])
    trainer.iteration = loaded["iteration"]
    trainer.consumed_samples = loaded["consumed_samples"]
    if not resharded:
        restore_rng_state(loaded["rng"])
    return LoadResult(path=path, manifest=manifest, resharded=resharded)
