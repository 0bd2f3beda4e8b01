"""What a checkpoint save costs the training loop: ours against megatron-core's own, in one run.

The same training state (a GPT with the distributed optimizer, DP=2 on CPU) is saved, at the
same iteration, in six ways:

* ``higgs sync`` / ``higgs async``: this package (rank map, hashes, commit; the
  distributed-optimizer state in model space, reshardable across TP/PP/DP);
* ``megatron sync|async <format>``: ``dist_checkpointing.save`` as Megatron-LM calls it, with
  the distributed optimizer's ``dp_reshardable`` format (reshards DP only) and
  ``fully_reshardable`` (TP/PP/DP); async through its ``AsyncCallsQueue``, finalized after
  every step as Megatron-LM's loop does; and its fastest: async ``dp_reshardable`` with
  ``--ckpt-assume-constant-structure`` (planned and validated once, as ours).

For each: the **stall** (the loop is blocked in the save call), the **slowdown** of the
training steps that run while the background write is in flight (their time minus the median
step time without a save, plus every completion check, the finalization and commit included), and the **total** time
from the start of the save until it is committed. Each is the median of ``--repeats`` saves, the
slowest rank's. Ratios are to the synchronous save of the same format. Writes
``checkpoint.md`` and ``checkpoint.png`` into ``--out``.

    python scripts/bench_checkpoint.py [--nproc 2] [--repeats 3] [--out runs/checkpoint] [-- pretrain flags]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron_bench.runs import REPO, markdown_table  # noqa: E402
from higgs_megatron.device import collective_device  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--use-distributed-optimizer", "--eval-iters", "0", "--log-interval", "1000000"]
FORMATS = {"dp_reshardable": "DP", "fully_reshardable": "TP, PP, DP"}


class HiggsSync:
    reshards = "TP, PP, DP"

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def start(self, directory: Path) -> None:
        from higgs_megatron.checkpoint.save import save_checkpoint

        save_checkpoint(self.trainer.training_state(), directory)

    def done(self) -> bool:
        return True


class HiggsAsync(HiggsSync):
    def __init__(self, trainer) -> None:
        from higgs_megatron.checkpoint.async_save import AsyncCheckpointer

        super().__init__(trainer)
        self.checkpointer = AsyncCheckpointer()
        trainer.checkpointer = self.checkpointer  # so that train_step waits for its host copy, as in training

    def start(self, directory: Path) -> None:
        self.checkpointer.start(self.trainer.training_state(), directory)

    def done(self) -> bool:
        self.checkpointer.poll()
        return self.checkpointer.pending is None


class MegatronSave:
    """``dist_checkpointing.save`` of model + optimizer + scalars, as Megatron-LM builds it."""

    def __init__(self, trainer, sharding: str, asynchronous: bool, constant_structure: bool = False) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.trainer, self.sharding, self.asynchronous = trainer, sharding, asynchronous
        self.reshards = FORMATS[sharding]
        self.queue = AsyncCallsQueue() if asynchronous else None
        # Megatron-LM's --ckpt-assume-constant-structure: plan once, validate once.
        self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True) if constant_structure else None
        self.validated = False

    def start(self, directory: Path) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        if dist.get_rank() == 0:
            directory.mkdir(parents=True)
        dist.barrier()
        model_sd = self.trainer.model[0].module.sharded_state_dict()
        optimizer_sd = self.trainer.optimizer.sharded_state_dict(
            model_sd, metadata={"distrib_optim_sharding_type": self.sharding})
        state = {"model": model_sd, "optimizer": optimizer_sd, "iteration": self.trainer.iteration,
                 "scheduler": self.trainer.scheduler.state_dict()}
        request = dist_checkpointing.save(state, str(directory), sharded_strategy=self.strategy,
                                          validate_access_integrity=not (self.strategy and self.validated),
                                          async_sharded_save=self.asynchronous)
        self.validated = True
        if self.asynchronous:
            self.queue.schedule_async_request(request)

    def done(self) -> bool:
        if self.queue is None:
            return True
        self.queue.maybe_finalize_async_calls(blocking=False)
        return self.queue.get_num_unfinalized_calls() == 0


def _step(trainer) -> float:
    started = time.perf_counter()
    trainer.train_step()
    trainer.iteration += 1
    trainer.consumed_samples += trainer.args.global_batch_size
    return time.perf_counter() - started


def worker(flags: list[str], out: Path, repeats: int) -> None:
    """One rank's part (under torchrun); rank 0 writes ``results.json``."""
    import torch
    import torch.distributed as dist

    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(MODEL + flags + ["--train-iters", "1000000"])
    with training_environment(args):
        trainer = Trainer(args)
        for _ in range(3):
            _step(trainer)
        methods = {"higgs sync": HiggsSync(trainer), "higgs async": HiggsAsync(trainer)}
        for sharding in FORMATS:
            methods[f"megatron sync {sharding}"] = MegatronSave(trainer, sharding, False)
            methods[f"megatron async {sharding}"] = MegatronSave(trainer, sharding, True)
        methods["megatron async dp_reshardable, constant structure"] = MegatronSave(
            trainer, "dp_reshardable", True, constant_structure=True)
        # Start-up costs (megatron-core's writer result queue is a spawned process) out of the way.
        methods["higgs sync"].start(out / "ckpt" / "warmup")
        baseline = statistics.median(_step(trainer) for _ in range(8))
        measured: dict[str, list[list[float]]] = {name: [] for name in methods}
        for repeat in range(repeats):
            for name, method in methods.items():
                dist.barrier()
                started = time.perf_counter()
                method.start(out / "ckpt" / f"{name.replace(' ', '_')}_{repeat}")
                stall = time.perf_counter() - started
                slowdown, steps = 0.0, 0
                while True:
                    # The completion check (and, when it finds the writers done, the finalization
                    # and commit) runs in the loop's time: it counts, as the steps' extra time does.
                    checked = time.perf_counter()
                    finished = method.done()
                    slowdown += time.perf_counter() - checked
                    if finished:
                        break
                    slowdown += _step(trainer) - baseline
                    steps += 1
                total = time.perf_counter() - started
                measured[name].append([stall, slowdown, total, steps])
                for _ in range(2):  # settle before the next save
                    _step(trainer)
        local = torch.tensor([[statistics.median(r[i] for r in runs) for i in range(4)]
                              for runs in measured.values()], dtype=torch.float64, device=collective_device())
        dist.all_reduce(local, op=dist.ReduceOp.MAX)  # the loop waits for its slowest rank
        if dist.get_rank() == 0:
            params = sum(p.numel() for p in trainer.model[0].parameters())
            results = {"baseline_step_s": baseline, "parameters": params, "world_size": dist.get_world_size(),
                       "methods": {name: dict(zip(("stall", "slowdown", "total", "steps"), row.tolist()),
                                              reshards=method.reshards)
                                   for (name, method), row in zip(methods.items(), local)}}
            (out / "results.json").write_text(json.dumps(results, indent=1))
        methods["higgs async"].checkpointer.close()


def table(results: dict) -> str:
    rows = {}
    methods = results["methods"]
    for name, m in methods.items():
        sync = methods[name.replace("async", "sync").replace(", constant structure", "")]
        cost = m["stall"] + max(0.0, m["slowdown"])
        rows[name] = {
            "reshards": m["reshards"],
            "stall (ms)": m["stall"] * 1000, "stall vs sync": f"{m['stall'] / sync['stall']:.3f}x",
            "overlapped steps": int(m["steps"]), "their slowdown (ms)": m["slowdown"] * 1000,
            "loop pays (ms)": cost * 1000, "loop pays vs sync": f"{cost / sync['stall']:.2f}x",
            "total to commit (ms)": m["total"] * 1000, "total vs sync": f"{m['total'] / sync['total']:.2f}x",
        }
    return markdown_table(rows, list(next(iter(rows.values())).keys()))


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results["methods"])
    stall = [results["methods"][n]["stall"] * 1000 for n in names]
    slowdown = [max(0.0, results["methods"][n]["slowdown"]) * 1000 for n in names]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.barh(names, stall, label="stall")
    ax.barh(names, slowdown, left=stall, label="slowdown of overlapped steps")
    ax.set_xlabel("ms the training loop pays per save")
    ax.invert_yaxis()
    ax.legend()
    ax.set_title(f"Checkpoint save, {results['parameters'] / 1e6:.1f}M-param GPT, DP={results['world_size']}, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "runs" / "checkpoint"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="more pretrain flags, after --")
    args = parser.parse_args()
    out = Path(args.out)
    if args.worker:
        worker(args.extra, out, args.repeats)
        return 0
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", "--out", str(out), "--repeats", str(args.repeats), "--", *args.extra]
    subprocess.run(command, check=True, cwd=REPO)
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    results = json.loads((out / "results.json").read_text())
    text = (f"{results['parameters'] / 1e6:.1f}M parameters, DP={results['world_size']}, distributed optimizer; "
            f"step without a save: {results['baseline_step_s'] * 1000:.0f} ms\n\n" + table(results))
    (out / "checkpoint.md").write_text(text + "\n")
    print(text)
    if plot(results, out / "checkpoint.png"):
        print(f"wrote {out / 'checkpoint.md'} and {out / 'checkpoint.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
