"""The agreed-mask sync (``--higgs-sync agreed``): pure planning in one process, then real
multi-process megatron-core runs over gloo against Megatron's DDP and the invariants."""

import pytest
import torch

from higgs_megatron.compress.agreed import AgreedPlan, pack_rows, unpack_rows
from higgs_megatron.compress.compressor import ParamSlot
from higgs_megatron.testing import run_ranks
from tests.common_workers import train_variants_on_the_compressed_form
from tests.higgs_ddp_workers import agreed_sync_invariants

CPU = torch.device("cpu")
# A weight across three of four shards, a bias (sent whole), a small gap, a second weight.
SLOTS = [ParamSlot(0, 1000), ParamSlot(1000, 1010), ParamSlot(1024, 5000), ParamSlot(5000, 5003)]


def test_rows_hold_each_owners_shard_and_density_one_covers_every_parameter_once():
    """Row j holds coordinates of shard j only; the rows and the always-sent coordinates
    together cover every parameter's coordinate once and nothing else."""
    plan = AgreedPlan(5003, SLOTS, 64, 4, CPU, "int4")
    assert plan.shard == 1251 and [p.owner for p in plan.pieces] == [0, 0, 1, 2, 3]
    scores = plan.scores(torch.randn(5003, generator=torch.Generator().manual_seed(0)))
    for density in (0.1, 0.5, 1.0):
        positions, real = plan.select(scores, density)
        assert positions.shape == (4, plan.layout(density).width)
        for owner in range(4):  # every slot points into its owner's shard (padding too)
            assert bool(((positions[owner] // plan.shard) == owner).all())
        assert torch.equal(plan.select(scores.clone(), density)[0], positions)  # same scores, same rows
    sent = torch.cat([positions[real], plan.always_positions])  # the bias goes by an all-reduce of its own
    covered = torch.zeros(5003, dtype=torch.long).index_add_(0, sent, torch.ones_like(sent))
    in_params = torch.zeros(5003, dtype=torch.bool)
    for slot in SLOTS:
        in_params[slot.start:slot.end] = True
    assert bool((covered[in_params] == 1).all()) and bool((covered[~in_params] == 0).all())


def test_selection_follows_the_agreed_scores():
    plan = AgreedPlan(4096, [ParamSlot(0, 4096)], 64, 1, CPU)
    x = torch.zeros(4096)
    x[1000] = 5.0  # block 7 (coordinates 896..1023)
    positions, real = plan.select(plan.scores(x), 1 / 32)
    assert plan.layout(1 / 32).k_blocks == [1] and sorted(positions[0].tolist()) == list(range(896, 1024))


@pytest.mark.parametrize("value_format", ["wide", "bf16", "int8", "int4"])
def test_rows_decode_to_what_pack_rounded(value_format):
    values = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    wire, rounded = pack_rows(values, value_format, 256)
    assert wire.dtype == torch.uint8 and wire.shape[1] % 4 == 0
    assert torch.equal(unpack_rows(wire, value_format, 300, 256, torch.float32), rounded)
    error = {"wide": 0.0, "bf16": 2 ** -8, "int8": 1 / 254, "int4": 1 / 14}[value_format]
    assert float((values - rounded).abs().max()) <= error * float(values.abs().max()) * 1.01


def _argv(tiny_gpt_args, world_size, layout, extra):
    return (tiny_gpt_args + layout + ["--global-batch-size", "16", "--train-iters", "5", "--overlap-grad-reduce",
                                      "--ddp-bucket-size", "20000"] + extra)


LAYOUTS = [pytest.param(2, [], id="dp2"),
           pytest.param(4, ["--tensor-model-parallel-size", "2"], id="tp2xdp2")]
DISTOPT = pytest.mark.parametrize("distopt", [[], ["--use-distributed-optimizer"]], ids=["adam", "distopt"])


@DISTOPT
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_density_one_through_the_agreed_form_equals_megatron_ddp(world_size, layout, distopt, tiny_gpt_args):
    base = _argv(tiny_gpt_args, world_size, layout, distopt)
    variants = {"megatron": base,
                "agreed-1.0": base + ["--use-higgs", "--higgs-sync", "agreed", "--higgs-compression-ratio", "1.0",
                                      "--higgs-min-bucket-numel", "0"]}
    for out in run_ranks(train_variants_on_the_compressed_form, world_size, args=(variants,), timeout=400):
        assert out["forced"] > 0
        reference = out["params"]["megatron"]
        for name, value in out["params"]["agreed-1.0"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max().item(),
                                       msg=lambda m: f"agreed at density 1.0 differs at {name}: {m}")


@DISTOPT
@pytest.mark.parametrize("payload", [["int4", "--higgs-compression-ratio", "0.25", "--higgs-dense-iters", "2",
                                      "--higgs-dense-int8"], ["bf16", "--higgs-compression-ratio", "0.05"]],
                         ids=["int4-25pct-int8-dense", "bf16-5pct"])
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_agreed_sync_keeps_replicas_equal_and_conserves(world_size, layout, payload, distopt, tiny_gpt_args):
    argv = _argv(tiny_gpt_args, world_size, layout, distopt + [
        "--use-higgs", "--higgs-sync", "agreed", "--higgs-min-bucket-numel", "0", "--clip-grad", "0",
        "--higgs-min-param-numel", "256", "--higgs-payload", *payload])
    outs = run_ranks(agreed_sync_invariants, world_size, args=(argv,), timeout=400)
    by_shard = {}
    for out in outs:
        assert out["agreed_steps"] >= 3 and out["gaps"] and max(out["gaps"]) < 1e-6, out["gaps"]
        by_shard.setdefault((out["coords"]["tp"], out["coords"]["pp"]), []).append(out["params"])
    for shard, replicas in by_shard.items():
        for name, value in replicas[0].items():
            assert torch.equal(value, replicas[1][name]), f"DP replicas differ at {name} (tp, pp) = {shard}"
