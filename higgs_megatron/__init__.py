"""higgs-megatron: compressed data-parallel gradient sync, rank-mapped checkpoints and
stability for megatron-core training, without changing the training loop."""

__version__ = "0.1.0"
