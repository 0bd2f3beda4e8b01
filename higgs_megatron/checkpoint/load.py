"""Loading: pick a committed checkpoint, check it against this run, then load and restore.

Order (every rank, collectively): rank 0 chooses (``latest``, or ``--checkpoint-version N``)
and broadcasts its choice -> its rank map, read by every rank and checked to be the bytes
rank 0 read -> SHA-256 of every file, shared out across ranks; a checkpoint that fails here
(a rank map missing or unreadable, a file missing or changed) is skipped with a warning for
the previous committed one, unless ``--checkpoint-version`` named it -> layout check
(``same-sharding``: any difference stops the load, each named; ``reshard``: every shard this
rank needs must be covered by saved shards) -> only then ``dist_checkpointing.load``. Every
failure is agreed on by all ranks (an all-gather of the problems) and raised as
``CheckpointError`` before any model or optimizer state has been touched; a failure on any
rank while the files are read and restored is raised on every rank
(``outcome.same_outcome_everywhere``). Both front-ends run the same steps
(``validated_checkpoint``, ``restoring``); Megatron-LM's loader then reads the files itself.

Every rule a checkpoint must pass is here:

* ``layout_differences``: what differs between the saved layout and the current one, each
  named ("tensor-model-parallel size: checkpoint 2, now 1"); ``check_layout``: under
  ``same-sharding`` any difference refuses the checkpoint, under ``reshard`` none does.
* ``vocab_differences``: the padded vocabulary's rows, saved and now, with the
  ``--make-vocab-size-divisible-by`` that would keep the saved size; a different true vocabulary
  refuses the checkpoint in any mode.
* ``uncovered_shards``: for ``reshard``, the shards this rank needs that the saved shards do
  not tile completely (same key and global shape, intersection volume = needed volume). The
  vocabulary's tensors may differ in their padded rows: megatron-core loads the rows both
  shapes hold and zeroes the rest (``allow_shape_mismatch``), so only those rows must be covered.
* the files' hashes against the rank map (``manifest.verify_files``).

**The vocabulary padding.** Megatron pads the vocabulary to a multiple of
``--make-vocab-size-divisible-by`` x TP, so the word embedding, an untied output layer, and
their optimizer state change their global row count when TP changes (384 rows at TP=1 and 512
at TP=2 for a 257-token vocabulary with the default divisor 128). The rows past the true size
are padding: no token id reaches them, so a reshard may trim them, or extend them with zeros,
and leave every real row bitwise equal. The rank map records the true size
(``Manifest.vocab``, ``vocab_record``); for an older checkpoint it comes from the flags.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch.distributed as dist

from megatron.core import dist_checkpointing

from ..compat.versions import MEGATRON_CORE_VERSION
from ..ddp import HiggsDDP
from .manifest import (CHECKPOINT_NAME, LATEST, MANIFEST_NAME, CheckpointError, Layout, Manifest, ShardRecord,
                       committed_checkpoints, current_layout, verify_files)
from .outcome import same_outcome_everywhere
from .state import (TrainingState, owner_written_optimizer_state, prepare_fresh_optimizer_for_load,
                    restore_rng_state, shard_records, sharded_training_state, tolerate_torch_adam_step,
                    untie_adam_steps)

RECOVERY_MODES = ("same-sharding", "reshard")
VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


# --- the vocabulary padding ---------------------------------------------------------------

def padded_rows(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron-LM's rule: the vocabulary padded to a multiple of divisible-by x TP."""
    multiple = divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_record(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> dict:
    """What the rank map records (``Manifest.vocab``)."""
    return {"vocab_size": vocab_size, "make_vocab_size_divisible_by": divisible_by,
            "padded_vocab_size": padded_rows(vocab_size, divisible_by, tensor_model_parallel_size)}


def recorded_vocab(manifest: Manifest, now: dict | None) -> dict | None:
    """The rank map's vocabulary record; for a rank map from before it was recorded, one made
    from the flags (``now``: the true size, which the tokenizer fixes) and the saved word
    embedding's rows (the divisor then unknown)."""
    if manifest.vocab or now is None:
        return manifest.vocab
    rows = {s.global_shape[0] for r in manifest.ranks for s in r.shards if is_vocab_key(s.key)}
    if len(rows) != 1:
        return None
    return {"vocab_size": now["vocab_size"], "make_vocab_size_divisible_by": None, "padded_vocab_size": rows.pop()}


def is_vocab_key(key: str) -> bool:
    """The word embedding, the output layer, and their optimizer state (same suffix)."""
    return key.endswith(VOCAB_SUFFIXES)


def divisor_keeping(saved: dict, tensor_model_parallel_size: int) -> int | None:
    """The smallest ``--make-vocab-size-divisible-by`` (not below the saved one, when recorded)
    that keeps the saved record's padded rows at this TP; None when none does."""
    rows = saved["padded_vocab_size"]
    for divisor in range(saved["make_vocab_size_divisible_by"] or 1, rows // tensor_model_parallel_size + 1):
        if padded_rows(saved["vocab_size"], divisor, tensor_model_parallel_size) == rows:
            return divisor
    return None


@dataclass(frozen=True)
class PaddingChange:
    key: str
    saved_rows: int
    target_rows: int
    vocab_size: int

    def describe(self) -> str:
        how = "padding trimmed" if self.target_rows < self.saved_rows else "padding extended with zeros"
        return (f"{self.key}: {self.saved_rows} rows in the checkpoint, {self.target_rows} at the target "
                f"(the first {self.vocab_size} are the vocabulary; {how})")


def padding_changes(manifest: Manifest, saved: dict, now: dict) -> list[PaddingChange]:
    """The saved tensors whose padded rows differ between two vocabulary records."""
    rows, target = saved["padded_vocab_size"], now["padded_vocab_size"]
    if target == rows:
        return []
    keys = sorted({s.key for r in manifest.ranks for s in r.shards if is_vocab_key(s.key) and s.global_shape[0] == rows})
    return [PaddingChange(key, rows, target, saved["vocab_size"]) for key in keys]


# --- the rules ---------------------------------------------------------------------------

_LAYOUT_NAMES = {
    "world_size": "world size",
    "tensor_model_parallel_size": "tensor-model-parallel size",
    "pipeline_model_parallel_size": "pipeline-model-parallel size",
    "data_parallel_size": "data-parallel size",
    "context_parallel_size": "context-parallel size",
    "expert_model_parallel_size": "expert-model-parallel size",
    "use_distributed_optimizer": "distributed optimizer",
    "virtual_pipeline_model_parallel_size": "virtual pipeline stages per rank",
    "num_distributed_optimizer_instances": "distributed-optimizer instances",
    "expert_tensor_parallel_size": "expert-tensor-parallel size (none: the tensor-parallel size)",
}


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def layout_differences(saved: Layout, now: Layout) -> list[str]:
    return [f"{label}: checkpoint {_show(getattr(saved, name))}, now {_show(getattr(now, name))}"
            for name, label in _LAYOUT_NAMES.items() if getattr(saved, name) != getattr(now, name)]


def vocab_differences(saved: dict | None, now: dict | None, tensor_model_parallel_size: int) -> list[str]:
    """The padded vocabulary, saved (``recorded_vocab``) against now (``vocab_record``),
    naming the divisor that would keep the saved rows; raises when the true sizes differ (another
    tokenizer: no layout can load it)."""
    if saved is None or now is None:
        return []
    if saved["vocab_size"] != now["vocab_size"] or saved["padded_vocab_size"] < now["vocab_size"]:
        raise CheckpointError(f"vocabulary: checkpoint {saved['vocab_size']} tokens in {saved['padded_vocab_size']} "
                              f"rows, now {now['vocab_size']} tokens (another tokenizer); no --recovery-mode loads it")
    if saved["padded_vocab_size"] == now["padded_vocab_size"]:
        return []
    keeping = divisor_keeping(saved, tensor_model_parallel_size)
    hint = (f"--make-vocab-size-divisible-by {keeping} would keep {saved['padded_vocab_size']}" if keeping else
            f"no --make-vocab-size-divisible-by keeps {saved['padded_vocab_size']} at this tensor-parallel size")
    return [f"padded vocabulary: checkpoint {saved['padded_vocab_size']} rows, now {now['padded_vocab_size']} "
            f"(--make-vocab-size-divisible-by {now['make_vocab_size_divisible_by']}; {hint})"]


def check_layout(path: Path, saved: Layout, now: Layout, recovery_mode: str,
                 saved_vocab: dict | None = None, now_vocab: dict | None = None) -> list[str]:
    """The differences between ``saved`` and ``now`` (layout, then padded vocabulary); raises
    ``CheckpointError`` naming each when ``recovery_mode`` is ``same-sharding`` and there are any."""
    if recovery_mode not in RECOVERY_MODES:
        raise CheckpointError(f"--recovery-mode {recovery_mode!r}: expected one of {', '.join(RECOVERY_MODES)}")
    differences = layout_differences(saved, now) + vocab_differences(saved_vocab, now_vocab,
                                                                      now.tensor_model_parallel_size)
    if differences and recovery_mode == "same-sharding":
        raise CheckpointError(f"{path} was saved with another layout; --recovery-mode same-sharding refuses to load "
                              "it (use --recovery-mode reshard to move to this layout):\n  " + "\n  ".join(differences))
    return differences


def _intersection_volume(a: ShardRecord, b: ShardRecord) -> int:
    volume = 1
    for a0, an, b0, bn in zip(a.global_offset, a.local_shape, b.global_offset, b.local_shape):
        overlap = min(a0 + an, b0 + bn) - max(a0, b0)
        if overlap <= 0:
            return 0
        volume *= overlap
    return volume


def _clipped(need: ShardRecord, rows: int) -> ShardRecord:
    """The part of ``need`` within the first ``rows`` rows (empty past them)."""
    start = min(need.global_offset[0], rows)
    end = min(need.global_offset[0] + need.local_shape[0], rows)
    return ShardRecord(need.key, need.global_shape, [start, *need.global_offset[1:]],
                       [end - start, *need.local_shape[1:]])


def uncovered_shards(manifest: Manifest, needed: list[ShardRecord]) -> list[str]:
    """Describe each needed shard that the saved shards do not cover; empty when all are."""
    saved: dict[str, list[ShardRecord]] = {}
    for rank in manifest.ranks:
        for shard in rank.shards:
            saved.setdefault(shard.key, []).append(shard)
    problems = []
    for need in needed:
        pieces = saved.get(need.key)
        if not pieces:
            problems.append(f"{need.key}: not in the checkpoint")
            continue
        saved_shape = pieces[0].global_shape
        if saved_shape != need.global_shape:
            if not (is_vocab_key(need.key) and saved_shape[1:] == need.global_shape[1:]):
                problems.append(f"{need.key}: global shape {saved_shape} in the checkpoint, {need.global_shape} now")
                continue
            need = _clipped(need, saved_shape[0])  # padding rows: loaded where saved, zeros past them
        covered = sum(_intersection_volume(need, piece) for piece in pieces)
        if covered != math.prod(need.local_shape):
            problems.append(f"{need.key}: offset {need.global_offset} shape {need.local_shape} is only "
                            f"{covered}/{math.prod(need.local_shape)} covered by saved shards")
    return problems


# --- choosing and loading -------------------------------------------------------------

@dataclass
class LoadResult:
    path: Path
    manifest: Manifest
    resharded: bool
    warning: str | None = None
    differences: list[str] = field(default_factory=list)  # the layout's, when resharded


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
            raise CheckpointError(f"--checkpoint-version {version}: {load_dir / CHECKPOINT_NAME.format(version)} is not a "
                                  f"committed checkpoint (committed: {', '.join(map(str, committed)) or 'none'})")
        return load_dir / CHECKPOINT_NAME.format(version), None
    pointer_file = load_dir / pointer
    named = None
    if pointer_file.exists():
        text = pointer_file.read_text().strip()
        named = int(text) if text.isdigit() else None
    if named is not None and named in committed:
        return load_dir / CHECKPOINT_NAME.format(named), None
    if not committed and named is not None:
        raise CheckpointError(f"{pointer_file} names iteration {named}, but {load_dir / CHECKPOINT_NAME.format(named)} is "
                              "not a committed checkpoint, and none is")
    if not committed:
        uncommitted = [p.name for p in load_dir.glob("iter_*")
                       if p.is_dir() and p.suffix != ".tmp" and not (p / MANIFEST_NAME).exists()]
        if uncommitted:
            raise CheckpointError(f"{load_dir}: {', '.join(sorted(uncommitted))} has no rank map (saved without "
                                  "--use-higgs, or interrupted before its commit); load it without --use-higgs, "
                                  "or start from an empty --load directory")
        return None, None
    chosen = load_dir / CHECKPOINT_NAME.format(committed[-1])
    said = f"names iteration {named}, which has no rank map (not committed)" if named is not None else (
        "is missing or unreadable")
    return chosen, f"{pointer_file} {said}; loading the newest committed checkpoint, {chosen}"


def agreed_problems(local_problems: list[str]) -> list[str]:
    """Every rank's problems, on every rank (sorted, without repeats)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local_problems)
    return sorted({p for rank_problems in gathered for p in rank_problems})


def agree(local_problems: list[str], what: str) -> None:
    """All ranks learn every rank's problems; raise the same error everywhere."""
    problems = agreed_problems(local_problems)
    if problems:
        raise CheckpointError(f"{what}:\n  " + "\n  ".join(problems))


def newer_release(written_by: str, running: str = MEGATRON_CORE_VERSION) -> str | None:
    """Why a checkpoint written under megatron-core ``written_by`` cannot be loaded under
    ``running`` (None: it can). A release reads its elders' checkpoints, not newer ones: from
    0.17 the common state is no longer a ``common.pt`` of its own, which 0.16 looks for."""
    def minor(version: str) -> tuple[int, ...]:
        return tuple(int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:2])
    if minor(written_by) > minor(running):
        return (f"it was written under megatron-core {written_by}, newer than this run's {running}, which cannot "
                f"read it: resume under megatron-core {'.'.join(written_by.split('.')[:2])} (Python 3.12 for 0.19)")
    return None


def older_committed(load_dir: str | Path, chosen: Path) -> list[Path]:
    """The committed checkpoints under ``load_dir`` other than ``chosen``, newest first: where a
    load falls back to when ``chosen`` fails its integrity check."""
    return [Path(load_dir) / CHECKPOINT_NAME.format(i) for i in reversed(committed_checkpoints(Path(load_dir)))
            if Path(load_dir) / CHECKPOINT_NAME.format(i) != chosen]


def _rank_0_chooses(load_dir: str | Path, version: int | None, pointer: str) -> list[Path]:
    """``choose_checkpoint`` on rank 0, broadcast: the checkpoints to try in order (the choice,
    then, unless ``version`` named it, the others newest first), its warning last; [] for a
    fresh start. Every rank gets the same list or the same error, whatever its view of a shared
    filesystem's directory (attribute caches) would have said."""
    plan: list = [None, None]  # the checkpoints to try (or rank 0's error), the warning
    if dist.get_rank() == 0:
        try:
            path, plan[1] = choose_checkpoint(load_dir, version, pointer)
            plan[0] = [] if path is None else [path, *(older_committed(load_dir, path) if version is None else [])]
        except CheckpointError as error:
            plan[0] = error
    dist.broadcast_object_list(plan, src=0)
    if isinstance(plan[0], CheckpointError):
        raise plan[0]
    return [*plan[0], plan[1]]


def _agreed_manifest(path: Path) -> tuple[Manifest | None, list[str]]:
    """``path``'s rank map as every rank reads it, and the problems that make the checkpoint
    unusable (agreed): rank 0's reading (its SHA-256 broadcast) is the one; a rank that reads
    other bytes is an error, never a fallback (the checkpoint is not damaged; that rank's view
    of the filesystem is stale)."""
    said: list = [None, None]  # SHA-256 of the rank map's bytes, or why it cannot be read
    if dist.get_rank() == 0:
        try:
            said[0] = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
            Manifest.read(path)
        except (OSError, CheckpointError) as error:
            said = [None, str(error)]
    dist.broadcast_object_list(said, src=0)
    if said[1] is not None:
        return None, [said[1]]
    try:  # a rank that cannot read it says so in the agreement, rather than leave the others waiting there
        mine = (path / MANIFEST_NAME).read_bytes()
        problem = [] if hashlib.sha256(mine).hexdigest() == said[0] else [
            f"rank {dist.get_rank()} reads other bytes than rank 0 (a stale cache of a shared filesystem?)"]
    except OSError as error:
        problem = [f"rank {dist.get_rank()} cannot read it: {error}"]
    agree(problem, f"{path / MANIFEST_NAME} is not the same on every rank")
    manifest = Manifest.from_json(mine.decode(), str(path / MANIFEST_NAME))
    return manifest, agreed_problems(verify_files(path, manifest, dist.get_rank(), dist.get_world_size()))


def validated_checkpoint(load_dir: str | Path, version: int | None, recovery_mode: str, layout: Layout,
                         vocab: dict | None, pointer: str = LATEST) -> LoadResult | None:
    """Both front-ends' first steps of a load, collective (the module docstring's order): the
    checkpoint rank 0 chooses, or the newest older one when it fails its integrity check
    (named in the warning; never under ``version``), with its rank map, its layout checked
    against ``layout`` (``same-sharding`` refuses any difference; the differences make
    ``resharded``). None when ``load_dir`` holds no checkpoint."""
    *tried, warning = _rank_0_chooses(load_dir, version, pointer)
    if not tried:
        return None
    warnings = [warning] if warning else []
    for index, path in enumerate(tried):
        manifest, problems = _agreed_manifest(path)
        if not problems:
            break
        if version is not None or index == len(tried) - 1:
            raise CheckpointError(f"{path} failed its integrity check" + (
                "" if version is not None else " (as did every older committed checkpoint)") + ":\n  "
                + "\n  ".join(problems))
        warnings.append(f"{path} failed its integrity check ({'; '.join(problems)}); falling back to "
                        f"{tried[index + 1]}")
    unreadable = newer_release(manifest.versions.get("megatron_core", "0.0"))
    if unreadable:
        raise CheckpointError(f"{path}: {unreadable}")
    differences = check_layout(path, manifest.layout, layout, recovery_mode, recorded_vocab(manifest, vocab), vocab)
    return LoadResult(path=path, manifest=manifest, resharded=bool(differences),
                      warning="; ".join(warnings) or None, differences=differences)


def check_reshard_plan(chosen: LoadResult, state: dict) -> None:
    """The last step before the files are read, both front-ends (collective): for a reshard,
    every shard ``state`` (the sharded state dict about to be loaded) needs must be tiled by
    the saved shards (``uncovered_shards``); the same error on every rank otherwise."""
    agree(uncovered_shards(chosen.manifest, shard_records(state, main_replica_only=False)) if chosen.resharded
          else [], f"{chosen.path} cannot be resharded to this layout")


@contextlib.contextmanager
def restoring(optimizer) -> Iterator[None]:
    """Around the load of an optimizer's state, both front-ends: megatron-core 0.16.1's
    distributed optimizer on torch Adam (no TE/Apex) cannot load into a fresh optimizer, nor
    fill ``fully_reshardable`` state, without these (``checkpoint.state``)."""
    if optimizer is not None:
        prepare_fresh_optimizer_for_load(optimizer)
    with owner_written_optimizer_state(), tolerate_torch_adam_step():
        yield
    if optimizer is not None:
        untie_adam_steps(optimizer)


def load_checkpoint(training: TrainingState, load_dir: str | Path, recovery_mode: str = "same-sharding",
                    version: int | None = None) -> LoadResult | None:
    """Restore ``training`` from the chosen checkpoint; None when ``load_dir`` holds none. The
    warning of ``choose_checkpoint``, if any, is ``LoadResult.warning``. Per-rank state (RNG,
    error-feedback residuals) is restored only with the same layout."""
    chosen = validated_checkpoint(load_dir, version, recovery_mode,
                                  current_layout(training.use_distributed_optimizer), training.vocab)
    if chosen is None:
        return None
    with same_outcome_everywhere(f"checkpoint {chosen.path} not loaded"):
        with restoring(training.optimizer):
            state = sharded_training_state(training, is_loading=True, per_rank=not chosen.resharded)
            check_reshard_plan(chosen, state)
            loaded = dist_checkpointing.load(state, str(chosen.path))
            training.model[0].module.load_state_dict(loaded["model"])
            optimizer_state = loaded["optimizer"]
            residuals = optimizer_state.pop("higgs_residuals", None)
            getattr(training.optimizer, "inner", training.optimizer).load_state_dict(optimizer_state)
        if not chosen.resharded:
            restore_rng_state(loaded["rng"])
        training.scheduler.load_state_dict(loaded["scheduler"])
        for chunk, saved in zip((c for c in training.model if isinstance(c, HiggsDDP)), residuals or ()):
            chunk.load_residual_state(saved)
    training.iteration = loaded["iteration"]
    training.consumed_samples = loaded["consumed_samples"]
    return chosen
