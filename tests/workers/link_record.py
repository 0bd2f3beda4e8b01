"""Rank functions for tests/sync/drill_link_record.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist


def probe_three_times(cache: str) -> list[dict]:
    """``measure_link_costs`` over a gloo group of the ranks, three times, each with the probe's
    timings set (the same on every rank but rank 1's 10% slower, so the MAX all-reduce counts):
    as recorded; the collectives' large-size timings 1.5x and the small ones 5x (within the
    margin, and not compared); everything 6x (past it). The costs each time decides by."""
    from higgs_megatron.reduce import link_probe

    os.environ["HIGGS_CACHE_DIR"] = cache
    dist.init_process_group("gloo")
    slower = 1.1 if dist.get_rank() == 1 else 1.0
    costs = []
    for small, large in ((1.0, 1.0), (5.0, 1.5), (6.0, 6.0)):
        calls = iter(range(100))

        def timed(run, device, group=None, small=small, large=large, calls=calls):  # no collective runs
            i = next(calls)
            return slower * (small * 1e-4 if i % 2 == 0 else large * 1e-2 * (1 + i))

        link_probe._timed = timed
        decided = link_probe.measure_link_costs(dist.group.WORLD, None, False, None, 0.25, "topk", True,
                                                torch.device("cpu"))
        costs.append(dataclasses.asdict(decided))
    dist.destroy_process_group()
    return costs
