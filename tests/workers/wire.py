"""Rank functions for tests/sync/drill_wire.py: the byte meter against what gloo's sockets were handed."""

from __future__ import annotations


def _written() -> int:
    """Bytes this process has handed to write-like system calls (gloo's sockets among them)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def _priced(ddp) -> float:
    """The wire bytes the paths of ``ddp``'s next step price, over every bucket."""
    shared, total = ddp._higgs, 0.0
    for group in ddp.higgs_bucket_groups:
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
    and what the paths it took price (``wire_bytes`` of each bucket's path that step)."""
    import torch.distributed as dist

    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.reduce.wire import gloo_factor
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv)
    written = [0]
    original = HiggsBucketGroup.finish_grad_sync

    def fenced(group, *a, **k):
        dist.barrier()
        before = _written()
        original(group, *a, **k)
        written[0] += _written() - before
        dist.barrier()

    steps = []
    with training_environment(args):
        trainer = Trainer(args)
        meter = trainer.model[0]._higgs.comm.meter
        HiggsBucketGroup.finish_grad_sync = fenced
        try:
            for _ in range(args.train_iters):
                written[0] = 0
                priced = _priced(trainer.model[0])
                trainer.train_step()
                trainer.iteration += 1
                trainer.consumed_samples += args.global_batch_size
                counted = meter.take()
                steps.append({"written": written[0], "wire": counted.wire, "gloo": counted.wire_as(gloo_factor),
                              "kinds": sorted({kind for kind, _ in counted.by_kind}), "calls": counted.calls,
                              "priced": priced,
                              "density": trainer.model[0]._higgs.schedule.density(trainer.iteration - 1)})
        finally:
            HiggsBucketGroup.finish_grad_sync = original
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
