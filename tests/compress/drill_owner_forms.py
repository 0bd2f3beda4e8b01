"""The forms whose shard owners sum (``--higgs-sync agreed``: the same blocks on every rank;
``sharded``: each rank's own top-k per shard): real multi-process megatron-core runs over gloo,
against Megatron's DDP at density 1, and the invariants (DP replicas bitwise equal, the
gradient conserved over the group) under compression."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import train_variants_on_the_compressed_form
from tests.workers.higgs_ddp import check_owner_sum_invariants, owner_sum_invariants


def _argv(tiny_gpt_args, world_size, layout, extra):
    return (tiny_gpt_args + layout + ["--global-batch-size", "16", "--train-iters", "5", "--overlap-grad-reduce",
                                      "--ddp-bucket-size", "20000"] + extra)


LAYOUTS = [pytest.param(2, [], id="dp2"),
           pytest.param(4, ["--tensor-model-parallel-size", "2"], id="tp2xdp2")]
FORMS = pytest.mark.parametrize("form", ["agreed", "sharded"])
DISTOPT = pytest.mark.parametrize("distopt", [[], ["--use-distributed-optimizer"]], ids=["adam", "distopt"])


@FORMS
@DISTOPT
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_density_one_through_the_form_equals_megatron_ddp(form, world_size, layout, distopt, tiny_gpt_args):
    base = _argv(tiny_gpt_args, world_size, layout, distopt)
    variants = {"megatron": base,
                "form-1.0": base + ["--use-higgs", "--higgs-sync", form, "--higgs-compression-ratio", "1.0",
                                    "--higgs-min-bucket-numel", "0", "--higgs-payload", "wide"]}
    for out in run_ranks(train_variants_on_the_compressed_form, world_size, args=(variants,), timeout=400):
        assert out["forced"] > 0
        reference = out["params"]["megatron"]
        for name, value in out["params"]["form-1.0"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max().item(),
                                       msg=lambda m: f"{form} at density 1.0 differs at {name}: {m}")


@FORMS
@DISTOPT
@pytest.mark.parametrize("payload", [["int4", "--higgs-compression-ratio", "0.25", "--higgs-dense-iters", "2",
                                      "--higgs-dense-int8"], ["bf16", "--higgs-compression-ratio", "0.05"]],
                         ids=["int4-25pct-int8-dense", "bf16-5pct"])
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_the_sync_keeps_replicas_equal_and_conserves(form, world_size, layout, payload, distopt, tiny_gpt_args):
    argv = _argv(tiny_gpt_args, world_size, layout, distopt + [
        "--use-higgs", "--higgs-sync", form, "--higgs-min-bucket-numel", "0", "--clip-grad", "0",
        "--higgs-min-param-numel", "256", "--higgs-payload", *payload])
    check_owner_sum_invariants(run_ranks(owner_sum_invariants, world_size, args=(argv,), timeout=400))
