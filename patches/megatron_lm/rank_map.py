"""Megatron-LM's own torch_dist checkpoints, with this project's rank map added and checked.

Megatron-LM's save and load are kept: its checkpoint holds more than model and optimizer
(its args, the rerun state machine, FLOPs so far, the data iterator), and its loader already
moves model and ``fully_reshardable`` optimizer state to another TP/PP/DP layout. What it
lacks is what this module adds, using ``higgs_megatron.checkpoint``'s rank map, rules and
file hashing:

Save (``save_checkpoint``), all ranks:
  1. while Megatron-LM builds its sharded state dict (``generate_state_dict``), each rank
     records the tensor shards it holds as the main replica;
  2. once the files are on disk (synchronous save: when Megatron-LM's ``save_checkpoint``
     returns; ``--async-save``: in the save's finalization, after every rank's writer has
     finished), each rank hashes the files it wrote (named by megatron-core's write plan,
     ``planned_files``, never by a listing), a gather brings files, shards,
     hosts and coordinates to rank 0, and rank 0 writes ``rank_map.json`` atomically. That
     file is the commit.
  Megatron-LM moves its tracker (``latest_checkpointed_iteration.txt``) just before step 2,
  so a crash in between leaves the tracker naming a checkpoint without a rank map: loading
  then takes the newest committed checkpoint instead, and says so.

Load (``load_checkpoint``), all ranks, before Megatron-LM reads anything:
  1. the checkpoint: ``--checkpoint-version N`` (it must be committed), else the one the
     tracker names if committed, else the newest committed one;
  2. its layout against this run's: ``same-sharding`` refuses any difference, naming each;
  3. every file's SHA-256 (shared out over the ranks; a mismatch or a missing file is
     named with the rank that wrote it);
  4. under ``reshard``, when Megatron-LM builds the state dict to load into, every shard this
     rank needs must be tiled by saved shards;
  then Megatron-LM loads that exact iteration (``args.ckpt_step``). Every failure is agreed
  by all ranks and raised everywhere as ``CheckpointError`` before any state is touched; one
  on any rank inside Megatron-LM's loader is raised on every rank
  (``outcome.same_outcome_everywhere``).

Error-feedback residuals are per rank; on a resumed run with the same layout they are
restored, on a reshard they start at zero (the policy of ``higgs_megatron.checkpoint``) and
RNG state follows Megatron-LM's own rule (kept when TP and PP are unchanged).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from higgs_megatron.runtime.run_config import RunConfig
from higgs_megatron.checkpoint.save import (PendingCheckpoint, commit, common_files, hash_files, planned_files,
                                            thread_results_queue)
from higgs_megatron.checkpoint.load import (LoadResult, check_reshard_plan, restoring, validated_checkpoint,
                                            vocab_record)
from higgs_megatron.checkpoint.outcome import same_outcome_everywhere
from higgs_megatron.checkpoint.manifest import MEGATRON_LM_TRACKER, Manifest, current_layout
from higgs_megatron.checkpoint.state import owner_written_optimizer_state, shard_records
from higgs_megatron.logs import get_logger, log_single_rank

log = get_logger("higgs_megatron.patches.rank_map")

TRACKER = MEGATRON_LM_TRACKER


def megatron_lm_vocab(args: Any) -> dict | None:
    """The true vocabulary size behind Megatron-LM's ``padded_vocab_size``: its tokenizer's."""
    from megatron.training.global_vars import get_tokenizer

    try:
        vocab_size = get_tokenizer().vocab_size
    except (AssertionError, AttributeError, NotImplementedError):  # no tokenizer built
        return None
    return vocab_record(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


class PendingRankMap:
    """A Megatron-LM save whose files are being written; ``commit`` (collective) hashes this
    rank's files and commits the rank map through ``higgs_megatron.checkpoint.save.commit``."""

    def __init__(self, checkpoint: PendingCheckpoint) -> None:
        self.checkpoint = checkpoint
        self.shards: list = []
        self.files: list[Path] = []  # this rank's shard files, as megatron-core's writer planned them
        self.committed = False

    def commit(self) -> None:
        rank, directory = dist.get_rank(), self.checkpoint.directory
        result = commit(self.checkpoint, self.shards, hash_files(self.files + common_files(rank, directory)))
        self.committed = True
        log_single_rank(log, logging.INFO, f" [higgs] committed {directory} with its rank map ({dist.get_world_size()} "
                        f"ranks, {result.bytes / 1e6:.1f} MB, {result.seconds:.2f} s after the save started)")


class RankMapHooks:
    """The state shared by the wrappers of Megatron-LM's checkpoint functions."""

    def __init__(self, args: Any, run: RunConfig) -> None:
        self.args = args
        self.run = run
        self.pending: PendingRankMap | None = None
        self.loading: LoadResult | None = None   # set while Megatron-LM loads a resharded checkpoint
        self.loaded: Manifest | None = None
        self.saved_iterations: set[int] = set()

    # --- save -----------------------------------------------------------------------

    def save_checkpoint(self, original: Callable, iteration: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("non_persistent_ckpt") or kwargs.get("release"):
            return original(iteration, *args, **kwargs)   # Megatron-LM's own kinds, left as they are
        if int(iteration) in self.saved_iterations:
            # A wall-clock save at the last iteration, then Megatron-LM's final save of the same
            # state: rewriting a committed checkpoint in place would put it at risk for nothing.
            log_single_rank(log, logging.INFO, f" iteration {iteration} is already saved by this run; not saving it again")
            return None
        a = self.args
        self.pending = PendingRankMap(PendingCheckpoint(
            iteration=int(iteration), consumed_samples=int(getattr(a, "consumed_train_samples", 0)),
            use_distributed_optimizer=a.use_distributed_optimizer, higgs=self.run.compression.to_dict(), save_dir=Path(a.save),
            in_place=True, started=time.perf_counter(), vocab=megatron_lm_vocab(a)))
        # A synchronous save writes from this process: megatron-core's results queue need not be
        # a spawned manager's (seconds on a launch's first save; ``thread_results_queue``).
        queue = contextlib.nullcontext() if a.async_save else thread_results_queue()
        with owner_written_optimizer_state(), queue, planned_files() as files:
            result = original(iteration, *args, **kwargs)
        self.pending.files = files
        if not a.async_save:
            self.pending.commit()
        self.saved_iterations.add(int(iteration))  # only once the save went through (or was scheduled)
        return result

    def schedule_async_save(self, original: Callable, request: Any) -> Any:
        """Megatron-LM's async save: the rank map is committed in the save's finalization."""
        if self.pending is not None and not self.pending.committed:
            request.add_finalize_fn(self.pending.commit)
        return original(request)

    def generate_state_dict(self, original: Callable, *args: Any, **kwargs: Any) -> dict:
        state = original(*args, **kwargs)
        is_loading = (kwargs.get("optim_sd_kwargs") or {}).get("is_loading", False)
        if not is_loading and self.pending is not None and not self.pending.committed:
            self.pending.shards = shard_records(state)
        elif is_loading and self.loading is not None:
            check_reshard_plan(self.loading, state)
        return state

    # --- load -----------------------------------------------------------------------

    def load_checkpoint(self, original: Callable, ddp_model: Any, optimizer: Any, scheduler: Any,
                        load_arg: str = "load", *args: Any, **kwargs: Any) -> Any:
        a = self.args
        load_dir = getattr(a, load_arg, None)
        if load_arg != "load" or not load_dir:
            return original(ddp_model, optimizer, scheduler, load_arg, *args, **kwargs)
        checkpoint = self.run.checkpoint
        chosen = validated_checkpoint(load_dir, checkpoint.checkpoint_version, checkpoint.recovery_mode,
                                      current_layout(a.use_distributed_optimizer), megatron_lm_vocab(a),
                                      pointer=TRACKER)
        if chosen is None:
            return original(ddp_model, optimizer, scheduler, load_arg, *args, **kwargs)  # nothing saved yet
        if chosen.warning:
            log_single_rank(log, logging.WARNING, f" [higgs] warning: {chosen.warning}")
        path, manifest, resharded = chosen.path, chosen.manifest, chosen.resharded
        a.ckpt_step = manifest.iteration
        if hasattr(optimizer, "skip_residuals_on_load"):
            optimizer.skip_residuals_on_load = resharded
        self.loading = chosen if resharded else None
        try:
            with same_outcome_everywhere(f"checkpoint {path} not loaded"), restoring(optimizer):
                result = original(ddp_model, optimizer, scheduler, load_arg, *args, **kwargs)
        finally:
            self.loading = None
        self.loaded = manifest
        if a.save and Path(a.save).resolve() == Path(load_dir).resolve():
            self.saved_iterations.add(manifest.iteration)  # committed already: a save of it again is skipped
        how = "resharded: " + "; ".join(chosen.differences) if resharded else "same sharding"
        log_single_rank(log, logging.INFO, f" [higgs] loaded {path}: rank map and "
                        f"{sum(len(r.files) for r in manifest.ranks)} file hashes checked ({how})")
        return result

