"""Wire bytes per rank at large data-parallel sizes, counted on one rank's real gradient sync.

For each DP size P, a fresh process joins torch's fake process group of P ranks (backend
``fake``: every collective returns at once and moves nothing), builds the pretrain script's
model with ``--use-higgs`` and a schedule, and runs HiggsDDP's own bucket syncs on random
gradients, step by step through the schedule. The meter (``reduce.wire``) counts every
collective the sync issues as it is issued, at the group's size: what this rank's link would
carry on a ring of P ranks. Every rank of a data-parallel group issues the same collectives with
the same sizes, so one rank's count is every rank's. A step's count depends only on its
density and whether it is a dense-stage step, so each distinct (density, stage) is synced once
and counted for every step that has it.

The baseline is Megatron's own data-parallel traffic for the same buckets at the same P: an fp32
all-reduce, or with ``--use-distributed-optimizer`` a reduce-scatter and the parameter
all-gather (which the count includes on both sides). PyTorch DDP's fp16 or bf16 hook
all-reduces half the bytes: 0.5x at every P.

    python scripts/project_wire.py [--sizes 2,8,64,1024] [--train-iters 2400] [--distopt] [--forms sparse,agreed,sharded,onebit]
                                   [-- <pretrain flags for the model>]

Prints a markdown table: per schedule and P, the wire bytes over the run and of one
compressed step, each against dense. Needs no network and no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_group import fake_group  # noqa: E402
from higgs_megatron_bench.runs import lean_flags  # noqa: E402
from higgs_megatron.logs import get_logger, setup_logging  # noqa: E402

log = get_logger("bench_project_wire")


def count_sync(world_size: int, argv: list[str], steps: list[int] | None = None) -> dict:
    """In this process (which must have no process group yet): join a fake group of
    ``world_size`` ranks as rank 0, build the model of ``argv`` and count the wire bytes of each
    sync of the schedule (``steps``: those steps only; default: every step of ``--train-iters``).
    Returns ``{"steps": [[wire, dense wire, density, dense stage], ...], "run": [wire, dense wire]}``."""
    import torch

    from higgs_megatron.compress.payload import Payload
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    # Nothing moves on the fake group: what a collective "received" is whatever the buffer held,
    # which no decoder is made to read (positions could point anywhere). Payloads are not
    # decoded; decoding issues no collective, so the count is the same.
    add_to, decode_rows = Payload.add_to, Payload.decode_rows
    Payload.add_to = lambda self, target, buffer, layout: None
    Payload.decode_rows = lambda self, buffer, layout, dtype: torch.zeros(buffer.shape[0], layout.numel, dtype=dtype)
    counted: dict[tuple[float, bool, bool], tuple[float, float]] = {}
    per_step, run = [], [0.0, 0.0]
    generator = torch.Generator().manual_seed(0)
    try:
        with fake_group(world_size):
            args = parse_args(argv)  # after the group: the data-parallel size is read from it
            with training_environment(args):
                trainer = Trainer(args)
                ddp = trainer.model[0]
                schedule = ddp._higgs.schedule
                # With the distributed optimizer, the parameter all-gather after each step: a run's first
                # is Megatron's own (the ranks' parameters need not be equal before it), so it is a key apart.
                gathers = ddp.ddp_config.use_distributed_optimizer
                for step in (range(args.train_iters) if steps is None else steps):
                    key = (schedule.density(step), schedule.dense_stage(step),
                           all(group.higgs_param_changes is None or group.higgs_param_changes.ready
                               for group in ddp.bucket_groups))
                    if key not in counted:
                        ddp.take_stats()  # nothing before this step
                        for group in ddp.bucket_groups:
                            group.higgs_steps = step
                            for bucket in group.buckets:
                                bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=generator))
                            if group.ddp_config.overlap_grad_reduce:  # else finish starts it, as in Megatron's loop
                                group.start_grad_sync()
                            group.finish_grad_sync()
                            if gathers:
                                _param_sync(group)
                        stats = ddp.take_stats()
                        counted[key] = (stats.wire_bytes, stats.dense_wire_bytes)
                    wire, dense = counted[key]
                    per_step.append([wire, dense, key[0], key[1]])
                    run[0] += wire
                    run[1] += dense
                trainer.close()
    finally:
        Payload.add_to, Payload.decode_rows = add_to, decode_rows
    return {"steps": per_step, "run": run}


def _param_sync(group) -> None:
    """One bucket group's parameter all-gather, waited for (as after an optimizer step)."""
    group.start_param_sync()
    if group.param_gather_handle is not None:
        group.param_gather_handle.wait()
        group.param_gather_handle = None


def _child(world_size: int, argv: list[str]) -> dict:
    """``count_sync`` in a fresh interpreter: a fake group is the process's default group."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from project_wire import count_sync; "
            "print('RESULT ' + json.dumps(count_sync(int(sys.argv[2]), json.loads(sys.argv[3]))))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(world_size),
                           json.dumps(argv)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"counting at P={world_size} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def projected_ratio(world_size: int, flags: list[str]) -> float:
    """Wire bytes per rank over the run of pretrain ``flags`` at ``world_size`` ranks against
    Megatron's dense reduction's, counted on the fake group (one sample per rank)."""
    counted = _child(world_size, flags + ["--micro-batch-size", "1", "--global-batch-size", str(world_size),
                                          "--eval-iters", "0", "--num-threads", "1"])
    wire, dense = counted["run"]
    return wire / dense


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,8,64,1024", help="comma-separated DP sizes")
    parser.add_argument("--train-iters", type=int, default=2400)
    parser.add_argument("--distopt", action="store_true", help="with --use-distributed-optimizer")
    parser.add_argument("--forms", default="sparse,agreed,sharded,onebit",
                        help="the lean schedule's forms to count, and onebit (1-bit Adam's exchange, as derived)")
    parser.add_argument("extra", nargs="*", help="after --: pretrain flags for the model (default: the script's)")
    args = parser.parse_args()
    setup_logging()
    sizes = [int(size) for size in args.sizes.split(",")]
    common = ["--train-iters", str(args.train_iters), "--micro-batch-size", "1", "--eval-iters", "0",
              "--log-interval", str(args.train_iters), "--num-threads", "1", "--overlap-grad-reduce",
              *(["--use-distributed-optimizer"] if args.distopt else []), *args.extra]
    names = {"sparse": "lean, sparse (all-gather)", "agreed": "lean, agreed (all-to-all)",
             "sharded": "lean, sharded (all-to-all, all-gather of the owners')",
             "onebit": "onebit: 1-bit Adam (int8 dense stage, then signs)"}
    schedules = {names[form]: (["--use-higgs", "--higgs-sync", "onebit"] if form == "onebit"
                               else lean_flags(args.train_iters, sync=form)) for form in args.forms.split(",")}
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    for name, flags in schedules.items():
        rows[name] = {}
        for size in sizes:
            log.info("%s at P=%d", name, size)
            counted = _child(size, common + ["--global-batch-size", str(size)] + flags)
            wire, dense = counted["run"]
            last_wire, last_dense = counted["steps"][-1][:2]
            rows[name][size] = (wire / dense, last_wire / last_dense)
    baseline = "reduce-scatter and parameter all-gather" if args.distopt else "all-reduce"
    header = " | ".join(f"P={size:,}" for size in sizes)
    lines = [f"Wire bytes per rank against Megatron's dense fp32 {baseline} at the same P, over "
             f"{args.train_iters:,} iterations (in brackets: one compressed step at the end)", "",
             f"| schedule | {header} |", "|---|" + "---|" * len(sizes)]
    lines.append("| torch DDP + fp16 or bf16 hook (all-reduce in 16 bits) | " + " | ".join("0.500" for _ in sizes) + " |")
    for name, by_size in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{run:.4f} ({step:.4f})" for run, step in by_size.values()) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
