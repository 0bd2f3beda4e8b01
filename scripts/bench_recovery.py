"""Recovery benchmark: five injected crashes in one run, and five injected hangs in another.

Crashes: ``torchrun --max-restarts N`` runs the pretrain script with ``--async-checkpoint``,
``--save-interval``, ``--auto-resume`` and ``--inject-fault crash@R:I`` at N iterations; each
crash kills rank R, torchrun restarts the job, which resumes from the latest committed
checkpoint. Per crash: seconds from the crash to the first iteration completed after it,
and the iterations lost (completed before the crash, redone after it).

Hangs: one run with ``--higgs-step-timeout`` and ``--inject-fault hang@R:I:S``; each hang is
absorbed by a progress alignment. Per hang: seconds from the stall to the next completed
iteration, the time the alignment reports lost, and the iterations lost (none: the step is
redone).

All numbers come from the run's ``--log-json`` (fault, load and alignment events, iteration
timestamps). Writes ``recovery.md`` into ``--out``.

    python scripts/bench_recovery.py [--faults 5] [--every 10] [--out runs/recovery]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.benchmarks import REPO  # noqa: E402

COMMON = ["--use-higgs", "--higgs-sync", "sparse", "--overlap-grad-reduce", "--ddp-bucket-size", "250000",
          "--log-interval", "1", "--eval-iters", "0", "--num-threads", "1"]
RANK = 1  # the logging rank: its fault events reach the JSONL before it dies


def torchrun(flags: list[str], log_dir: Path, restarts: int) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--max-restarts={restarts}", str(REPO / "examples" / "pretrain_gpt.py"), *flags]
    print("$ torchrun --nproc_per_node 2 --max-restarts", restarts, "examples/pretrain_gpt.py", " ".join(flags),
          flush=True)
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        subprocess.run(command, check=True, cwd=REPO, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def after(rows: list[dict], index: int) -> dict:
    """The first iteration record after position ``index``."""
    return next(r for r in rows[index + 1:] if r["type"] == "iteration")


def crash_rows(rows: list[dict]) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if row["type"] == "event" and row["event"] == "fault_injected" and row["kind"] == "crash":
            loaded = next(r for r in rows[index + 1:] if r["type"] == "event" and r["event"] == "checkpoint_loaded")
            first = after(rows, index)
            out.append({"kind": "crash", "iteration": row["iteration"],
                        "seconds to next iteration": first["time"] - row["time"],
                        "resumed from": loaded["iteration"],
                        "iterations lost": row["iteration"] - 1 - loaded["iteration"]})
    return out


def hang_rows(rows: list[dict]) -> list[dict]:
    out = []
    for index, row in enumerate(rows):
        if row["type"] == "event" and row["event"] == "fault_injected" and row["kind"] == "hang":
            aligned = next(r for r in rows[index + 1:] if r["type"] == "event" and r["event"] == "progress_alignment")
            first = after(rows, index)
            out.append({"kind": "hang", "iteration": row["iteration"],
                        "seconds to next iteration": first["time"] - row["time"],
                        "alignment reports lost (s)": aligned["seconds_lost"], "iterations lost": 0})
    return out


def table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[c]:.1f}" if isinstance(row.get(c), float) else str(row.get(c, "-"))
                                        for c in columns) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="iterations between faults")
    parser.add_argument("--save-interval", type=int, default=4)
    parser.add_argument("--hang-seconds", type=float, default=6.0)
    parser.add_argument("--step-timeout", type=float, default=2.0)
    parser.add_argument("--out", default=str(REPO / "runs" / "recovery"))
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    iters = args.every * (args.faults + 1)
    at = [args.every * (i + 1) for i in range(args.faults)]
    crash_dir, hang_dir = out / "crash", out / "hang"
    if not args.reuse:
        for directory in (crash_dir, hang_dir):
            subprocess.run(["rm", "-rf", str(directory)], check=True)
            directory.mkdir(parents=True)
        torchrun(COMMON + ["--train-iters", str(iters), "--save", str(crash_dir / "ckpt"), "--save-interval",
                           str(args.save_interval), "--async-checkpoint", "--auto-resume",
                           "--log-json", str(crash_dir / "log.jsonl")]
                 + [flag for i in at for flag in ("--inject-fault", f"crash@{RANK}:{i}")], crash_dir, args.faults)
        torchrun(COMMON + ["--train-iters", str(iters), "--higgs-step-timeout", str(args.step_timeout),
                           "--log-json", str(hang_dir / "log.jsonl")]
                 + [flag for i in at for flag in ("--inject-fault", f"hang@{RANK}:{i}:{args.hang_seconds:g}")],
                 hang_dir, 0)
    crashes, hangs = crash_rows(records(crash_dir / "log.jsonl")), hang_rows(records(hang_dir / "log.jsonl"))
    summary = (f"crashes: median {statistics.median(r['seconds to next iteration'] for r in crashes):.1f}s to the next "
               f"iteration, {sum(r['iterations lost'] for r in crashes)} iterations lost in all "
               f"(--save-interval {args.save_interval}, --async-checkpoint); hangs of {args.hang_seconds:g}s under "
               f"--higgs-step-timeout {args.step_timeout:g}: median "
               f"{statistics.median(r['seconds to next iteration'] for r in hangs):.1f}s to the next iteration, "
               "no iteration lost")
    text = table(crashes) + "\n\n" + table(hangs) + "\n\n" + summary + "\n"
    (out / "recovery.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
