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

from .save import LATEST, checkpoint_name, committed_checkpoints, current_layout
from .manifest import MANIFEST_NAME, CheckpointError, Manifest
from .state import (TrainingState, prepare_fresh_optimizer_for_load, restore_rng_state, shard_records,
                    sharded_training_state, tolerate_torch_adam_step, untie_adam_steps)
from .validation import RECOVERY_MODES, check_layout, uncovered_shards, verify_files  # noqa: F401 - RECOVERY_MODES
from .vocab import recorded_vocab


@dataclass
class LoadResult:
    path: Path
    manifest: Manifest
    resharded: bool
    warning: str | None = None


def choose_checkpoint(load_dir: str | Path, version: int | None = None,
                      pointer: str = LATEST) -> tuple[Path | None, str | None]:
    """The committed checkpoint to load, and a warning to show, if any. Both front-ends, one rule:

    * ``version`` given: that iteration, which must be committed;
    * else the iteration the ``pointer`` file names (``latest``; Megatron-LM's tracker), if
      it is committed;
    * else the newest committed checkpoint, with a warning that the pointer names one that
      is not, or is missing or unreadable (a crash between a pointer move and the commit, a
      deleted file: never trusted blindly, never a silent fresh start);
    * none committed: an error if the pointer names an iteration (its checkpoint is gone or
      was never committed) or ``iter_*`` directories without a rank map exist (saved without
      ``--use-higgs``, or interrupted); else None, a fresh start.
    """
    load_dir = Path(load_dir)
    committed = committed_checkpoints(load_dir)
    if version is not None:
        if version not in committed:
            raise CheckpointError(f"--checkpoint-version {version}: {load_dir / checkpoint_name(version)} is not a "
                                  f"committed checkpoint (committed: {', '.join(map(str, committed)) or 'none'})")
        return load_dir / checkpoint_name(version), None
    pointer_file = load_dir / pointer
    named = None
    if pointer_file.exists():
        text = pointer_file.read_text().strip()
        named = int(text) if text.isdigit() else None
    if named is not None and named in committed:
        return load_dir / checkpoint_name(named), None
    if not committed and named is not None:
        raise CheckpointError(f"{pointer_file} names iteration {named}, but {load_dir / checkpoint_name(named)} is "
                              "not a committed checkpoint, and none is")
    if not committed:
        uncommitted = [p.name for p in load_dir.glob("iter_*")
                       if p.is_dir() and p.suffix != ".tmp" and not (p / MANIFEST_NAME).exists()]
        if uncommitted:
            raise CheckpointError(f"{load_dir}: {', '.join(sorted(uncommitted))} has no rank map (saved without "
                                  "--use-higgs, or interrupted before its commit); load it without --use-higgs, "
                                  "or start from an empty --load directory")
        return None, None
    chosen = load_dir / checkpoint_name(committed[-1])
    said = f"names iteration {named}, which has no rank map (not committed)" if named is not None else (
        "is missing or unreadable")
    return chosen, f"{pointer_file} {said}; loading the newest committed checkpoint, {chosen}"


def agree(local_problems: list[str], what: str) -> None:
    """All ranks learn every rank's problems; raise the same error everywhere."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_problems)
    problems = sorted({p for rank_problems in gathered for p in rank_problems})
    if problems:
        raise CheckpointError(f"{what}:\n  " + "\n  ".join(problems))


def load_checkpoint(training: TrainingState, load_dir: str | Path, recovery_mode: str = "same-sharding",
                    version: int | None = None) -> LoadResult | None:
    """Restore ``training`` from the chosen checkpoint; None when ``load_dir`` holds none. The
    warning of ``choose_checkpoint``, if any, is ``LoadResult.warning``."""
    path, warning = choose_checkpoint(load_dir, version)
    if path is None:
        return None
    manifest = Manifest.read(path)
    differences = check_layout(path, manifest.layout, current_layout(training.use_distributed_optimizer),
                               recovery_mode, recorded_vocab(manifest, training.vocab), training.vocab)
    resharded = bool(differences)
    prepare_fresh_optimizer_for_load(training.optimizer)
    state = sharded_training_state(training, is_loading=True, per_rank=not resharded)
    agree(uncovered_shards(manifest, shard_records(state, main_replica_only=False)) if resharded else [],
          f"{path} cannot be resharded to this layout")
    agree(verify_files(path, manifest, dist.get_rank(), dist.get_world_size()), f"{path} failed its integrity check")

    loaded = dist_checkpointing.load(state, str(path))
    training.model[0].module.load_state_dict(loaded["model"])
    optimizer_state = loaded["optimizer"]
    residuals = optimizer_state.pop("higgs_residuals", None)
    inner = getattr(training.optimizer, "inner", training.optimizer)
    with tolerate_torch_adam_step():
        inner.load_state_dict(optimizer_state)
    untie_adam_steps(training.optimizer)
    if residuals is not None:
        training.optimizer.load_higgs_residuals(residuals)
    training.scheduler.load_state_dict(loaded["scheduler"])
    training.iteration = loaded["iteration"]
    training.consumed_samples = loaded["consumed_samples"]
    if not resharded:
        restore_rng_state(loaded["rng"])
    return LoadResult(path=path, manifest=manifest, resharded=resharded, warning=warning)
