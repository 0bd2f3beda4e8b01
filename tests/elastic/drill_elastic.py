"""Elastic replicas over torchft, in real multi-process runs."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks

pytest.importorskip("torchft", reason="elastic replicas build on torchft (the test extra installs it)")

from tests.workers.elastic import sync_on_a_torchft_group  # noqa: E402


@pytest.mark.oracle
def test_the_sync_runs_on_torchfts_group_as_on_a_plain_one_across_a_rebuild():
    """Each collective of the gradient sync, and the sparse all-gather path end to end, give
    on torchft's reconfigurable group the results and wire counts they give on a plain gloo
    group, on 3 ranks, in two quorums in a row (torchft rebuilds the group in between)."""
    outs = run_ranks(sync_on_a_torchft_group, 3, timeout=180)
    for rank, out in enumerate(outs):
        assert "pass torchft's ProcessGroupGloo or ProcessGroupNCCL" in out["refused"]
        for quorum in ("quorum 1", "quorum 2"):
            assert out[quorum].keys() == out["plain"].keys()
            for name, value in out["plain"].items():
                assert torch.equal(out[quorum][name], value), (rank, quorum, name)
        assert out["plain"]["rank"].item() == rank and out["plain"]["wire"].item() > 0
