"""One-process unit tests of pieces the multi-process tests use only end to end: the sparse
reduction's decompression, shard coverage, the rank map's parser, the step vote."""

import json
import threading

import pytest
import torch
import torch.distributed as dist

from higgs_megatron.checkpoint.manifest import CheckpointError, Layout, Manifest, RankRecord, ShardRecord
from higgs_megatron.checkpoint.load import uncovered_shards
from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, SparseGrad
from higgs_megatron.reduce.sparse_allreduce import PendingSparseReduce
from higgs_megatron.stability.alignment import StepVote, Verdict, VoteTimeout


# 40 of 990: 16-bit offsets; 400 of 990: a bitmap.
@pytest.mark.parametrize("payload,k", [("wide", 40), ("bf16", 40), ("int8", 40), ("int4", 40), ("bf16", 400),
                                       ("int8", 400), ("int4", 400)])
def test_finish_sums_every_peers_payload_against_a_reference_sum(payload, k):
    n = 1000
    plan = BucketPlan(n, [ParamSlot(0, 10), ParamSlot(10, n)], min_param_numel=11, device=torch.device("cpu"),
                      payload=payload)
    layout = plan.layout(k / (n - 10))
    assert layout.encoding == ("int32" if payload == "wide" else {40: "offsets", 400: "bitmap"}[k])
    generator = torch.Generator().manual_seed(0)
    payloads, reference = [], torch.zeros(n)
    for peer in range(3):
        positions = (torch.randperm(n - 10, generator=generator)[:k] + 10).sort().values
        sparse = plan.payload.round(SparseGrad(torch.randn(10, generator=generator), plan.always_positions, positions,
                                               torch.randn(k, generator=generator)), layout)
        payloads.append(plan.payload.pack(sparse, layout))
        reference.index_add_(0, plan.always_positions, sparse.always)
        reference.index_add_(0, positions, sparse.values)
    target = torch.full((n,), 7.0)  # stale contents must not survive
    PendingSparseReduce(work=None, gathered=torch.cat(payloads), world=3, payload=plan.payload, layout=layout,
                        target=target).finish()
    assert torch.equal(target, reference)


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


def test_one_reason_on_any_rank_drops_the_step_on_every_rank():
    """Each rank votes its own inputs; every rank reads the same verdict: kept, or dropped with
    each rank's reason, and whether a sync was given up on (an alignment, not a skip)."""
    store = dist.HashStore()
    votes = [StepVote(store, rank, 3, timeout=10) for rank in range(3)]
    results = [None] * 3

    def vote(rank, inputs):
        results[rank] = votes[rank].decide(*inputs)

    attempts = [
        ([(False, None)] * 3, Verdict({})),
        ([(False, None), (False, "rank 1: sync timed out"), (False, None)],
         Verdict({1: "rank 1: sync timed out"}, sync_failed=True)),
        ([(True, None), (False, None), (True, "rank 2: sync timed out")],
         Verdict({0: "rank 0: non-finite gradients", 2: "rank 2: non-finite gradients; rank 2: sync timed out"},
                 sync_failed=True)),
        ([(False, None), (True, None), (False, None)], Verdict({1: "rank 1: non-finite gradients"})),
    ]
    for inputs, expected in attempts:
        threads = [threading.Thread(target=vote, args=(r, i)) for r, i in enumerate(inputs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [expected] * 3
        assert all(r.keep == (not expected.dropped) for r in results)


def test_a_rank_that_does_not_vote_is_named():
    store = dist.HashStore()
    errors = []

    def vote(rank):
        try:
            StepVote(store, rank, 3, timeout=0.5).decide(False, None)
        except VoteTimeout as error:
            errors.append(str(error))

    threads = [threading.Thread(target=vote, args=(rank,)) for rank in (0, 2)]  # rank 1 never votes
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == ["rank(s) [1] did not vote on step attempt 1 within 0.5s (--higgs-restart-timeout)"] * 2


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


def test_a_config_error_names_its_field_and_crosses_processes():
    import pickle

    from higgs_megatron.config import ConfigError, HiggsConfig

    with pytest.raises(ConfigError) as caught:
        HiggsConfig(dense_iters=-1)
    assert caught.value.field == "dense_iters"
    copy = pickle.loads(pickle.dumps(caught.value))
    assert copy.field == "dense_iters" and str(copy) == str(caught.value)


def test_both_front_ends_take_their_config_flags_and_defaults_from_the_dataclasses():
    """Each flagged field of HiggsConfig, OffloadConfig, CheckpointConfig and StabilityConfig is a
    flag of our pretrain script and of the Megatron-LM patches, with the field's default, and reads
    back into the same config; a bad value is refused naming its flag."""
    import argparse
    from dataclasses import fields

    from higgs_megatron.checkpoint.flags import CheckpointConfig, checkpoint_config_from_args
    from higgs_megatron.config import HiggsConfig, higgs_config_from_args
    from higgs_megatron.stability.flags import StabilityConfig
    from higgs_megatron.field_flags import field_flag, field_values, flag_dest
    from higgs_megatron.memory import OffloadConfig
    from higgs_megatron.memory.flags import offload_config_from_args
    from higgs_megatron.runtime.exits import UsageError
    from higgs_megatron.runtime.run_config import MEGATRON_LM, PRETRAIN, check_rules
    from higgs_megatron.training.arguments import build_parser
    from patches.megatron_lm.arguments import add_patch_args

    assert flag_dest("--no-higgs-pin-memory") == "higgs_pin_memory"
    assert field_flag(OffloadConfig, "directory") == "--higgs-offload-dir"
    megatron_like = argparse.ArgumentParser()  # Megatron-LM's parser holds --save and --load
    megatron_like.add_argument("--save")
    megatron_like.add_argument("--load")
    for parser, front_end in ((build_parser(), PRETRAIN), (add_patch_args(megatron_like), MEGATRON_LM)):
        for config_class in (HiggsConfig, OffloadConfig, CheckpointConfig, StabilityConfig):
            flagged = [f for f in fields(config_class) if "flag" in f.metadata]
            assert flagged and all(f.metadata["flag"] in parser._option_string_actions for f in flagged)
            # a schedule flag not given is None: the run derives its value (``schedule``)
            assert field_values(parser.parse_args([]), config_class) == {
                f.name: None if f.metadata["derived"] else f.default for f in flagged}
        args = parser.parse_args(["--higgs-compression-ratio", "0.05", "--no-higgs-error-feedback", "--higgs-offload",
                                  "--higgs-offload-threshold", "0.5", "--no-higgs-pin-memory"])
        assert higgs_config_from_args(args, 100, 10) == HiggsConfig(
            compression_ratio=0.05, error_feedback=False, payload="int4", dense_iters=10, density_warmup_iters=5)
        assert offload_config_from_args(args) == OffloadConfig(threshold=0.5, pin_memory=False)
        with pytest.raises(ValueError, match="--higgs-compression-ratio"):
            higgs_config_from_args(parser.parse_args(["--higgs-compression-ratio", "2"]), 100, 10)
        args = parser.parse_args(["--save", "/s", "--recovery-mode", "reshard", "--checkpoint-interval", "30",
                                  "--async-checkpoint", "--inject-fault", "hang@0:2", "--inject-fault", "nan@1:3"])
        assert checkpoint_config_from_args(args) == CheckpointConfig(recovery_mode="reshard", checkpoint_interval=30.0,
                                                                     async_checkpoint=True, save="/s")
        assert args.inject_fault == ["hang@0:2", "nan@1:3"]
        for argv, flag in ((["--save", "/s", "--checkpoint-interval", "inf"], "--checkpoint-interval inf: expected"),
                           (["--load", "/s", "--checkpoint-version", "0"], "--checkpoint-version 0: expected")):
            with pytest.raises(ValueError, match=flag):
                checkpoint_config_from_args(parser.parse_args(argv))
        with pytest.raises(UsageError) as info:  # what a flag needs of another: one table, both front-ends
            check_rules(parser.parse_args(["--use-higgs", "--auto-resume"]), front_end)
        assert info.value.message == "--auto-resume: needs --save DIR"
