"""Node detection, the two-level process groups, and the hierarchical sync on simulated nodes."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from higgs_megatron.topology import node_id
from tests.workers.common import sparse_sync_invariants, train_variants_on_the_compressed_form
from tests.workers.topology import auto_sync_choices, node_groups_of_world, on_simulated_nodes


def test_node_id_prefers_the_override_then_slurm_then_torchrun(monkeypatch):
    for name in ("HIGGS_NODE_ID", "SLURM_NODEID", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert node_id().startswith("host=")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_id() == "GROUP_RANK=1"
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert node_id() == "SLURM_NODEID=3"
    monkeypatch.setenv("HIGGS_NODE_ID", "a")
    assert node_id() == "HIGGS_NODE_ID=a"


def test_four_ranks_as_two_nodes_get_intra_and_inter_groups():
    outs = run_ranks(on_simulated_nodes, 4, args=(2, node_groups_of_world))
    for rank, out in enumerate(outs):
        node, local = divmod(rank, 2)
        assert out == {"intra": [2 * node, 2 * node + 1], "inter": [local, local + 2], "nodes": 2,
                       "ranks_per_node": 2, "local_index": local}


def test_uneven_nodes_are_refused_naming_the_counts():
    outs = run_ranks(on_simulated_nodes, 3, args=(2, node_groups_of_world))
    assert all(out == {"error": "data-parallel group [0, 1, 2] has [2, 1] ranks on its 2 nodes: the hierarchical "
                                "sync needs the same number on every node"} for out in outs)


def _base(tiny_gpt_args, extra, iters):
    return tiny_gpt_args + extra + ["--global-batch-size", "16", "--train-iters", str(iters), "--overlap-grad-reduce",
                                    "--ddp-bucket-size", "20000"]


HIERARCHICAL = ["--use-higgs", "--higgs-sync", "hierarchical", "--higgs-min-bucket-numel", "0", "--higgs-payload", "wide",
                "--higgs-dense-iters", "0", "--higgs-density-warmup-iters", "0"]


@pytest.mark.parametrize("optimizer", [
    pytest.param(["--optimizer", "sgd", "--lr", "0.1"], id="sgd"),
    # Megatron's distributed optimizer is Adam only; a large epsilon keeps it linear-ish.
    pytest.param(["--use-distributed-optimizer", "--adam-eps", "1.0", "--lr", "0.1"], id="distopt")])
def test_hierarchical_at_density_one_equals_megatron_ddp(optimizer, tiny_gpt_args):
    """To 1e-6 of each tensor's scale, without Adam's normalisation: the sum is taken in another
    order than Megatron's all-reduce ((r0 + r1) + (r2 + r3)), so it may differ in the last bit,
    and Adam with a tiny epsilon turns last-bit noise into whole steps where the true gradient
    is zero (the attention key bias): that oracle would test rounding, not the sync."""
    base = _base(tiny_gpt_args, optimizer, iters=5)
    variants = {"megatron": base, "hierarchical-1.0": base + HIERARCHICAL + ["--higgs-compression-ratio", "1.0"]}
    for out in run_ranks(on_simulated_nodes, 4, args=(2, train_variants_on_the_compressed_form, variants),
                         timeout=400):
        assert out["forced"] > 0, "no bucket took the compressed form"
        reference = out["params"]["megatron"]
        for name, value in out["params"]["hierarchical-1.0"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max().item(),
                                       msg=lambda m: f"hierarchical sync at density 1.0 differs at {name}: {m}")


def test_hierarchical_sparse_sync_invariants(tiny_gpt_args):
    argv = _base(tiny_gpt_args, [], iters=20) + HIERARCHICAL + ["--higgs-compression-ratio", "0.01",
                                                                  "--higgs-min-param-numel", "256"]
    outs = run_ranks(on_simulated_nodes, 4, args=(2, sparse_sync_invariants, argv), timeout=400)
    for name, value in outs[0]["params"].items():
        for out in outs[1:]:
            assert torch.equal(value, out["params"][name]), f"DP replicas differ at {name}"
    for out in outs:
        assert out["conservation"] and all(out["conservation"])
        assert max(out["byte_ratios"]) <= 1 / 40, out["byte_ratios"]
        assert out["compressions_per_step"] == out["buckets"]


AUTO = ["--use-higgs", "--higgs-sync", "auto", "--higgs-min-bucket-numel", "0", "--higgs-compression-ratio", "0.01",
        "--higgs-payload", "wide", "--higgs-dense-iters", "0", "--higgs-density-warmup-iters", "0"]


def test_auto_stays_dense_on_a_fast_link_and_compresses_on_a_slow_one(tiny_gpt_args):
    """Told 10 Tbit/s, compressing cannot pay: every bucket goes dense, through Megatron's own
    collective, so the run equals Megatron's DDP bitwise. Told 10 Mbit/s, every bucket goes
    sparse. Measured, the ranks agree on the costs (or the collectives would not match)."""
    base = _base(tiny_gpt_args, ["--optimizer", "sgd", "--lr", "0.1"], iters=3)
    variants = {"megatron": base, "fast": base + AUTO + ["--higgs-link-gbps", "10000"],
                "slow": base + AUTO + ["--higgs-link-gbps", "0.01"], "measured": base + AUTO}
    outs = run_ranks(auto_sync_choices, 2, args=(variants,), timeout=400)
    for out in outs:
        assert {entry["path"] for entry in out["reports"]["fast"]} == {"dense"}
        sent, dense = out["traffic"]["fast"]
        assert sent == dense > 0
        for name, value in out["params"]["fast"].items():
            assert torch.equal(value, out["params"]["megatron"][name]), name
        assert {entry["path"] for entry in out["reports"]["slow"]} == {"sparse"}
        sent, dense = out["traffic"]["slow"]
        assert sent < dense / 10
        assert out["sources"]["slow"] == "assumed 0.01 Gbit/s" and out["sources"]["measured"] == "measured"
    assert outs[0]["reports"]["measured"] == outs[1]["reports"]["measured"]
    for name, value in outs[0]["params"]["measured"].items():
        assert torch.equal(value, outs[1]["params"]["measured"][name]), f"DP replicas differ at {name}"


def test_auto_goes_hierarchical_across_slow_nodes(tiny_gpt_args):
    """Four ranks as two nodes, fast inside a node and slow between: the node's dense steps
    are cheap and only the node's slice is compressed across nodes."""
    base = _base(tiny_gpt_args, ["--optimizer", "sgd", "--lr", "0.1"], iters=3)
    variants = {"hierarchical": base + AUTO + ["--higgs-link-gbps", "0.01", "--higgs-node-link-gbps", "10000"]}
    outs = run_ranks(on_simulated_nodes, 4, args=(2, auto_sync_choices, variants), timeout=400)
    for out in outs:
        assert {entry["path"] for entry in out["reports"]["hierarchical"]} == {"hierarchical"}
        assert out["sources"]["hierarchical"] == "assumed 0.01 Gbit/s, 10000 Gbit/s inside a node"
    for name, value in outs[0]["params"]["hierarchical"].items():
        for out in outs[1:]:
            assert torch.equal(value, out["params"]["hierarchical"][name]), f"DP replicas differ at {name}"
