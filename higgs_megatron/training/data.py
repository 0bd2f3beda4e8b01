"""Train and validation batches from the indexed corpus, through Megatron's GPT dataset.

``build_datasets`` hands the corpus to ``BlendedMegatronDatasetBuilder(GPTDataset, ...)``,
which splits documents into train / validation / test, shuffles, and packs them into
``seq_length + 1`` token samples (its index files are cached beside the corpus).

Sample order follows Megatron-LM's ``MegatronPretrainingSampler``: the global batch of an
iteration is the next ``global_batch_size`` sample indices after ``consumed_samples``;
each micro-batch step takes ``micro_batch_size x dp`` consecutive indices and data-parallel
rank ``r`` reads slice ``r``. So the same seed gives the same samples, DP ranks read
disjoint samples, and a run resumed at ``consumed_samples`` continues the same sequence.
Every tensor- and pipeline-parallel rank of a DP rank reads the same samples itself
(rather than receiving a broadcast from TP rank 0): simpler, and identical in content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from ..device import pin_batch
from .corpus import ByteTokenizer, Corpus

Batch = dict[str, torch.Tensor]


@dataclass
class Datasets:
    train: GPTDataset
    valid: GPTDataset


def build_datasets(corpus: Corpus, seq_length: int, seed: int, split: str,
                   train_samples: int, valid_samples: int, cache_dir: str | None = None) -> Datasets:
    """Build (or load from cache) the train and validation GPT datasets; call on every rank."""
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([corpus.prefix], None),
        split=split,
        path_to_cache=cache_dir,
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, None], lambda: True, config
    ).build()
    if train is None or valid is None:
        raise ValueError(
            f"corpus {corpus.source} has too few documents ({corpus.documents}) for --split {split}"
        )
    return Datasets(train=train, valid=valid)


def microbatch_indices(consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                       num_microbatches: int) -> list[list[int]]:
    """The dataset indices this DP rank reads for one iteration, one list per micro-batch."""
    step = micro_batch_size * dp_size
    return [
        list(range(consumed_samples + m * step + dp_rank * micro_batch_size,
                   consumed_samples + m * step + (dp_rank + 1) * micro_batch_size))
        for m in range(num_microbatches)
    ]


def collate(dataset: GPTDataset, indices: list[int]) -> Batch:
    """One micro-batch on the host, pinned where CUDA exists (the forward step moves it to
    the model's device)."""
    samples = [dataset[i] for i in indices]
    return pin_batch({key: torch.stack([s[key] for s in samples]) for key in samples[0]})


def iteration_batches(dataset: GPTDataset, consumed_samples: int, micro_batch_size: int,
                      dp_rank: int, dp_size: int, num_microbatches: int) -> Iterator[Batch]:
    """The micro-batches of one iteration, in the order the schedule consumes them."""
    for indices in microbatch_indices(consumed_samples, micro_batch_size, dp_rank, dp_size,
                                      num_microbatches):
        yield collate(dataset, indices)
