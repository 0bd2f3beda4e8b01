"""Every rule a checkpoint must pass before anything is loaded, in one place.

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
* ``verify_files``: SHA-256 of the files a rank is asked to check against the rank map; a
  missing file or a mismatch is named with the rank that wrote it.
"""

from __future__ import annotations

import math
from pathlib import Path

from .manifest import CheckpointError, FileRecord, Layout, Manifest, ShardRecord, sha256_of
from .vocab import divisor_keeping, is_vocab_key

RECOVERY_MODES = ("same-sharding", "reshard")

_LAYOUT_NAMES = {
    "world_size": "world size",
    "tensor_model_parallel_size": "tensor-model-parallel size",
    "pipeline_model_parallel_size": "pipeline-model-parallel size",
    "data_parallel_size": "data-parallel size",
    "context_parallel_size": "context-parallel size",
    "expert_model_parallel_size": "expert-model-parallel size",
    "use_distributed_optimizer": "distributed optimizer",
}


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def layout_differences(saved: Layout, now: Layout) -> list[str]:
    return [f"{label}: checkpoint {_show(getattr(saved, name))}, now {_show(getattr(now, name))}"
            for name, label in _LAYOUT_NAMES.items() if getattr(saved, name) != getattr(now, name)]


def vocab_differences(saved: dict | None, now: dict | None, tensor_model_parallel_size: int) -> list[str]:
    """The padded vocabulary, saved (``vocab.recorded_vocab``) against now (``vocab.vocab_record``),
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


def verify_files(checkpoint_dir: Path, manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """Check this rank's share of all files (file i is checked by rank i mod world)."""
    records: list[tuple[FileRecord, int]] = [(f, r.rank) for r in manifest.ranks for f in r.files]
    problems = []
    for index, (record, writer) in enumerate(sorted(records, key=lambda x: x[0].path)):
        if index % world_size != rank:
            continue
        path = checkpoint_dir / record.path
        if not path.exists():
            problems.append(f"{path}: missing (written by rank {writer})")
        elif sha256_of(path) != record.sha256:
            problems.append(f"{path}: SHA-256 does not match the rank map (written by rank {writer})")
    return problems
