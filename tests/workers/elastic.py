"""Rank functions for tests/elastic (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations


def sync_on_a_torchft_group() -> dict:
    """Every collective of the gradient sync, and the sparse all-gather path itself, issued
    on a plain gloo group (``wire.Collectives``) and on torchft's reconfigurable gloo group
    (``ReplicaCollectives``), before and after torchft rebuilds it for a new quorum: the
    results and the wire counts of both, per case."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, make_selector, pack_with_feedback
    from higgs_megatron.elastic.collectives import ReplicaCollectives, inner_group
    from higgs_megatron.reduce.sparse_allreduce import launch_sparse_allreduce
    from higgs_megatron.reduce.wire import Collectives

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plain = dist.new_group(backend="gloo")
    replicas = ProcessGroupGloo(timeout=timedelta(seconds=60))
    store = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/torchft-test"
    out: dict = {}

    def run(comm, group) -> dict:
        torch.manual_seed(rank)
        grad = torch.randn(3072)
        results = {"rank": torch.tensor([comm.rank(group)])}
        summed = grad.clone()
        comm.all_reduce(summed, group)
        results["all_reduce"] = summed
        shard = torch.empty(3072 // world)
        comm.reduce_scatter(shard, grad.clone(), group)
        results["reduce_scatter"] = shard
        gathered = torch.empty(world * 512)
        comm.all_gather(gathered, grad[:512].clone(), group, async_op=True).wait()
        results["all_gather"] = gathered
        exchanged = torch.empty(3072)
        comm.all_to_all(exchanged, grad.clone(), group)
        results["all_to_all"] = exchanged
        plan = BucketPlan(3072, [ParamSlot(0, 3072)], min_param_numel=0, device=torch.device("cpu"))
        packed = pack_with_feedback(grad.clone(), plan, 0.05, make_selector("topk"), None)
        target = torch.empty(3072)
        launch_sparse_allreduce(comm, packed, target, group).finish()
        results["sparse"] = target
        results["wire"] = torch.tensor([comm.meter.take().wire])
        return results

    out["plain"] = run(Collectives(), plain)
    for quorum in (1, 2):  # a quorum's rebuild replaces the group inside the wrapper
        replicas.configure(f"{store}/{quorum}", f"replica_{rank}", rank, world, quorum_id=quorum)
        out[f"quorum {quorum}"] = run(ReplicaCollectives(), replicas)
    try:  # the Manager's own wrapper around torchft's group is refused, naming what to pass
        inner_group(type("Managed", (), {"parent": replicas})())
    except TypeError as error:
        out["refused"] = str(error)
    dist.destroy_process_group()
    return out
