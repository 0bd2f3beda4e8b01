"""Judge a checkpoint without launching a job: ``higgs-megatron checkpoint inspect|verify|plan``.

Everything here reads the rank map and, for ``verify``, the files it names: no process group,
no model, no tensor loaded. It serves checkpoints of both front-ends (our pretrain script's
``latest`` pointer, Megatron-LM's ``latest_checkpointed_iteration.txt``).

* ``inspect``: each committed checkpoint's iteration, consumed samples, layout, bytes per rank,
  higgs config and versions; the pointers and what they name; any uncommitted directory.
* ``verify``: every file's SHA-256 against the rank map, naming each bad or missing file and
  the rank that wrote it.
* ``plan``: would the checkpoint load at a given layout under ``same-sharding``, and under
  ``reshard``? Every layout difference, every tensor the saved shards do not tile, every tensor
  whose global shape the new layout changes (the vocabulary padding), and the per-rank state
  that ``reshard`` resets by the written policy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .manifest import MANIFEST_NAME, CheckpointError, Layout, Manifest, ShardRecord
from .load import choose_checkpoint
from .load import layout_differences, padding_changes, recorded_vocab, uncovered_shards, vocab_differences, vocab_record
from .manifest import CHECKPOINT_NAME, LATEST, MEGATRON_LM_TRACKER, committed_checkpoints, verify_files


def _pointers(save_dir: Path) -> dict[str, str]:
    return {name: (save_dir / name).read_text().strip() for name in (LATEST, MEGATRON_LM_TRACKER)
            if (save_dir / name).is_file()}


def checkpoint_paths(directory: str | Path, version: int | None = None,
                     every: bool = False) -> list[Path]:
    """The committed checkpoints ``directory`` names: itself when it holds a rank map; else, in a
    save directory, every committed one (``every``, or only ``version``), or the one a resume
    would load (``load.choose_checkpoint``, by whichever front-end's pointer is there)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such directory")
    if (directory / MANIFEST_NAME).exists() or directory.name.startswith("iter_"):
        Manifest.read(directory)  # a clear error when it was never committed
        return [directory]
    if every and version is None:
        committed = committed_checkpoints(directory)
        if committed:
            return [directory / CHECKPOINT_NAME.format(i) for i in committed]
    pointer = LATEST if (directory / LATEST).is_file() or not (directory / MEGATRON_LM_TRACKER).is_file() \
        else MEGATRON_LM_TRACKER
    path, _ = choose_checkpoint(directory, version, pointer=pointer)
    if path is None:
        raise CheckpointError(f"{directory}: no committed checkpoint (no iter_* directory with a {MANIFEST_NAME})")
    return [path]


def _layout_text(layout: Layout) -> str:
    extra = [f"{name} {value}" for name, value in (("VPP", layout.virtual_pipeline_model_parallel_size),
                                                   ("ETP", layout.expert_tensor_parallel_size)) if value is not None]
    if layout.num_distributed_optimizer_instances > 1:
        extra.append(f"{layout.num_distributed_optimizer_instances} optimizer instances")
    return (f"TP {layout.tensor_model_parallel_size} x PP {layout.pipeline_model_parallel_size} x "
            f"DP {layout.data_parallel_size} (CP {layout.context_parallel_size}, EP {layout.expert_model_parallel_size}"
            + "".join(f", {e}" for e in extra) + f"; world {layout.world_size}), "
            f"distributed optimizer {'on' if layout.use_distributed_optimizer else 'off'}")


def describe(path: Path) -> dict:
    """One committed checkpoint as ``inspect`` reports it."""
    manifest = Manifest.read(path)
    ranks = [{"rank": r.rank, "host": r.host, "coords": r.coords, "files": len(r.files),
              "bytes": sum(f.bytes for f in r.files)} for r in manifest.ranks]
    return {"path": str(path), "iteration": manifest.iteration, "consumed_samples": manifest.consumed_samples,
            "created": manifest.created, "layout": asdict(manifest.layout), "ranks": ranks,
            "bytes": sum(r["bytes"] for r in ranks), "tensors": len({s.key for r in manifest.ranks for s in r.shards}),
            "higgs": manifest.higgs, "vocab": manifest.vocab, "versions": manifest.versions}


def inspect(directory: str | Path, version: int | None = None) -> dict:
    """The committed checkpoints (all, or ``version``), pointers and uncommitted directories."""
    directory = Path(directory)
    paths = checkpoint_paths(directory, version, every=True)
    save_dir = paths[0].parent if paths[0] != directory else directory.parent
    uncommitted = sorted(p.name for p in save_dir.glob("iter_*")
                         if p.is_dir() and (p.suffix == ".tmp" or not (p / MANIFEST_NAME).exists()))
    return {"directory": str(save_dir), "pointers": _pointers(save_dir),
            "checkpoints": [describe(p) for p in paths], "uncommitted": uncommitted}


def verify(directory: str | Path, version: int | None = None) -> dict:
    """SHA-256 of every file of the chosen checkpoint against its rank map."""
    path = checkpoint_paths(directory, version)[0]
    manifest = Manifest.read(path)
    problems = verify_files(path, manifest, rank=0, world_size=1)
    return {"path": str(path), "files": sum(len(r.files) for r in manifest.ranks), "problems": problems}


@dataclass
class Plan:
    path: str
    saved: dict
    target: dict
    differences: list[str]
    same_sharding: bool
    reshard: bool
    reshard_problems: list[str] = field(default_factory=list)
    reshaped: list[str] = field(default_factory=list)
    resets: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _whole_tensors(manifest: Manifest) -> list[ShardRecord]:
    shapes: dict[str, list[int]] = {}
    for rank in manifest.ranks:
        for shard in rank.shards:
            shapes.setdefault(shard.key, shard.global_shape)
    return [ShardRecord(key, shape, [0] * len(shape), list(shape)) for key, shape in sorted(shapes.items())]


def _overlapping(manifest: Manifest) -> list[str]:
    """Tensors whose saved shards hold more than the tensor's volume (shards written twice)."""
    volume: dict[str, int] = {}
    whole: dict[str, int] = {}
    for rank in manifest.ranks:
        for shard in rank.shards:
            volume[shard.key] = volume.get(shard.key, 0) + math.prod(shard.local_shape)
            whole[shard.key] = math.prod(shard.global_shape)
    return [f"{key}: saved shards hold {volume[key]} elements of {whole[key]}" for key in sorted(volume)
            if volume[key] > whole[key]]


def plan(directory: str | Path, target: Layout, version: int | None = None,
         divisible_by: int | None = None, vocab_size: int | None = None) -> Plan:
    """Would the chosen checkpoint load at ``target``? ``divisible_by`` is the target's
    ``--make-vocab-size-divisible-by`` (default: the saved one); ``vocab_size`` the true
    vocabulary size, for a checkpoint whose rank map does not record it. A target whose
    ``use_distributed_optimizer`` is None takes the saved one."""
    path = checkpoint_paths(directory, version)[0]
    manifest = Manifest.read(path)
    saved = manifest.layout
    if target.use_distributed_optimizer is None:
        target = replace(target, use_distributed_optimizer=saved.use_distributed_optimizer)
    differences = layout_differences(saved, target)
    result = Plan(path=str(path), saved=asdict(saved), target=asdict(target), differences=differences,
                  same_sharding=not differences, reshard=True)
    model_parallel = (target.tensor_model_parallel_size * target.pipeline_model_parallel_size
                      * target.context_parallel_size)
    if target.world_size != model_parallel * target.data_parallel_size:
        result.reshard_problems.append(f"world size {target.world_size} is not TP x PP x CP x DP = "
                                       f"{model_parallel * target.data_parallel_size}")
    result.reshard_problems += uncovered_shards(manifest, _whole_tensors(manifest)) + _overlapping(manifest)

    now_vocab = _target_vocab(manifest, target.tensor_model_parallel_size, divisible_by, vocab_size, result.notes)
    if now_vocab is not None:  # the load's own rule (load.py, rank_map.py)
        saved_vocab = recorded_vocab(manifest, now_vocab)
        try:
            padding = vocab_differences(saved_vocab, now_vocab, target.tensor_model_parallel_size)
        except CheckpointError as error:
            result.same_sharding = False
            result.reshard_problems.append(str(error))
            padding = []
        if padding:
            result.same_sharding = False
            result.differences = differences + padding
            result.reshaped = [change.describe() for change in padding_changes(manifest, saved_vocab, now_vocab)]
    if result.differences:
        result.resets.append("RNG states: reseeded from --seed plus the iteration")
        if manifest.higgs is not None and manifest.higgs.get("error_feedback", True):
            result.resets.append("error-feedback residuals: start from zero")
    result.reshard = not result.reshard_problems
    return result


def _target_vocab(manifest: Manifest, tensor_model_parallel_size: int, divisible_by: int | None,
                  vocab_size: int | None, notes: list[str]) -> dict | None:
    """The target's vocabulary record: the true size given, else recorded; the divisor given,
    else the saved one. None (with a note) when either is unknown."""
    recorded = manifest.vocab or {}
    vocab_size = vocab_size or recorded.get("vocab_size")
    divisible_by = divisible_by or recorded.get("make_vocab_size_divisible_by")
    if vocab_size is None or divisible_by is None:
        notes.append("the rank map does not record the vocabulary (a checkpoint from before it did): give "
                     "--vocab-size and --make-vocab-size-divisible-by to check its padding")
        return None
    return vocab_record(vocab_size, divisible_by, tensor_model_parallel_size)


def format_inspect(report: dict) -> str:
    lines = [f"{report['directory']}"]
    for name, text in report["pointers"].items():
        lines.append(f"  pointer {name}: {text}")
    for c in report["checkpoints"]:
        layout = Layout(**c["layout"])
        lines += [f"  {Path(c['path']).name}: iteration {c['iteration']}, consumed samples {c['consumed_samples']}, "
                  f"created {c['created']}",
                  f"    layout: {_layout_text(layout)}",
                  f"    {c['tensors']} tensors, {c['bytes'] / 1e6:.2f} MB in all; per rank: " + ", ".join(
                      f"{r['rank']} ({r['host']}, tp {r['coords'].get('tp', 0)} pp {r['coords'].get('pp', 0)} "
                      f"dp {r['coords'].get('dp', 0)}): {r['files']} files {r['bytes'] / 1e6:.2f} MB" for r in c["ranks"]),
                  "    higgs: " + (", ".join(f"{k}={v}" for k, v in c["higgs"].items()) if c["higgs"] else "off"),
                  "    vocab: " + (", ".join(f"{k}={v}" for k, v in c["vocab"].items()) if c["vocab"] else "not recorded"),
                  "    versions: " + ", ".join(f"{k} {v}" for k, v in c["versions"].items())]
    lines.append("  uncommitted: " + (", ".join(report["uncommitted"]) or "none"))
    return "\n".join(lines)


def format_verify(report: dict) -> str:
    if not report["problems"]:
        return f"{report['path']}: all {report['files']} files match the rank map"
    return "\n".join([f"{report['path']}: {len(report['problems'])} of {report['files']} files do not match "
                      "the rank map:"] + [f"  {p}" for p in report["problems"]])


def format_plan(result: Plan) -> str:
    lines = [f"{result.path}",
             f"  saved:  {_layout_text(Layout(**result.saved))}",
             f"  target: {_layout_text(Layout(**result.target))}",
             "  differences:" + (" none" if not result.differences else ""),
             *[f"    {d}" for d in result.differences],
             f"  --recovery-mode same-sharding: {'loads' if result.same_sharding else 'refused'}",
             f"  --recovery-mode reshard: {'loads' if result.reshard else 'refused'}",
             *[f"    cannot: {p}" for p in result.reshard_problems],
             *[f"    reshaped: {r}" for r in result.reshaped],
             *[f"    resets: {r}" for r in result.resets],
             *[f"  note: {n}" for n in result.notes]]
    return "\n".join(lines)
