"""Length-bucketed batches in multi-process training: pipeline and data parallel, and padding
that changes no loss."""

import json

import pytest

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import pretrain_on_rank


SEQ, GBS = 64, 8


def test_pipeline_and_data_parallel_training_on_bucketed_batches(short_docs, tiny_gpt_args, tmp_path):
    """PP=2 x DP=2 with the distributed optimizer and HiggsDDP: the pipeline's tensor shapes
    follow each batch's bucket, the loss falls and the DP replicas stay identical."""
    log = tmp_path / "metrics.jsonl"
    argv = tiny_gpt_args + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                            "--micro-batch-size", "2", "--train-iters", "10", "--data-path", str(short_docs),
                            "--data-cache-path", str(tmp_path / "cache"), "--higgs-length-buckets", "16,32",
                            "--use-higgs", "--use-distributed-optimizer", "--log-interval", "1",
                            "--check-weight-hash-across-dp-replicas-interval", "5", "--log-json", str(log)]
    results = run_ranks(pretrain_on_rank, 4, args=(argv,), timeout=300)
    losses = [r.losses for r in results if r.losses][0]
    assert losses[10] < losses[1] - 0.3, losses
    records = [json.loads(line) for line in log.read_text().splitlines()]
    summary = next(r for r in records if r.get("event") == "length_buckets")
    assert summary["buckets"] == [16, 32, 64] and sum(summary["batches_per_bucket"]) == 10
    assert sum(1 for n in summary["batches_per_bucket"] if n) > 1, "batches of several lengths were trained"
    assert sum(1 for r in records if r.get("event") == "replicas_identical") == 2


def test_bucketing_changes_the_padding_not_the_training(short_docs, tiny_gpt_args, tmp_path):
    """DP=2: every batch padded to --seq-length, or to its bucket, trains the same chunks in the
    same order, and padding is outside every real token's context: the same losses."""
    base = tiny_gpt_args + ["--train-iters", "4", "--global-batch-size", "16", "--data-path", str(short_docs),
                            "--data-cache-path", str(tmp_path / "cache")]
    padded = run_ranks(pretrain_on_rank, 2, args=(base + ["--higgs-length-buckets", str(SEQ)],))
    bucketed = run_ranks(pretrain_on_rank, 2, args=(base + ["--higgs-length-buckets", "16,32"],))
    for it in range(1, 5):
        assert bucketed[0].losses[it] == pytest.approx(padded[0].losses[it], rel=1e-5)
    # tokens/s counts real tokens: both runs trained as many, fewer than the padded positions
    tokens = [[r[0].tokens_per_second[it] * r[0].step_times[it] for it in range(1, 5)] for r in (padded, bucketed)]
    assert tokens[0] == pytest.approx(tokens[1]) and sum(tokens[0]) < 4 * 16 * SEQ
