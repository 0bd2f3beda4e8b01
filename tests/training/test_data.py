"""Samples: deterministic for a seed, disjoint across DP ranks, resumable at consumed samples."""

import torch

from higgs_megatron.cpu import cpu_megatron
from higgs_megatron.training.corpus import build_corpus
from higgs_megatron.training.data import build_datasets, iteration_batches, microbatch_indices


def test_microbatch_indices_partition_the_global_batch():
    dp, mbs, micro = 3, 2, 4
    per_rank = [microbatch_indices(100, mbs, r, dp, micro) for r in range(dp)]
    flat = sorted(i for rank in per_rank for mb in rank for i in mb)
    assert flat == list(range(100, 100 + dp * mbs * micro))
    # the next iteration starts where this one stopped
    assert microbatch_indices(100 + dp * mbs * micro, mbs, 0, dp, micro)[0][0] == 100 + dp * mbs * micro


def _datasets(seed):
    with cpu_megatron():
        corpus = build_corpus(None)
        return build_datasets(corpus, seq_length=64, seed=seed, split="98,2,0",
                              train_samples=64, valid_samples=8)


def test_same_seed_same_samples_and_dp_ranks_differ():
    first, second, other_seed = _datasets(1), _datasets(1), _datasets(2)

    def tokens(ds, rank):
        return torch.cat([b["tokens"] for b in iteration_batches(ds.train, 0, 2, rank, 2, 2)])

    assert torch.equal(tokens(first, 0), tokens(second, 0))
    assert not torch.equal(tokens(first, 0), tokens(first, 1))
    assert not torch.equal(tokens(first, 0), tokens(other_seed, 0))
    batch = next(iteration_batches(first.train, 0, 2, 0, 2, 1))
    assert batch["tokens"].shape == (2, 64)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1]), "labels are the next token"
    assert batch["tokens"].max() <= 256
