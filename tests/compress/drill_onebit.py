"""1-bit Adam's exchange (``--higgs-sync onebit``, ``first_moment``): real multi-process
megatron-core runs over gloo. At full precision (``--higgs-payload wide``) each rank's share of
the first moment, summed, must give what Megatron's DDP and the same frozen Adam give from the
summed gradient; in signs, DP replicas stay bitwise equal and what is sent plus every rank's
and owner's residual is what the ranks accumulated."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import train_variants_on_the_compressed_form
from tests.workers.higgs_ddp import check_owner_sum_invariants, owner_sum_invariants

LAYOUTS = [pytest.param(2, [], id="dp2"),
           pytest.param(4, ["--tensor-model-parallel-size", "2"], id="tp2xdp2"),
           pytest.param(4, ["--use-distributed-optimizer"], id="dp4-distopt")]


def _argv(tiny_gpt_args, layout, iters):
    return (tiny_gpt_args + layout + ["--global-batch-size", "16", "--train-iters", str(iters), "--overlap-grad-reduce",
                                      "--ddp-bucket-size", "20000", "--clip-grad", "0"])


@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_the_first_moment_in_full_equals_frozen_adam_on_megatron_ddp(world_size, layout, tiny_gpt_args):
    """Clipping off: with it on, Megatron clips the gradient in one and the moment in the other."""
    base = _argv(tiny_gpt_args, layout, 6) + ["--use-higgs", "--higgs-dense-iters", "2"]
    variants = {"megatron": base + ["--higgs-compressor", "none", "--higgs-freeze-adam-variance"],
                "onebit-wide": base + ["--higgs-sync", "onebit", "--higgs-payload", "wide",
                                       "--higgs-min-bucket-numel", "0", "--higgs-param-payload", "dense"]}
    for out in run_ranks(train_variants_on_the_compressed_form, world_size, args=(variants,), timeout=400):
        assert out["forced"] > 0
        reference = out["params"]["megatron"]
        for name, value in out["params"]["onebit-wide"].items():
            # Adam moves a coordinate about a learning rate (3e-3) a step: a wrong share of the moment
            # or a moment averaged in twice is off by about that much. Summation's order is not: it is
            # amplified only where Adam divides a near-zero moment by a near-zero second moment (a
            # bias starting at 0), to under 1e-3 of a step.
            torch.testing.assert_close(value, reference[name], rtol=0, atol=3e-6,
                                       msg=lambda m: f"onebit at full precision differs at {name}: {m}")


@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_signs_keep_replicas_equal_and_conserve(world_size, layout, tiny_gpt_args):
    argv = _argv(tiny_gpt_args, layout, 6) + ["--use-higgs", "--higgs-sync", "onebit", "--higgs-dense-iters", "2",
                                               "--higgs-min-bucket-numel", "0", "--higgs-min-param-numel", "256"]
    check_owner_sum_invariants(run_ranks(owner_sum_invariants, world_size, args=(argv,), timeout=400))


MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
       "64", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2", "--expert-tensor-parallel-size", "1",
       "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.mark.parametrize("world_size,layout", [
    pytest.param(4, ["--pipeline-model-parallel-size", "2"], id="pp2xdp2"),
    pytest.param(4, MOE, id="moe-ep2-expert-dp2")])
def test_pipeline_and_experts_take_their_groups_shares(world_size, layout, tiny_gpt_args):
    """Each stage's buckets, and the experts' over their own (expert-data-parallel) group: at full
    precision as frozen Adam on Megatron's DDP, in signs DP replicas (and the experts' replicas)
    bitwise equal. The tied embedding is summed again over the pipeline's first and last stage
    after the sync: without each copy's half share of the moment
    (``first_moment.copies_summed_after_sync``) the pipeline's oracle fails."""
    from tests.workers.moe import moe_variants, replicas_equal

    base = _argv(tiny_gpt_args, layout, 5) + ["--use-higgs", "--higgs-dense-iters", "2"]
    variants = {"megatron": base + ["--higgs-compressor", "none", "--higgs-freeze-adam-variance"],
                "onebit-wide": base + ["--higgs-sync", "onebit", "--higgs-payload", "wide",
                                       "--higgs-min-bucket-numel", "0"],
                "onebit": base + ["--higgs-sync", "onebit", "--higgs-min-bucket-numel", "0",
                                  "--higgs-min-param-numel", "256"]}
    outs = run_ranks(train_variants_on_the_compressed_form, world_size, args=(variants,), timeout=600) \
        if layout is not MOE else run_ranks(moe_variants, world_size, args=(variants,), timeout=600)
    for out in outs:
        reference = out["params"]["megatron"]
        for name, value in out["params"]["onebit-wide"].items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=3e-6,
                                       msg=lambda m: f"onebit at full precision differs at {name}: {m}")
    if layout is MOE:
        experts = outs[0]["experts"]
        dense = [name for name in outs[0]["params"]["onebit"] if name not in experts]
        replicas_equal(outs, "onebit", dense, place=("tp", "pp"))
        replicas_equal(outs, "onebit", experts, place=("etp", "ep", "pp"))
        return
    by_place = {}
    for out in outs:
        by_place.setdefault((out["coords"]["tp"], out["coords"]["pp"]), []).append(out["params"]["onebit"])
    for place, replicas in by_place.items():
        for name, value in replicas[0].items():
            assert torch.equal(value, replicas[1][name]), f"DP replicas differ at {name} {place}"
