"""Length-bucketed batches: every label once per epoch, few shapes, padding that changes no loss."""

import numpy
import pytest
import torch

from higgs_megatron.cpu import cpu_megatron
from higgs_megatron.training.corpus import build_corpus
from higgs_megatron.training.data import build_datasets
from higgs_megatron.training.length_buckets import LengthBuckets, parse_buckets


SEQ, GBS = 64, 8


@pytest.fixture(scope="module")
def train_set(short_docs):
    cache = short_docs.parent / "short_docs_cache"
    with cpu_megatron():
        corpus = build_corpus(str(short_docs), cache)
        return build_datasets(corpus, seq_length=SEQ, seed=3, split="98,2,0", train_samples=64,
                              valid_samples=8, cache_dir=str(cache)).train


def test_parse_buckets_appends_seq_length_and_names_errors():
    assert parse_buckets("16,32", 64) == [16, 32] and parse_buckets("16,64", 64) == [16, 64]
    for bad, why in (("16,x", "comma-separated"), ("0,32", r"\[1, --seq-length 64\]"),
                     ("128", r"\[1, --seq-length 64\]"), ("32,16", "strictly increasing"),
                     ("16,16", "strictly increasing")):
        with pytest.raises(ValueError, match=why):
            parse_buckets(bad, 64)


def test_every_label_of_every_train_document_is_trained_once_per_epoch(train_set):
    buckets = LengthBuckets(train_set, [16, 32, SEQ], SEQ, GBS, seed=5)
    # chunks tile each document: stride SEQ, overlap of one token, labels 1..n-1 each once
    docs = train_set.dataset.sequence_lengths[train_set.indices].astype(numpy.int64)
    assert int((buckets.length - 1).sum()) == int((docs - 1).sum())
    assert buckets.length.max() == SEQ + 1 and buckets.length.min() >= 2
    seen = numpy.concatenate([buckets.global_batch(i) for i in range(buckets.batches_per_epoch)])
    assert len(numpy.unique(seen)) == len(seen) == buckets.batches_per_epoch * GBS
    # the next epoch is another order of the same chunks
    assert not numpy.array_equal(buckets.global_batch(buckets.batches_per_epoch), buckets.global_batch(0))


def test_batches_padded_to_their_bucket_with_the_mask_covering_real_tokens_only(train_set):
    buckets = LengthBuckets(train_set, [16, 32, SEQ], SEQ, GBS, seed=5)
    lengths = {buckets.seq_length(i) for i in range(200)}
    assert lengths <= {16, 32, SEQ} and len(lengths) > 1
    for i in range(20):
        batch = buckets.collate(i, list(range(GBS)))
        length = buckets.seq_length(i)
        chunks = buckets.global_batch(i)
        assert batch["tokens"].shape == (GBS, length) and batch["attention_mask"].shape == (GBS, 1, length, length)
        assert int(batch["loss_mask"].sum()) == buckets.tokens(i) == int((buckets.length[chunks] - 1).sum())
        assert length >= buckets.length[chunks].max() - 1
        assert length == 16 or buckets.length[chunks].max() - 1 > buckets.buckets[list(buckets.buckets).index(length) - 1]
        real = batch["loss_mask"].bool()
        assert torch.equal(batch["tokens"][:, 1:][real[:, :-1]], batch["labels"][:, :-1][real[:, :-1]])
        doc = train_set.dataset.get(int(buckets.doc[chunks[0]]), offset=int(buckets.offset[chunks[0]]),
                                    length=int(buckets.length[chunks[0]]))
        assert batch["tokens"][0, :len(doc) - 1].tolist() == doc[:-1].tolist()


def test_same_seed_same_schedule_and_dp_ranks_split_the_global_batch(train_set):
    a = LengthBuckets(train_set, [16, 32], SEQ, GBS, seed=5)
    b = LengthBuckets(train_set, [16, 32], SEQ, GBS, seed=5)
    assert all(numpy.array_equal(a.global_batch(i), b.global_batch(i)) for i in range(30))
    # consumed samples of iteration 7; 2 DP ranks x 2 micro-batches of 2
    ranks = [list(a.iteration_batches(7 * GBS, 2, r, 2, 2)) for r in range(2)]
    rows = torch.cat([mb["tokens"] for rank in ranks for mb in rank])
    whole = a.collate(7, list(range(GBS)))["tokens"]
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, whole.tolist()))


def test_too_few_chunks_for_one_global_batch_is_an_error(train_set):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        LengthBuckets(train_set, [SEQ], SEQ, 10**9, seed=5)


def test_padding_does_not_change_the_loss(train_set):
    """The same documents padded to a longer bucket give the same per-token losses."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    import torch.distributed as dist

    buckets = LengthBuckets(train_set, [16, 32, SEQ], SEQ, GBS, seed=5)
    short = next(i for i in range(200) if buckets.seq_length(i) == 16)
    with cpu_megatron():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29571", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel()
            tensor_parallel.model_parallel_cuda_manual_seed(1)
            config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
            model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=257, max_sequence_length=SEQ).eval()
            batch = buckets.collate(short, list(range(GBS)))
            wide = {k: v for k, v in batch.items()}
            pad = SEQ - 16
            wide["tokens"] = torch.nn.functional.pad(batch["tokens"], (0, pad), value=256)
            wide["labels"] = torch.nn.functional.pad(batch["labels"], (0, pad), value=256)
            wide["loss_mask"] = torch.nn.functional.pad(batch["loss_mask"], (0, pad))
            wide["position_ids"] = torch.arange(SEQ).expand(GBS, SEQ)
            wide["attention_mask"] = ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(GBS, 1, SEQ, SEQ)
            with torch.no_grad():
                losses = [model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
                          for b in (batch, wide)]
            torch.testing.assert_close(losses[1][:, :16] * batch["loss_mask"], losses[0] * batch["loss_mask"],
                                       rtol=1e-5, atol=1e-6)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
