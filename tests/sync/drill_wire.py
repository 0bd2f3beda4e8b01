"""Wire bytes: the meter's count of the gradient sync's collectives (and the distributed
optimizer's parameter all-gather) against what gloo moved, and nothing else of size moved in a step."""

import sys

import pytest

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.wire import fake_group_count, sync_bytes_against_gloo


FORMS = {
    "sparse-int4": ["--higgs-sync", "sparse", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25"],
    "sparse-distopt": ["--higgs-sync", "sparse", "--higgs-compression-ratio", "0.05", "--use-distributed-optimizer"],
    "agreed-int4": ["--higgs-sync", "agreed", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25",
                    "--higgs-dense-int8"],
    "agreed-distopt": ["--higgs-sync", "agreed", "--higgs-payload", "int8", "--higgs-compression-ratio", "0.05",
                       "--use-distributed-optimizer"],
    "sharded-int4": ["--higgs-sync", "sharded", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25",
                     "--higgs-dense-int8"],
    "sharded-distopt": ["--higgs-sync", "sharded", "--higgs-payload", "int8", "--higgs-compression-ratio", "0.05",
                        "--use-distributed-optimizer"],
    "onebit": ["--higgs-sync", "onebit"],
    "onebit-distopt": ["--higgs-sync", "onebit", "--use-distributed-optimizer"],
}


# (with the distributed optimizer the parameter all-gather is counted too)
COMPRESSED_KINDS = {"sparse-int4": {"all_gather"}, "sparse-distopt": {"all_gather"},
                    "agreed-int4": {"all_to_all", "all_reduce", "all_gather"},
                    "agreed-distopt": {"all_to_all", "all_reduce", "all_gather"},
                    "sharded-int4": {"all_to_all", "all_reduce", "all_gather"},
                    "sharded-distopt": {"all_to_all", "all_reduce", "all_gather"},
                    "onebit": {"all_to_all", "all_reduce", "all_gather"},
                    "onebit-distopt": {"all_to_all", "all_reduce", "all_gather"}}


CASES = [(world_size, form) for world_size in (2, 4) for form in FORMS] + [
    (8, "sparse-int4"), (8, "agreed-int4"), (8, "sharded-int4"), (8, "onebit")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")
@pytest.mark.parametrize("world_size,form", CASES)
def test_meter_counts_what_gloo_moves(world_size, form, tiny_gpt_args):
    argv = (tiny_gpt_args + ["--global-batch-size", str(4 * world_size), "--train-iters", "3",
                             "--ddp-bucket-size", "20000", "--use-higgs", "--higgs-dense-iters", "1",
                             "--higgs-min-bucket-numel", "0"] + FORMS[form])
    for rank_out in run_ranks(sync_bytes_against_gloo, world_size, args=(argv,), timeout=400):
        for step in rank_out["steps"]:
            assert step["gloo"] > 0
            headers = 256 * step["calls"] * 2 * (world_size - 1)
            assert step["gloo"] <= step["written"] <= step["gloo"] * 1.01 + headers, (world_size, form, step)
            assert step["priced"] == pytest.approx(step["wire"], rel=1e-9), (world_size, form, step)  # as launched
            # Every byte the DP group moves in a step is counted: the rest of the step writes only the
            # fences' barriers and a few scalars (measured at most 3.2 KB), where one uncounted bucket
            # collective or parameter all-gather of this model is tens of KB
            assert step["outside"] <= 4096, (world_size, form, step)
        dense_step, compressed_step = rank_out["steps"][0], rank_out["steps"][-1]
        assert set(compressed_step["kinds"]) == COMPRESSED_KINDS[form]
        if form == "onebit":  # every coordinate, as a sign: about an eighth of the int8 dense stage's wire
            assert compressed_step["density"] == 1 and compressed_step["wire"] < dense_step["wire"] / 5
        elif form == "onebit-distopt":  # and the parameters' int4 changes, where the first all-gather is fp32
            assert compressed_step["density"] == 1 and compressed_step["wire"] < dense_step["wire"] / 4
        else:
            assert compressed_step["density"] < 1
        assert dense_step["density"] == 1


@pytest.mark.parametrize("form", ["sparse-int4", "agreed-int4", "agreed-distopt", "sharded-int4", "sharded-distopt",
                                  "onebit", "onebit-distopt"])
def test_one_rank_on_a_fake_group_counts_what_real_ranks_count(form, tiny_gpt_args):
    """``scripts/project_wire.py`` counts one rank's sync on torch's fake process group of P
    ranks (nothing moves): per step, the same wire bytes as each of P real gloo ranks counts
    (which the test above holds against the bytes gloo moved)."""
    world_size = 4
    argv = (tiny_gpt_args + ["--global-batch-size", str(4 * world_size), "--train-iters", "3", "--ddp-bucket-size",
                             "20000", "--use-higgs", "--higgs-dense-iters", "1", "--higgs-min-bucket-numel", "0"]
            + FORMS[form])
    real = run_ranks(sync_bytes_against_gloo, world_size, args=(argv,), timeout=400)
    fake = run_ranks(fake_group_count, 1, args=(world_size, argv, [0, 1, 2]), timeout=400)[0]
    assert [round(step[0], 6) for step in fake["steps"]] == [round(step["wire"], 6) for step in real[0]["steps"]]
    assert fake["steps"][0][3] and not fake["steps"][-1][3]  # a dense-stage step, then compressed ones
