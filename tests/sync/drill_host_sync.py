"""No host synchronisation in the gradient path: counted on CPU, where they are free, so that
they never reach a GPU, where each one stalls backward's launch queue."""

import pytest

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.host_sync import host_syncs_in_gradient_path


@pytest.mark.parametrize("compressor,payload", [
    ("topk", ["--higgs-payload", "wide"]), ("sampled-topk", ["--higgs-payload", "int8"]),
    ("topk", ["--higgs-payload", "bf16", "--higgs-dense-iters", "1", "--higgs-dense-bf16"]),
    ("sampled-topk", ["--higgs-payload", "int8", "--higgs-dense-iters", "1", "--higgs-dense-int8",
                      "--higgs-compression-ratio", "0.2"]),
    ("topk", ["--higgs-sync", "agreed", "--higgs-payload", "int4", "--higgs-dense-iters", "1", "--higgs-dense-int8",
              "--higgs-compression-ratio", "0.25"]),
    ("topk", ["--higgs-sync", "agreed", "--higgs-payload", "int8", "--use-distributed-optimizer"]),
    ("sampled-topk", ["--higgs-sync", "sharded", "--higgs-payload", "int4", "--higgs-dense-iters", "1",
                      "--higgs-dense-int8", "--higgs-compression-ratio", "0.25"]),
    ("topk", ["--higgs-sync", "sharded", "--higgs-payload", "int8", "--use-distributed-optimizer"]),
    ("topk", ["--higgs-sync", "onebit", "--higgs-payload", "sign", "--higgs-compression-ratio", "1.0",
              "--higgs-dense-iters", "1"]),
    # and the parameter all-gather as int4 changes (audited too: start_param_sync)
    ("topk", ["--higgs-sync", "onebit", "--higgs-payload", "sign", "--higgs-compression-ratio", "1.0",
              "--higgs-dense-iters", "1", "--use-distributed-optimizer", "--higgs-param-payload", "int4"])],
    ids=["topk-wide", "sampled-topk-int8", "topk-bf16-dense-bf16", "sampled-topk-bitmap-dense-int8",
         "agreed-int4-dense-int8", "agreed-int8-distopt", "sharded-int4-dense-int8", "sharded-int8-distopt", "onebit",
         "onebit-distopt"])
def test_a_compressed_dp2_step_makes_no_host_sync_in_the_gradient_path(compressor, payload, tiny_gpt_args):
    argv = tiny_gpt_args + ["--higgs-compression-ratio", "0.01", "--higgs-sync", "sparse"] + payload + [
        "--train-iters", "3", "--global-batch-size", "16", "--overlap-grad-reduce",
        "--ddp-bucket-size", "20000", "--use-higgs", "--higgs-compressor", compressor,
        "--higgs-min-bucket-numel", "0", "--higgs-min-param-numel", "256"]
    for rank, out in enumerate(run_ranks(host_syncs_in_gradient_path, 2, args=(argv,), timeout=300)):
        # Every step audited: several bucket groups start and finish, and the decision's flags.
        assert out["start_grad_sync"] >= 3 * 2 and out["finish_grad_sync"] >= 3 * 2, out
        assert out["nonfinite_flag"] == 3, out
        if "--use-distributed-optimizer" in payload:
            assert out["start_param_sync"] >= 3 * 2, out
        assert out["calls"] == {}, f"rank {rank}: host syncs in the gradient path:\n" + "\n".join(
            f"{n:4d} {site}" for site, n in sorted(out["calls"].items(), key=lambda kv: -kv[1]))
