"""Train batches of whole documents, bucketed by length (``--higgs-length-buckets``).

Why: the default pipeline packs documents into samples of exactly ``seq_length`` tokens, so
activation shapes never change. A user who must not pack across document boundaries gets a
different length every batch instead, and the device's caching allocator then keeps blocks
of as many sizes, which fragments memory (and invites the memory manager to offload when
nothing but fragmentation is short). Rounding every batch up to one of a few lengths keeps
the shapes few and the padding small.

The schedule, computed alike on every rank from the seed alone (no communication):

1. Each train document (the documents Megatron's split gave the train set) is cut into
   chunks of at most ``seq_length + 1`` tokens with a stride of ``seq_length``, so that every
   label of the document is in exactly one chunk; one-token chunks are dropped.
2. Epoch ``e`` permutes the chunks (``seed + e``), keeps whole global batches (the
   remainder, fewer than ``global_batch_size`` chunks, sits the epoch out), and sorts
   each pool of ``POOL_BATCHES`` global batches' worth of chunks by length; the pool is cut
   into global batches, whose order inside the pool is shuffled again.
3. A global batch's length is the smallest bucket that holds its longest chunk. Shorter
   chunks are padded at the end with loss mask 0: under the causal mask no real token sees
   a padded one, so every real token's loss is what it would be unpadded. (As in
   Megatron-LM without ``--calculate-per-token-loss``, each micro-batch's loss is the mean
   over its own real tokens, and the step averages micro-batches and DP ranks: with buckets
   their token counts differ, so a token of a short micro-batch weighs a little more.)

Iteration ``i`` reads global batch ``consumed_samples // global_batch_size``, so a resumed
run (on any layout, with the same global batch size) continues the same sequence; within it, DP rank ``r`` reads the same
positions as in :func:`.data.microbatch_indices`. Validation keeps the packed samples, so
validation loss stays comparable with runs that do not bucket.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy
import torch

from megatron.core.datasets.gpt_dataset import GPTDataset

from ..device import pin_batch
from .corpus import ByteTokenizer
from .data import Batch, microbatch_indices

POOL_BATCHES = 16


@functools.lru_cache(maxsize=None)
def _causal_mask(length: int) -> torch.Tensor:
    """[length, length], True = masked (megatron-core's convention); one per bucket."""
    return ~torch.tril(torch.ones((length, length), dtype=torch.bool))


def parse_buckets(text: str, seq_length: int) -> list[int]:
    """``"32,64"`` → ``[32, 64]`` (``LengthBuckets`` adds ``seq_length``); raises ValueError
    naming what is wrong."""
    try:
        buckets = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated token counts such as 32,64,128") from None
    if any(b <= 0 or b > seq_length for b in buckets):
        raise ValueError(f"{text!r}: every length must be in [1, --seq-length {seq_length}]")
    if buckets != sorted(set(buckets)):
        raise ValueError(f"{text!r}: lengths must be strictly increasing")
    return buckets


class LengthBuckets:
    """The bucketed train schedule over one GPT dataset's documents."""

    def __init__(self, train: GPTDataset, buckets: list[int], seq_length: int, global_batch_size: int,
                 seed: int) -> None:
        self.buckets = numpy.asarray(sorted(set(buckets) | {seq_length}), dtype=numpy.int64)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._documents = train.dataset  # Megatron's IndexedDataset
        doc_ids = numpy.asarray(train.indices, dtype=numpy.int64)
        doc_lengths = self._documents.sequence_lengths[doc_ids].astype(numpy.int64)
        per_doc = numpy.maximum(0, -(-(doc_lengths - 1) // seq_length))  # ceil((n - 1) / seq_length)
        self.doc = numpy.repeat(doc_ids, per_doc)
        first = numpy.repeat(numpy.cumsum(per_doc) - per_doc, per_doc)
        self.offset = (numpy.arange(len(self.doc)) - first) * seq_length
        self.length = numpy.minimum(numpy.repeat(doc_lengths, per_doc) - self.offset, seq_length + 1)
        self.batches_per_epoch = len(self.doc) // global_batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"the train documents give {len(self.doc)} chunks, fewer than one global batch "
                             f"({global_batch_size}); use a larger corpus or a smaller --global-batch-size")
        self._epochs: dict[int, numpy.ndarray] = {}

    def _epoch(self, epoch: int) -> numpy.ndarray:
        """Chunk ids of every global batch of one epoch, shape [batches, global_batch_size]."""
        if epoch not in self._epochs:
            rng = numpy.random.RandomState((self.seed + epoch) % 2**32)
            order = rng.permutation(len(self.doc))[: self.batches_per_epoch * self.global_batch_size]
            pools = []
            pool_size = POOL_BATCHES * self.global_batch_size
            for start in range(0, len(order), pool_size):
                pool = order[start:start + pool_size]
                pool = pool[numpy.argsort(self.length[pool], kind="stable")]
                batches = pool.reshape(-1, self.global_batch_size)
                pools.append(batches[rng.permutation(len(batches))])
            self._epochs = {epoch: numpy.concatenate(pools)}  # one epoch at a time is enough
        return self._epochs[epoch]

    def global_batch(self, iteration_index: int) -> numpy.ndarray:
        epoch, index = divmod(iteration_index, self.batches_per_epoch)
        return self._epoch(epoch)[index]

    def seq_length(self, iteration_index: int) -> int:
        """The bucket every sample of this global batch is padded to."""
        longest = int(self.length[self.global_batch(iteration_index)].max()) - 1
        return int(self.buckets[numpy.searchsorted(self.buckets, longest)])

    def tokens(self, iteration_index: int) -> int:
        """Real (unpadded) tokens trained on in this global batch."""
        return int((self.length[self.global_batch(iteration_index)] - 1).sum())

    def collate(self, iteration_index: int, positions: list[int]) -> Batch:
        """The samples at ``positions`` of one global batch, padded to its bucket."""
        length = self.seq_length(iteration_index)
        chunks = self.global_batch(iteration_index)[positions]
        tokens = torch.full((len(chunks), length + 1), ByteTokenizer.EOD, dtype=torch.int64)
        loss_mask = torch.zeros((len(chunks), length), dtype=torch.float32)
        for row, chunk in enumerate(chunks):
            n = int(self.length[chunk])
            tokens[row, :n] = torch.from_numpy(
                self._documents.get(int(self.doc[chunk]), offset=int(self.offset[chunk]), length=n).astype(numpy.int64))
            loss_mask[row, :n - 1] = 1.0
        return pin_batch({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": torch.arange(length, dtype=torch.int64).expand(len(chunks), length).contiguous(),
            "attention_mask": _causal_mask(length).expand(len(chunks), 1, length, length).contiguous(),
        })

    def iteration_batches(self, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                          num_microbatches: int) -> Iterator[Batch]:
        index = consumed_samples // self.global_batch_size
        for positions in microbatch_indices(0, micro_batch_size, dp_rank, dp_size, num_microbatches):
            yield self.collate(index, positions)

    def summary(self, iterations: int) -> dict:
        """Share of the first ``iterations`` batches per bucket, and the padding fraction."""
        lengths = numpy.array([self.seq_length(i) for i in range(iterations)])
        real = sum(self.tokens(i) for i in range(iterations))
        padded = int(lengths.sum()) * self.global_batch_size
        return {"buckets": self.buckets.tolist(),
                "batches_per_bucket": [int((lengths == b).sum()) for b in self.buckets],
                "padding": 1.0 - real / max(1, padded), "chunks": len(self.doc)}
