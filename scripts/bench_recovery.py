"""Recovery benchmark: what each kind of fault costs, on dense and on compressed buckets.

One job per fault kind and bucket path, each a ``torchrun --max-restarts 1`` run of the
pretrain script (2 ranks, ``--save-interval``, ``--async-checkpoint``, ``--auto-resume``,
``--higgs-step-timeout``, ``--higgs-restart-timeout``), with one fault on rank 1 at iteration
``--at``:

* ``hang``: rank 1 sleeps ``--hang-seconds`` (past the step timeout) inside the step; the
  others give its sync up, every rank drops the step, rebuilds its data-parallel groups and
  runs the iteration again (a progress alignment);
* ``hard hang``: rank 1 stops for good (SIGSTOP); rank 0 waits ``--higgs-restart-timeout``
  for its vote and exits with status 75, torchrun kills the stopped rank (SIGTERM, then
  SIGKILL after its 30 s grace: a stopped process acts on nothing else) and restarts the job
  from its latest committed checkpoint;
* ``crash``: rank 1 exits; rank 0 sees the peer gone; torchrun restarts the job;
* ``sigterm``: rank 1 is sent SIGTERM under ``--exit-signal-handler``: every rank saves at the
  end of the iteration and exits with status 0; the benchmark then starts the job again at
  once, as a scheduler requeueing it would;
* ``straggler``: rank 1 sleeps past the step timeout on every attempt of the iteration; after
  ``--higgs-max-alignments-in-a-row`` (2 here) every rank exits with status 75 and torchrun
  restarts the job from its latest checkpoint;
* ``corrupt newest``: the job stops at ``--at`` (its last save there), one shard of that newest
  checkpoint is truncated, as a power loss before a durable commit would leave it, and the job
  is started again with ``--auto-resume``: the load falls back to the previous checkpoint
  (event ``checkpoint_fallback``); timed from the start of that load.

Replica rows (``--replica-kinds``): a lost data-parallel replica, in two modes each, on 2
replicas of 1 rank (dense buckets):

* ``replica kill``: ``kill-replica@1:AT``; ``replica hang``: ``stop-replica@1:AT:--stop-seconds``;
* ``restart``: one torchrun of 2 ranks, as without elastic replicas: the job restarts from its
  latest checkpoint (a hang past ``--higgs-restart-timeout`` too);
* ``keep going``: ``scripts/elastic_replicas.py``, 2 replicas and a torchft Lighthouse: the
  survivor drops the lost replica from the quorum and goes on; the lost one heals from it.

For each: the survivors' seconds lost (from the fault to the completion of the fault's
iteration, less a median step), the iterations they rolled back, the faulted replica's seconds
from the fault to training again (healed, or loaded), and the bytes that moved to bring it
back (the healed state, or the checkpoint read).

Per fault: seconds from the fault to the next iteration completed after the recovery (the
alignment, or the checkpoint load of the restarted job), what of it went to the
rebuild of the groups or the checkpoint load, and the iterations lost (completed before the
fault, redone after it). Everything comes from the runs' ``--log-json`` (fault, alignment,
load events and iteration timestamps). Writes ``recovery.md`` and, with matplotlib,
``recovery.png`` into ``--out``.

    python scripts/bench_recovery.py [--at 6] [--out runs/recovery] [--kinds ...] [--replica-kinds ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron_bench.ranks import run_elastic_replicas  # noqa: E402
from higgs_megatron_bench.runs import REPO  # noqa: E402
from higgs_megatron.logs import get_logger, setup_logging  # noqa: E402

log = get_logger("bench_recovery")

COMMON = ["--use-higgs", "--overlap-grad-reduce", "--ddp-bucket-size", "250000", "--log-interval", "1",
          "--eval-iters", "0", "--num-threads", "1"]
BUCKETS = {"dense": ["--higgs-sync", "dense"], "compressed": ["--higgs-sync", "sparse"]}
STRAGGLER_ALIGNMENTS = 2
FAULTS = {"hang": ["hang@1:{at}:{hang:g}"], "hard hang": ["freeze@1:{at}"], "crash": ["crash@1:{at}"],
          "sigterm": ["sigterm@1:{at}"], "straggler": ["hang@1:{at}:{hang:g}"] * STRAGGLER_ALIGNMENTS,
          "corrupt newest": []}
REPLICA_FAULTS = {"replica kill": "kill-replica@1:{at}", "replica hang": "stop-replica@1:{at}:{stop:g}"}
MODES = ("restart", "keep going")
RANK = 1  # the logging rank: its fault events reach the JSONL before it stops or dies


def torchrun(flags: list[str], log_dir: Path) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", str(REPO / "examples" / "pretrain_gpt.py"), *flags]
    log.info("$ torchrun --nproc_per_node 2 --max-restarts 1 examples/pretrain_gpt.py " + " ".join(flags))
    with open(log_dir / "stdout.txt", "a") as out, open(log_dir / "stderr.txt", "a") as err:
        return subprocess.run(command, cwd=REPO, stdout=out, stderr=err,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


def run(kind: str, buckets: str, args: argparse.Namespace, directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    flags = COMMON + BUCKETS[buckets] + [
        "--train-iters", str(2 * args.at), "--save", str(directory / "ckpt"), "--save-interval",
        str(args.save_interval), "--async-checkpoint", "--auto-resume", "--higgs-step-timeout", f"{args.step_timeout:g}",
        "--higgs-restart-timeout", f"{args.restart_timeout:g}", "--log-json", str(directory / "log.jsonl"),
        "--higgs-max-alignments-in-a-row", str(STRAGGLER_ALIGNMENTS)]
    for spec in FAULTS[kind]:
        flags += ["--inject-fault", spec.format(at=args.at, hang=args.hang_seconds)]
    if kind == "sigterm":
        flags.append("--exit-signal-handler")
    if kind == "corrupt newest":
        stopped = flags + ["--exit-interval", str(args.at)]  # its last save at --at
        status = torchrun(stopped, directory)
        newest = directory / "ckpt" / f"iter_{args.at:07d}"
        shard = newest / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    status = torchrun(flags, directory)
    if kind == "sigterm" and status == 0:
        status = torchrun(flags, directory)  # requeued: resumes from the checkpoint the exit saved
    if status != 0:
        raise SystemExit(f"{kind} on {buckets} buckets: the job failed (status {status}); see {directory}")


def measure(kind: str, buckets: str, log_json: Path) -> dict:
    rows = [json.loads(line) for line in log_json.read_text().splitlines()]
    if kind == "corrupt newest":  # from the start of the load that falls back
        index = next(i for i, r in enumerate(rows) if r.get("event") == "checkpoint_fallback")
        loaded = next(r for r in rows[index:] if r.get("event") == "checkpoint_loaded")
        fault = {"iteration": max(r["iteration"] for r in rows[:index] if r["type"] == "iteration"),
                 "time": loaded["time"] - loaded["seconds"]}
    else:
        index, fault = next((i, r) for i, r in enumerate(rows) if r.get("event") == "fault_injected")
    after = rows[index + 1:]
    restarted = any(r.get("event") == "restart_needed" for r in after)  # a straggler's alignments end in one
    aligned = None if restarted else next((r for r in after if r.get("event") == "progress_alignment"), None)
    loaded = next((r for r in after if r.get("event") in ("checkpoint_loaded", "checkpoint_not_found")), None)
    start = loaded.get("iteration", 0) if loaded else 0  # checkpoint_not_found: restarted with nothing committed
    recovered = aligned or loaded  # the next iteration is the first one completed after it
    first = next(r for r in rows[rows.index(recovered) + 1 if recovered else index + 1:] if r["type"] == "iteration")
    # A restart redoes what was completed after the checkpoint it loads; an alignment redoes nothing.
    completed = max((r["iteration"] for r in rows[:rows.index(loaded)] if r["type"] == "iteration"), default=0) \
        if loaded else 0
    if kind == "corrupt newest":
        completed = fault["iteration"]
    return {
        "fault": kind, "buckets": buckets, "iteration": fault["iteration"],
        "seconds to next iteration": first["time"] - fault["time"],
        "rebuild or load (s)": aligned["regroup_seconds"] if aligned else loaded.get("seconds", 0.0) if loaded else 0.0,
        "iterations lost": completed - start if loaded else 0,
        "how": "alignment" if aligned else f"fallback to iteration {start}" if kind == "corrupt newest" else (
            f"restart from iteration {start}" if start else "restart from scratch") if loaded else "-",
    }


def run_replica(kind: str, mode: str, args: argparse.Namespace, directory: Path) -> None:
    """One replica row's job (see the module docstring)."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    flags = COMMON + BUCKETS["dense"] + [
        "--train-iters", str(args.replica_iters), "--save", str(directory / "ckpt"), "--save-interval",
        str(args.save_interval), "--auto-resume", "--higgs-step-timeout", f"{args.step_timeout:g}",
        "--inject-fault", REPLICA_FAULTS[kind].format(at=args.at, stop=args.stop_seconds)]
    if mode == "restart":
        status = torchrun(flags + ["--higgs-restart-timeout", f"{args.restart_timeout:g}",
                                   "--log-json", str(directory / "log.jsonl")], directory)
    else:
        status = run_elastic_replicas(flags + ["--log-json", str(directory / "replica-{replica}.jsonl")], 2,
                                      directory / "logs", timeout=1800).returncode
    if status != 0:
        raise SystemExit(f"{kind}, {mode}: the job failed (status {status}); see {directory}")


def measure_replica(kind: str, mode: str, at: int, directory: Path) -> dict:
    """The replica row's figures, from the job's log (restart) or the survivor's and the faulted
    replica's (keep going)."""
    def rows_of(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    survivor = rows_of(directory / ("log.jsonl" if mode == "restart" else "replica-0.jsonl"))
    faulted = survivor if mode == "restart" else rows_of(directory / "replica-1.jsonl")
    fault = next(r for r in faulted if r.get("event") == "fault_injected")
    iterations = [r for r in survivor if r["type"] == "iteration"]
    step = statistics.median(r["elapsed_time_per_iteration_ms"] / 1000 for r in iterations)
    done = next(r for r in iterations if r["iteration"] == at and r["time"] > fault["time"])
    before = max(r["iteration"] for r in iterations if r["time"] < fault["time"])
    after = [r for r in faulted if r["time"] > fault["time"]]
    loaded = next((r for r in survivor if r.get("event") == "checkpoint_loaded" and r["time"] > fault["time"]), None)
    healed = next((r for r in after if r.get("event") == "replica_healed"), None)
    read = next((r for r in after if r.get("event") == "checkpoint_loaded"), None)  # a restart's --auto-resume
    back = healed or read
    sizes = {r["iteration"]: r["bytes"] for r in survivor if r.get("event") == "checkpoint_committed"}
    moved = (healed["bytes"] if healed else 0) + (sizes.get(read["iteration"], 0) if read else 0)
    return {
        "fault": kind, "mode": mode,
        "survivors' seconds lost": done["time"] - fault["time"] - step,
        "iterations rolled back": before - loaded["iteration"] if loaded else 0,
        "seconds to bring the replica back": back["time"] - fault["time"] if back else float("nan"),
        "MB moved to bring it back": moved / 1e6,
        "how": (f"healed from a live peer (step {healed['from_step']} -> {healed['to_step']})"
                + (f" after loading iteration {read['iteration']}" if read else "") if healed else
                f"every rank restarted from iteration {loaded['iteration']}" if loaded else "alignment, no restart"),
    }


def table(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c])
                                        for c in columns) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no recovery.png")
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['fault']}\n{r['buckets']}" for r in rows]
    ax.bar(labels, [r["seconds to next iteration"] for r in rows], color="tab:blue")
    ax.set_ylabel("seconds from fault to next iteration")
    ax.set_title("What a fault costs (2 ranks, CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    setup_logging()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at", type=int, default=6, help="the fault's iteration (each run trains twice as many)")
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--hang-seconds", type=float, default=6.0)
    parser.add_argument("--step-timeout", type=float, default=2.0)
    parser.add_argument("--restart-timeout", type=float, default=10.0,
                        help="longer than --hang-seconds: a hang that long is a stuck rank")
    parser.add_argument("--kinds", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--replica-kinds", default=",".join(REPLICA_FAULTS),
                        help=f"comma-separated, of: {', '.join(REPLICA_FAULTS)} (empty: none)")
    parser.add_argument("--stop-seconds", type=float, default=20.0, help="a replica hang's length")
    parser.add_argument("--replica-iters", type=int, default=120,
                        help="each replica row's run: long enough for the survivor to outlast the hang")
    parser.add_argument("--out", default=str(REPO / "runs" / "recovery"))
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    def chosen(flag: str, value: str, known: dict) -> list[str]:
        kinds = [kind.strip() for kind in value.split(",") if kind.strip()]
        unknown = [kind for kind in kinds if kind not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; expected some of {', '.join(known)}")
        return kinds

    def rows_of(kinds: list[str], variants, run_one, measure_one) -> list[dict]:
        """Each kind under each variant: run (unless --reuse) into its directory, then measured."""
        rows = []
        for kind in kinds:
            for variant in variants:
                directory = out / f"{kind}-{variant}".replace(" ", "_")
                if not args.reuse:
                    run_one(kind, variant, args, directory)
                rows.append(measure_one(kind, variant, directory))
        return rows

    rows = rows_of(chosen("--kinds", args.kinds, FAULTS), BUCKETS, run,
                   lambda kind, buckets, directory: measure(kind, buckets, directory / "log.jsonl"))
    replica_rows = rows_of(chosen("--replica-kinds", args.replica_kinds, REPLICA_FAULTS), MODES, run_replica,
                           lambda kind, mode, directory: measure_replica(kind, mode, args.at, directory))
    text = ""
    if rows:
        text += (table(rows) + "\n\n"
                 f"2 ranks, default model, --higgs-step-timeout {args.step_timeout:g}, --higgs-restart-timeout "
                 f"{args.restart_timeout:g}, hang {args.hang_seconds:g}s, --save-interval {args.save_interval} "
                 "--async-checkpoint; anchor: torchft rebuilds a gloo group in under a second and loses only the "
                 "failed step\n\n")
    if replica_rows:
        text += (table(replica_rows) + "\n\n"
                 f"2 replicas of 1 rank, default model, dense, --higgs-step-timeout {args.step_timeout:g}, "
                 f"--higgs-restart-timeout {args.restart_timeout:g}, replica hang {args.stop_seconds:g}s, "
                 f"--save-interval {args.save_interval}, {args.replica_iters} iterations; keep going: "
                 "scripts/elastic_replicas.py (torchft Lighthouse, 2 s heartbeat timeout)\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.md").write_text(text)
    if rows:
        plot(rows, out / "recovery.png")
    log.info(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
