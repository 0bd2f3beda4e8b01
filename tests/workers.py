"""Functions the multi-process tests run on each rank (importable by name, as spawn needs)."""

from __future__ import annotations


def pretrain_on_rank(argv: list[str]):
    """Train with the pretrain script's flags; return this rank's history."""
    from higgs_megatron.training.loop import pretrain

    return pretrain(argv)
