"""Mixture of experts: HiggsDDP compresses the experts' gradients over the expert-data-parallel
group (Megatron's ``expert_parallel_bucket_groups``), beside the dense ones over the DP group.

Both layouts have EP 2 and expert DP 2: expert TP 1 on four ranks (dense DP 4), expert TP 2
on eight (dense DP 8). Dense TP stays 1: megatron-core's MoE layer trains with TP > 1 only under
sequence parallelism, whose layer norm needs Transformer Engine or Apex."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from tests.checkpoint.drill_checkpoint import COMMON, _global
from tests.workers.common import run_trainer
from tests.workers.moe import moe_variants, replicas_equal

MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2"]
ETP1 = ["--expert-tensor-parallel-size", "1", "--global-batch-size", "16"]  # 4 ranks: two micro-batches per step
ETP2 = ["--expert-tensor-parallel-size", "2", "--disable-bias-linear", "--global-batch-size", "16"]  # 8 ranks: one
SPARSE = ["--use-higgs", "--higgs-compression-ratio", "0.01", "--higgs-min-bucket-numel", "0", "--higgs-sync",
          "sparse", "--higgs-payload", "wide", "--higgs-dense-iters", "0", "--higgs-density-warmup-iters", "0"]


@pytest.mark.parametrize("world_size,layout,distopt", [
    pytest.param(4, ETP1, [], id="etp1-adam"),
    pytest.param(4, ETP1, ["--use-distributed-optimizer"], id="etp1-distopt"),
    pytest.param(8, ETP2, ["--use-distributed-optimizer"], id="etp2-distopt", marks=pytest.mark.oracle),
])
def test_moe_equals_megatron_ddp_when_dense_and_keeps_expert_replicas_equal_at_one_percent(
        world_size, layout, distopt, tiny_gpt_args):
    """Compressor none equals Megatron's DDP bitwise, density 1.0 through the compressed
    machinery (expert buckets included) to rounding; at 1%, dense parameters are bitwise equal
    across the DP replicas and expert parameters across the expert-DP replicas."""
    base = (tiny_gpt_args + MOE + layout + distopt
            + ["--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--hidden-dropout", "0",
               "--attention-dropout", "0"])
    variants = {
        "megatron": base + ["--train-iters", "4"],
        "none": base + ["--train-iters", "4", "--use-higgs", "--higgs-compressor", "none"],
        "topk-1.0": base + ["--train-iters", "4", "--use-higgs", "--higgs-compression-ratio", "1.0",
                            "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0", "--higgs-payload", "wide"],
        "topk-0.01": base + ["--train-iters", "8"] + SPARSE,
    }
    outs = run_ranks(moe_variants, world_size, args=(variants,), timeout=600)
    for out in outs:
        reference = out["params"]["megatron"]
        for name, value in out["params"]["none"].items():
            assert torch.equal(value, reference[name]), f"compressor none differs from Megatron DDP at {name}"
        assert out["losses"]["none"] == out["losses"]["megatron"]
        # Density 1.0 sums in another order than Megatron's ring (an all-gather, then a local sum
        # over four or eight ranks): equal to rounding. The gradient norms say the scaling is
        # right (Adam and the clip would hide a factor); the parameters, the direction.
        torch.testing.assert_close(out["grad_norms"]["topk-1.0"], out["grad_norms"]["megatron"], rtol=1e-5, atol=0)
        for name, value in out["params"]["topk-1.0"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"top-k at density 1.0 differs at {name}: {m}")
        groups = out["groups"]["topk-0.01"]
        assert groups["expert"] and min(groups["expert"]) > max(groups["dense"]), groups
    experts = outs[0]["experts"]
    dense = [name for name in outs[0]["params"]["topk-0.01"] if name not in experts]
    assert experts and dense
    replicas_equal(outs, "topk-0.01", dense, place=("tp", "pp"))  # every rank: dense TP is 1
    replicas_equal(outs, "topk-0.01", experts, place=("etp", "ep", "pp"))
    losses = outs[0]["losses"]["topk-0.01"]
    assert losses[8] < losses[1], losses


@pytest.mark.oracle
def test_the_routing_bias_moves_once_per_step_taken(tmp_path, tiny_gpt_args):
    """--moe-router-enable-expert-bias: Megatron moves the bias after the sync of every
    iteration, by sign(imbalance) x the rate, whether or not the step is then taken.

    * hang@1:3 past --higgs-step-timeout 2: every rank drops the step and runs iteration 3
      again; the run is bitwise the clean one, the bias at the start of every iteration and the
      parameters (without the settle, the rerun would route with the bias already moved).
    * nan@0:3: every rank skips the step; iteration 4 starts from the bias iteration 3 started
      from, and each step taken moves each element by exactly one update."""
    rate = 0.01
    argv = (tiny_gpt_args + MOE + ETP1 + SPARSE
            + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--moe-router-bias-update-rate", str(rate), "--train-iters", "6",
               "--overlap-grad-reduce", "--ddp-bucket-size", "20000"])
    variants = {"clean": argv + ["--higgs-step-timeout", "4"],
                "hang": argv + ["--higgs-step-timeout", "2", "--inject-fault", "hang@1:3:6"],
                "skip3": argv + ["--inject-fault", "nan@0:3"]}
    outs = run_ranks(moe_variants, 4, args=(variants,), timeout=600)
    for out in outs:
        assert out["alignments"] == {"clean": 0, "hang": 1, "skip3": 0}
        clean, hang, skip = (out["biases"][name] for name in ("clean", "hang", "skip3"))
        # the first forward of iterations 1-6, then the validation's after iteration 6
        assert sorted(clean) == sorted(hang) == sorted(skip) == list(range(1, 8)) and clean[1], clean.keys()
        for step in clean:
            for name in clean[step]:
                assert torch.equal(hang[step][name], clean[step][name]), f"hang: {name} at iteration {step}"
                assert torch.equal(clean[step][name], outs[0]["biases"]["clean"][step][name]), "ranks differ"
        for name, value in out["params"]["hang"].items():
            assert torch.equal(value, out["params"]["clean"][name]), f"hang: differs from the clean run at {name}"
        for name in skip[1]:
            assert torch.equal(skip[4][name], skip[3][name]), f"{name}: the skipped step moved the bias"
            for step in (1, 2, 4, 5, 6):
                moved = (skip[step + 1][name] - skip[step][name]).abs()
                assert torch.allclose(moved[moved > 0], torch.full_like(moved[moved > 0], rate)), (name, step, moved)
            assert not torch.equal(skip[7][name], skip[1][name]), f"{name}: the bias never moved"


@pytest.mark.parametrize("distopt", [pytest.param([], id="adam"),
                                     pytest.param(["--use-distributed-optimizer"], id="distopt", marks=pytest.mark.oracle)])
def test_a_moe_run_resumes_bitwise(tmp_path, distopt, tiny_gpt_args):
    base = tiny_gpt_args + COMMON + MOE + ETP1 + distopt + SPARSE
    straight = run_ranks(run_trainer, 4, args=(base + ["--train-iters", "6"],))
    run_ranks(run_trainer, 4, args=(base + ["--train-iters", "3", "--save", str(tmp_path)],))
    resumed = run_ranks(run_trainer, 4, args=(base + ["--train-iters", "6", "--load", str(tmp_path)],))
    for a, b in zip(straight, resumed):
        assert b["start"] == 3 and b["losses"] == {i: a["losses"][i] for i in (4, 5, 6)}
    final_a, final_b = _global(straight, "final"), _global(resumed, "final")
    assert final_a.keys() == final_b.keys() and any("experts" in key for key in final_a)
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


@pytest.mark.parametrize("distopt", [pytest.param([], id="adam"),
                                     pytest.param(["--use-distributed-optimizer"], id="distopt", marks=pytest.mark.oracle)])
def test_a_moe_reshard_to_another_expert_parallel_size_keeps_the_global_state(tmp_path, distopt, tiny_gpt_args):
    """Saved with EP 2 (two experts a rank, expert DP 2), loaded with EP 4 (one a rank, expert
    DP 1) on the same four ranks: the global model and Adam moments are the saved ones, and the
    run goes on. (EP 1 puts the experts in the dense optimizer, Megatron's ChainedOptimizer
    becomes one optimizer and its state other keys: the load refuses, naming them.)"""
    base = tiny_gpt_args + COMMON + MOE + ETP1 + distopt + SPARSE
    saved = run_ranks(run_trainer, 4, args=(base + ["--train-iters", "3", "--save", str(tmp_path)],))
    argv = base + ["--expert-model-parallel-size", "4", "--train-iters", "5", "--load", str(tmp_path),
                   "--recovery-mode", "reshard"]
    resumed = run_ranks(run_trainer, 4, args=(argv,))
    before, after = _global(saved, "final"), _global(resumed, "after_load")
    model_keys = [k for k in before if "optimizer." not in k]
    moment_keys = [k for k in before if "exp_avg" in k]
    assert any("experts" in k for k in model_keys) and any("experts" in k for k in moment_keys), sorted(before)
    for key in model_keys + moment_keys:
        assert not before[key].isnan().any(), f"{key}: the saved shards do not tile it"
        assert torch.equal(before[key], after[key]), key
    assert resumed[-1]["start"] == 3 and sorted(resumed[-1]["losses"]) == [4, 5]
