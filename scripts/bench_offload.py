"""What on-demand optimizer-state offload costs a training step, every mode in one run.

The same training job (GPT, DP=2 on CPU, Adam) runs with:

* ``no offload``: the manager off (the baseline);
* ``forced full offload``: a schedule that reads 100% every step, so all optimizer state is
  away from the second step on, to host memory (``cpu``) or to files (``nvme``);
* ``on demand, threshold T``: the manager replays one pressure trace (quiet at 55% of device
  memory, three steps in ten at 95%, as bursts of long sequences would) at several
  thresholds, hysteresis 0.05.

Reported per mode: the median step time and its ratio to no offload, the share of steps that
ran with state away, how often state moved, and the state that stayed resident while away.
On this machine the "device" is host memory, so the ``cpu`` tier measures the copies alone,
and ``nvme`` the files (written, fsynced, read back). Writes ``offload.md``, ``offload.png``.

    python scripts/bench_offload.py [--iters 40] [--out runs/offload] [-- extra pretrain flags]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron_bench.runs import read_log, run_pretrain  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--eval-iters", "0", "--log-interval", "1"]
TRACE = ",".join(["0.55x7", "0.95x3"] * 20)


def modes(out: Path) -> dict[str, list[str]]:
    nvme = ["--higgs-offload-device", "nvme", "--higgs-offload-dir", str(out / "nvme")]
    found = {"no offload": [],
             "forced full offload, cpu": ["--higgs-offload", "--higgs-offload-schedule", "1.0"],
             "forced full offload, nvme": ["--higgs-offload", "--higgs-offload-schedule", "1.0", *nvme]}
    for threshold in ("0.6", "0.75", "0.9"):
        found[f"on demand {threshold}, cpu"] = ["--higgs-offload", "--higgs-offload-threshold", threshold,
                                                "--higgs-offload-schedule", TRACE]
    found["on demand 0.75, nvme"] = [*found["on demand 0.75, cpu"], *nvme]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/offload"))
    parser.add_argument("extra", nargs="*", help="more pretrain flags (after --)")
    args = parser.parse_args()
    rows = {}
    for name, flags in modes(args.out).items():
        log = args.out / (name.replace(" ", "_").replace(",", "") + ".jsonl")
        run_pretrain([*MODEL, "--train-iters", str(args.iters), *flags, *args.extra], log, args.nproc, quiet=True)
        iterations, events = read_log(log)
        moves = [e for e in events if e["event"].startswith("optimizer_state_")]
        away_steps, state_away = 0, False
        moved_at = {e["iteration"]: e["event"] for e in moves}
        for record in iterations:
            if record["iteration"] in moved_at:
                state_away = moved_at[record["iteration"]] == "optimizer_state_offloaded" or state_away and \
                    moved_at[record["iteration"]] != "optimizer_state_reloaded"
            away_steps += state_away
        steady = [r["elapsed_time_per_iteration_ms"] for r in iterations[2:]]
        offloaded = [e for e in moves if e["event"] == "optimizer_state_offloaded"]
        rows[name] = {"step (ms)": statistics.median(steady), "away": away_steps / len(iterations),
                      "moves": len(moves),
                      "state MB": max((e["state_bytes"] for e in moves), default=0) / 1e6,
                      "resident while away MB": min((e["resident_bytes"] for e in offloaded), default=0) / 1e6}
        print(f"{name}: {rows[name]}", flush=True)
    base = rows["no offload"]["step (ms)"]
    lines = ["| mode | step time (ms) | vs no offload | steps with state away | moves | optimizer state (MB, rank 0) "
             "| resident while away (MB) |", "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['step (ms)']:.1f} | {row['step (ms)'] / base:.2f}x | {row['away']:.0%} | "
                     f"{row['moves']} | {row['state MB']:.1f} | {row['resident while away MB']:.1f} |")
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offload.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(list(rows), [row["step (ms)"] / base for row in rows.values()])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("step time vs no offload")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(args.out / "offload.png", dpi=120)
    except ImportError:
        print("(matplotlib not installed: no offload.png)")


if __name__ == "__main__":
    main()
