"""The virtual data-parallel harness (``scripts/virtual_dp.py``: P ranks in one process, for
the loss at P no machine here holds) against real gloo ranks: the same losses, step by step.

It runs HiggsDDP's own sync code for every rank, with the collectives computed in one
process; its sums follow gloo's ring order, so where the real run and the harness add the
same numbers they add them alike. Measured here: every loss of 25 steps within 5e-7 of the
real run's (the loss's own reduction order), at 2 and 4 ranks, on the sharded, agreed,
all-gathering and dense paths, through a dense int8 stage, a density ramp and the sampled
selector, with and without the distributed optimizer."""

from __future__ import annotations

import pytest

from higgs_megatron_bench.ranks import run_ranks

from tests.workers.common import train_variants
from tests.workers.virtual import virtual_losses


SCHEDULE = ["--higgs-compression-ratio", "0.25", "--higgs-payload", "int4", "--higgs-dense-iters", "5",
            "--higgs-dense-int8", "--higgs-density-warmup-iters", "5", "--higgs-compressor", "sampled-topk"]


@pytest.mark.parametrize("world_size,form", [(2, "sharded"), (2, "sparse"), (4, "sharded"), (4, "agreed"),
                                             (4, "none"), (4, "sharded-distopt"), (2, "none-distopt")])
def test_the_virtual_group_trains_as_real_ranks_do(world_size, form, tiny_gpt_args):
    """With the distributed optimizer the model takes each rank's shard, and Megatron's plain
    optimizer over every parameter stands for the ranks' distributed one: the same Adam, but
    the gradient norm summed in another order, so gradient clipping is off there (a clip
    factor one bit apart flips a top-k choice a few steps on)."""
    form, _, distopt = form.partition("-")
    flags = (["--higgs-compressor", "none"] if form == "none" else ["--higgs-sync", form] + SCHEDULE)
    flags += ["--use-distributed-optimizer", "--clip-grad", "0"] if distopt else []
    argv = tiny_gpt_args + ["--train-iters", "25", "--global-batch-size", str(4 * world_size),
                            "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--use-higgs",
                            "--higgs-min-bucket-numel", "0", *flags]
    real = run_ranks(train_variants, world_size, args=({"real": argv},), timeout=600)[0]["losses"]["real"]
    virtual = run_ranks(virtual_losses, 1, args=(world_size, argv), timeout=600)[0]["losses"]
    assert sorted(virtual) == sorted(real) == list(range(1, 26))  # 15 compressed steps after the dense and the ramp
    gaps = {step: abs(virtual[step] - real[step]) for step in real}
    print(f"DP={world_size} {form}{'-distopt' if distopt else ''}: largest gap {max(gaps.values()):.1e}")
    assert max(gaps.values()) <= 1e-5, sorted(gaps.items(), key=lambda item: -item[1])[:5]
