"""The vocabulary padding: rows past the true vocabulary size that a TP change can move.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by`` x TP, so the
word embedding, an untied output layer, and their optimizer state change their global row
count when TP changes (384 rows at TP=1 and 512 at TP=2 for a 257-token vocabulary with the
default divisor 128). The rows past the true size are padding: no token id reaches them, so a
reshard may trim them, or extend them with zeros, and leave every real row bitwise equal.
The rank map records the true size (``Manifest.vocab``); for an older checkpoint it comes from
the flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .manifest import Manifest

VOCAB_SUFFIXES = ("word_embeddings.weight", "output_layer.weight")


def padded_rows(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron-LM's rule: the vocabulary padded to a multiple of divisible-by x TP."""
    multiple = divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def vocab_record(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> dict:
    """What the rank map records (``Manifest.vocab``)."""
    return {"vocab_size": vocab_size, "make_vocab_size_divisible_by": divisible_by,
            "padded_vocab_size": padded_rows(vocab_size, divisible_by, tensor_model_parallel_size)}


def recorded_vocab(manifest: Manifest, now: dict | None) -> dict | None:
    """The rank map's vocabulary record; for a rank map from before it was recorded, one made
    from the flags (``now``: the true size, which the tokenizer fixes) and the saved word
    embedding's rows (the divisor then unknown)."""
    if manifest.vocab or now is None:
        return manifest.vocab
    rows = {s.global_shape[0] for r in manifest.ranks for s in r.shards if is_vocab_key(s.key)}
    if len(rows) != 1:
        return None
    return {"vocab_size": now["vocab_size"], "make_vocab_size_divisible_by": None, "padded_vocab_size": rows.pop()}


def is_vocab_key(key: str) -> bool:
    """The word embedding, the output layer, and their optimizer state (same suffix)."""
    return key.endswith(VOCAB_SUFFIXES)


def divisor_keeping(saved: dict, tensor_model_parallel_size: int) -> int | None:
    """The smallest ``--make-vocab-size-divisible-by`` (not below the saved one, when recorded)
    that keeps the saved record's padded rows at this TP; None when none does."""
    rows = saved["padded_vocab_size"]
    for divisor in range(saved["make_vocab_size_divisible_by"] or 1, rows // tensor_model_parallel_size + 1):
        if padded_rows(saved["vocab_size"], divisor, tensor_model_parallel_size) == rows:
            return divisor
    return None


@dataclass(frozen=True)
class PaddingChange:
    key: str
    saved_rows: int
    target_rows: int
    vocab_size: int

    def describe(self) -> str:
        how = "padding trimmed" if self.target_rows < self.saved_rows else "padding extended with zeros"
        return (f"{self.key}: {self.saved_rows} rows in the checkpoint, {self.target_rows} at the target "
                f"(the first {self.vocab_size} are the vocabulary; {how})")


def padding_changes(manifest: Manifest, saved: dict, now: dict) -> list[PaddingChange]:
    """The saved tensors whose padded rows differ between two vocabulary records."""
    rows, target = saved["padded_vocab_size"], now["padded_vocab_size"]
    if target == rows:
        return []
    keys = sorted({s.key for r in manifest.ranks for s in r.shards if is_vocab_key(s.key) and s.global_shape[0] == rows})
    return [PaddingChange(key, rows, target, saved["vocab_size"]) for key in keys]
