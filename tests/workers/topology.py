"""Rank functions for tests/sync/drill_topology.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations

from tests.workers.common import parameters


def on_simulated_nodes(ranks_per_node: int, fn, *args):
    """Run ``fn(*args)`` with this rank placed on node ``rank // ranks_per_node`` (the override
    of higgs_megatron.topology)."""
    import os

    os.environ["HIGGS_NODE_ID"] = str(int(os.environ["RANK"]) // ranks_per_node)
    return fn(*args)


def node_groups_of_world() -> dict:
    """build_node_groups over the whole world as one DP group: what this rank got."""
    import torch.distributed as dist

    from higgs_megatron.topology import TopologyError, build_node_groups

    dist.init_process_group("gloo")
    try:
        groups = build_node_groups(dist.group.WORLD)
    except TopologyError as error:
        return {"error": str(error)}
    finally:
        dist.barrier()
    return {"intra": dist.get_process_group_ranks(groups.intra), "inter": dist.get_process_group_ranks(groups.inter),
            "nodes": groups.nodes, "ranks_per_node": groups.ranks_per_node, "local_index": groups.local_index}


def auto_sync_choices(variants: dict[str, list[str]]) -> dict:
    """Train each variant; report what ``--higgs-sync auto`` chose, the bytes the steps handed
    to collectives against dense, and the final parameters."""
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    parsed = {name: parse_args(argv) for name, argv in variants.items()}
    out = {"params": {}, "reports": {}, "sources": {}, "traffic": {}}
    with training_environment(next(iter(parsed.values()))):
        for name, args in parsed.items():
            trainer = Trainer(args)
            totals = [0, 0]
            measure = trainer._traffic

            def counting_traffic():
                stats = measure()
                totals[0] += stats.bytes_sent
                totals[1] += stats.dense_bytes
                return stats

            trainer._traffic = counting_traffic
            trainer.train()
            chunk = trainer.model[0]
            out["params"][name] = parameters(trainer)
            out["reports"][name] = getattr(chunk, "higgs_sync_report", None)
            costs = getattr(chunk, "link_costs", None)
            out["sources"][name] = costs.source if costs is not None else None
            out["traffic"][name] = tuple(totals)
            trainer.close()
    return out
