"""Rank functions for tests/sync/drill_wire.py: the byte meter against what gloo's sockets were handed."""

from __future__ import annotations


def _written() -> int:
    """Bytes this process has handed to write-like system calls (gloo's sockets among them)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def _priced(ddp) -> float:
    """The wire bytes the paths of ``ddp``'s next step price, over every bucket, and its
    parameter all-gather's with the distributed optimizer."""
    shared, total = ddp._higgs, 0.0
    for group in ddp.higgs_bucket_groups:
        total += group.param_gather_wire()
        step = group.next_step()
        density, dense = shared.schedule.density(step), shared.schedule.dense_stage(step)
        for paths in group.higgs_buckets:
            path, step_density = paths.step_path(density, dense, False, group.higgs_domain.costs)
            total += path.wire_bytes(step_density)
    return total


def sync_bytes_against_gloo(argv: list[str]) -> dict:
    """Train ``argv`` without overlap (each bucket group's whole sync runs inside its
    ``finish_grad_sync``), fenced by barriers; per step, what this rank's meter counted
    (ring wire bytes, and the same calls under gloo's algorithms), what it wrote meanwhile,
    what it wrote in the rest of the step (``outside``: the fences' barriers, the loss and
    grad-norm scalars, the step's vote; anything uncounted would show there), and what the
    paths it took price (``wire_bytes`` of each bucket's path that step)."""
    import torch.distributed as dist

    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.reduce.wire import gloo_factor
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv)
    written = [0]
    original, original_gather = HiggsBucketGroup.finish_grad_sync, HiggsBucketGroup.start_param_sync

    def fencing(method):
        def fenced(group, *a, **k):
            dist.barrier()
            before = _written()
            method(group, *a, **k)
            written[0] += _written() - before
            dist.barrier()
        return fenced

    steps = []
    with training_environment(args):
        trainer = Trainer(args)
        meter = trainer.model[0]._higgs.comm.meter
        HiggsBucketGroup.finish_grad_sync = fencing(original)
        HiggsBucketGroup.start_param_sync = fencing(original_gather)  # synchronous: no --overlap-param-gather
        try:
            for _ in range(args.train_iters):
                written[0] = 0
                priced = _priced(trainer.model[0])
                step_started = _written()
                trainer.train_step()
                step_written = _written() - step_started
                trainer.iteration += 1
                trainer.consumed_samples += args.global_batch_size
                counted = meter.take()
                steps.append({"written": written[0], "outside": step_written - written[0], "wire": counted.wire,
                              "gloo": counted.wire_as(gloo_factor),
                              "kinds": sorted({kind for kind, _ in counted.by_kind}), "calls": counted.calls,
                              "priced": priced,
                              "density": trainer.model[0]._higgs.schedule.density(trainer.iteration - 1)})
        finally:
            HiggsBucketGroup.finish_grad_sync, HiggsBucketGroup.start_param_sync = original, original_gather
        trainer.close()
    return {"steps": steps}


def fake_group_count(world_size: int, argv: list[str], steps: list[int]) -> dict:
    """``scripts/project_wire.py``'s count of ``steps`` on a fake group of ``world_size`` ranks."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "project_wire.py"
    spec = importlib.util.spec_from_file_location("project_wire", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count_sync(world_size, argv, steps)


def param_changes_over_steps(payload: str, steps: int, dtype_name: str) -> dict:
    """Megatron's equal shards of one bucket's parameter buffer on every rank; each step every
    owner moves its shard toward a target of its own (a heavy-tailed walk, as Adam's updates
    on rare rows are) and the change goes out through ``reduce.param_gather``. Returns, per
    step, this rank's buffer, and the worst gap between the owner's exact value and what every
    rank holds of its shard, beside the worst step's change."""
    import torch
    import torch.distributed as dist

    from higgs_megatron.reduce.param_gather import ParamChanges, keep_agreed, own_shard, start_param_changes
    from higgs_megatron.reduce.wire import Collectives

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    shard = 1000  # not a multiple of 8: the row pads
    generator = torch.Generator().manual_seed(0)  # the same start on every rank
    buffer = torch.randn(world * shard, generator=generator).to(dtype)
    changes, comm = ParamChanges(payload, [None]), Collectives()
    keep_agreed(changes, [buffer], world, rank)  # as after Megatron's first, dense, gather
    exact = own_shard(buffer, world, rank).float().clone()
    mine = torch.Generator().manual_seed(100 + rank)
    buffers, gaps, largest = [], [], []
    for _ in range(steps):
        step = torch.randn(shard, generator=mine) * 1e-3
        step[torch.randint(0, shard, (5,), generator=mine)] *= 300  # a few coordinates move far
        exact += step
        own_shard(buffer, world, rank).copy_(exact)  # Megatron's copy of the main params into the buffer
        start_param_changes(comm, dist.group.WORLD, [buffer], changes, async_op=True).wait()
        buffers.append(buffer.clone())
        gaps.append(float((exact - own_shard(buffer, world, rank).float()).abs().max()))
        largest.append(float(step.abs().max()))
    dist.barrier()
    return {"buffers": buffers, "gaps": gaps, "largest": largest, "agreed": changes.agreed[0].clone(),
            "mine": own_shard(buffer, world, rank).clone(), "wire": comm.meter.take().wire}
