"""What a checkpoint must pass, in one process: shard coverage, the vocabulary's padding, the rank
map's file, and which checkpoint a load chooses."""

import json

import pytest

from higgs_megatron.checkpoint.manifest import CheckpointError, Layout, Manifest, RankRecord, ShardRecord
from higgs_megatron.checkpoint.load import uncovered_shards


def _layout(**sizes) -> Layout:
    base = dict(world_size=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=2,
                context_parallel_size=1, expert_model_parallel_size=1, use_distributed_optimizer=False)
    return Layout(**{**base, **sizes})


def _manifest(shards_per_rank: list[list[ShardRecord]]) -> Manifest:
    return Manifest(iteration=3, consumed_samples=24, layout=_layout(), higgs=None, versions={}, created="now",
                    ranks=[RankRecord(rank=r, host="h", coords={}, shards=s) for r, s in enumerate(shards_per_rank)])


def test_coverage_needs_every_element_tiled_and_the_same_global_shape():
    halves = [[ShardRecord("w", [4, 6], [0, 0], [2, 6])], [ShardRecord("w", [4, 6], [2, 0], [2, 6])]]
    whole = ShardRecord("w", [4, 6], [0, 0], [4, 6])
    assert uncovered_shards(_manifest(halves), [whole]) == []
    assert uncovered_shards(_manifest(halves), [ShardRecord("w", [4, 6], [1, 2], [2, 3])]) == []
    missing_half = uncovered_shards(_manifest(halves[:1]), [whole])
    assert missing_half == ["w: offset [0, 0] shape [4, 6] is only 12/24 covered by saved shards"]
    assert uncovered_shards(_manifest(halves), [ShardRecord("w", [5, 6], [0, 0], [5, 6])]) == [
        "w: global shape [4, 6] in the checkpoint, [5, 6] now"]
    assert uncovered_shards(_manifest(halves), [ShardRecord("b", [4], [0], [4])]) == ["b: not in the checkpoint"]


def test_vocabulary_padding_rows_are_clipped_to_what_both_shapes_hold():
    from higgs_megatron.checkpoint.load import (divisor_keeping, padded_rows, recorded_vocab, vocab_differences,
                                                vocab_record)

    assert [padded_rows(257, 128, tp) for tp in (1, 2, 4)] == [384, 512, 512]
    assert divisor_keeping(vocab_record(257, 128, 2), 1) == 256
    assert divisor_keeping(vocab_record(257, 128, 1), 2) == 192  # the smallest not below the saved divisor
    assert divisor_keeping(vocab_record(257, 128, 1), 4) is None  # 384 rows at TP=4 need a divisor of 96
    key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    saved = _manifest([[ShardRecord(key, [512, 8], [0, 0], [256, 8])], [ShardRecord(key, [512, 8], [256, 0], [256, 8])]])
    # TP=1 needs 384 rows, TP=4 (divisor 64) needs 256 per rank of 1024: past 512, nothing is read
    assert uncovered_shards(saved, [ShardRecord(key, [384, 8], [0, 0], [384, 8])]) == []
    assert uncovered_shards(saved, [ShardRecord(key, [1024, 8], [768, 0], [256, 8])]) == []
    assert uncovered_shards(saved, [ShardRecord(key, [384, 16], [0, 0], [384, 16])]) == [
        f"{key}: global shape [512, 8] in the checkpoint, [384, 16] now"]
    other = "decoder.final_layernorm.weight"
    assert uncovered_shards(_manifest([[ShardRecord(other, [8], [0], [8])]]), [ShardRecord(other, [4], [0], [4])])
    assert vocab_differences(vocab_record(257, 128, 2), vocab_record(257, 128, 1), 1) == [
        "padded vocabulary: checkpoint 512 rows, now 384 (--make-vocab-size-divisible-by 128; "
        "--make-vocab-size-divisible-by 256 would keep 512)"]
    assert vocab_differences(vocab_record(257, 128, 2), vocab_record(257, 256, 1), 1) == []
    assert vocab_differences(None, vocab_record(257, 128, 1), 1) == []
    # A rank map from before the record: the true size from the flags, the padded rows from the shapes.
    older = recorded_vocab(saved, vocab_record(257, 128, 1))
    assert older == {"vocab_size": 257, "make_vocab_size_divisible_by": None, "padded_vocab_size": 512}
    assert vocab_differences(older, vocab_record(257, 128, 1), 1) == [
        "padded vocabulary: checkpoint 512 rows, now 384 (--make-vocab-size-divisible-by 128; "
        "--make-vocab-size-divisible-by 256 would keep 512)"]
    with pytest.raises(CheckpointError, match="vocabulary: checkpoint 257 tokens in 512 rows, now 300 tokens"):
        vocab_differences(vocab_record(257, 128, 2), vocab_record(300, 128, 2), 2)
    # An older rank map whose rows cannot hold today's vocabulary: another tokenizer, not padding.
    with pytest.raises(CheckpointError, match="checkpoint 600 tokens in 512 rows, now 600 tokens"):
        vocab_differences(recorded_vocab(saved, vocab_record(600, 128, 1)), vocab_record(600, 128, 1), 1)


def test_the_rank_map_round_trips_and_refuses_malformed_or_future_files():
    manifest = _manifest([[ShardRecord("w", [4], [0], [4])], []])
    assert Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(CheckpointError, match="x.json: not valid JSON"):
        Manifest.from_json("{", "x.json")
    raw = json.loads(manifest.to_json())
    with pytest.raises(CheckpointError, match="schema version 2, this higgs-megatron reads 1"):
        Manifest.from_json(json.dumps({**raw, "schema_version": 2}))
    del raw["ranks"][0]["files"]
    with pytest.raises(CheckpointError, match="missing or malformed field"):
        Manifest.from_json(json.dumps(raw))


def _committed(load_dir, iteration):
    path = load_dir / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "rank_map.json").write_text("{}")
    return path


def test_choose_checkpoint_one_rule_for_both_front_ends(tmp_path):
    from higgs_megatron.checkpoint.load import choose_checkpoint

    assert choose_checkpoint(tmp_path / "absent") == (None, None)  # nothing there: a fresh start
    (tmp_path / "iter_0000009.tmp").mkdir()
    assert choose_checkpoint(tmp_path) == (None, None)  # an interrupted save is never loaded
    first, second = _committed(tmp_path, 3), _committed(tmp_path, 6)
    (tmp_path / "latest").write_text("3\n")
    assert choose_checkpoint(tmp_path) == (first, None)  # the pointer, when it names a committed one
    assert choose_checkpoint(tmp_path, version=6) == (second, None)
    with pytest.raises(CheckpointError, match="--checkpoint-version 5: .* is not a committed checkpoint "
                                              r"\(committed: 3, 6\)"):
        choose_checkpoint(tmp_path, version=5)
    for pointer_text, said in (("9\n", "names iteration 9, which has no rank map"), ("garbage", "is missing or"
                                                                                               " unreadable")):
        (tmp_path / "latest").write_text(pointer_text)
        path, warning = choose_checkpoint(tmp_path)
        assert path == second and said in warning and str(second) in warning  # the newest, said aloud
    (tmp_path / "latest").unlink()
    assert choose_checkpoint(tmp_path)[0] == second
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("3")
    assert choose_checkpoint(tmp_path, pointer=tracker.name) == (first, None)  # Megatron-LM's pointer


def test_choose_checkpoint_refuses_what_it_cannot_trust_when_nothing_is_committed(tmp_path):
    from higgs_megatron.checkpoint.load import choose_checkpoint

    (tmp_path / "latest").write_text("4\n")
    with pytest.raises(CheckpointError, match="names iteration 4, but .* is not a committed checkpoint, and none is"):
        choose_checkpoint(tmp_path)
    (tmp_path / "latest").unlink()
    (tmp_path / "iter_0000004").mkdir()  # written without a rank map
    with pytest.raises(CheckpointError, match="iter_0000004 has no rank map"):
        choose_checkpoint(tmp_path)


def test_a_checkpoint_of_a_newer_megatron_core_is_refused_naming_both_an_older_ones_is_read():
    from higgs_megatron.checkpoint.load import newer_release

    assert newer_release("0.16.1", running="0.19.2") is None
    assert newer_release("0.19.0", running="0.19.2") is None and newer_release("0.19.2+abc", running="0.19.0") is None
    problem = newer_release("0.19.2", running="0.16.1")
    assert problem.startswith("it was written under megatron-core 0.19.2, newer than this run's 0.16.1")
    assert "resume under megatron-core 0.19" in problem


def test_virtual_stages_optimizer_instances_and_expert_tp_are_layout():
    """Each lays out the parameters, and so the error-feedback residuals, differently: a change is
    a reshard, named; a rank map written before they were recorded reads as none of them."""
    from higgs_megatron.checkpoint.load import layout_differences

    before = _layout()
    assert layout_differences(before, _layout(virtual_pipeline_model_parallel_size=2)) == [
        "virtual pipeline stages per rank: checkpoint none, now 2"]
    assert layout_differences(before, _layout(num_distributed_optimizer_instances=2)) == [
        "distributed-optimizer instances: checkpoint 1, now 2"]
    assert layout_differences(_layout(expert_tensor_parallel_size=1), before) == [
        "expert-tensor-parallel size (none: the tensor-parallel size): checkpoint 1, now none"]
    old = {k: v for k, v in vars(before).items() if k in (
        "world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
        "context_parallel_size", "expert_model_parallel_size", "use_distributed_optimizer")}
    assert layout_differences(Layout(**old), before) == []
