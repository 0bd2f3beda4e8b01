"""One-process unit tests of pieces the multi-process tests use only end to end: the sparse
reduction's decompression, shard coverage, the rank map's parser, the step vote."""

import json
import threading

import pytest
import torch
import torch.distributed as dist

from higgs_megatron.checkpoint.manifest import CheckpointError, Layout, Manifest, RankRecord, ShardRecord
from higgs_megatron.checkpoint.validation import uncovered_shards
from higgs_megatron.reduce.sparse_allreduce import PendingSparseReduce, pack
from higgs_megatron.stability.alignment import StepVote


def test_finish_sums_every_peers_payload_against_a_reference_sum():
    n, always = 1000, torch.arange(0, 10)
    generator = torch.Generator().manual_seed(0)
    payloads, reference = [], torch.zeros(n)
    for peer in range(3):
        positions = torch.randperm(n - 10, generator=generator)[:40] + 10
        values = torch.randn(40, generator=generator)
        always_values = torch.randn(10, generator=generator)
        payloads.append(pack(always_values, positions, values))
        reference.index_add_(0, always, always_values)
        reference.index_add_(0, positions, values)
    target = torch.full((n,), 7.0)  # stale contents must not survive
    PendingSparseReduce(work=None, gathered=torch.cat(payloads), world=3, always_positions=always, k=40,
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
    store = dist.HashStore()
    votes = [StepVote(store, rank, 3, timeout=10) for rank in range(3)]
    results = [None] * 3

    def vote(rank, reason):
        results[rank] = votes[rank].decide(reason)

    for attempt_reasons in ([None, None, None], [None, "rank 1: sync timed out", None]):
        threads = [threading.Thread(target=vote, args=(r, reason)) for r, reason in enumerate(attempt_reasons)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expected = {r: reason for r, reason in enumerate(attempt_reasons) if reason}
        assert results == [expected] * 3
