"""The README's main job: train a small GPT on the default corpus and print a summary table.

Runs ``examples/pretrain_gpt.py`` under torchrun once per configuration (for now Megatron's
own dense DDP), each writing ``--log-json`` into ``--out``, and prints one table from those
files: final validation loss, median tokens/s, median step time.

    python scripts/demo.py [--nproc 2] [--train-iters 300] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFIGURATIONS = {
    "megatron-ddp (dense)": ["--overlap-grad-reduce", "--ddp-bucket-size", "250000"],
}


def summarize(log_json: Path) -> dict:
    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    iterations = [r for r in records if r["type"] == "iteration"]
    validations = [r for r in records if r.get("event") == "validation"]
    return {
        "iterations": iterations[-1]["iteration"],
        "final train loss": iterations[-1]["lm_loss"],
        "final validation loss": validations[-1]["loss"],
        "tokens/s": statistics.median(r["tokens_per_second"] for r in iterations[1:] or iterations),
        "step time (ms)": statistics.median(r["elapsed_time_per_iteration_ms"] for r in iterations[1:] or iterations),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "runs" / "demo"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, flags in CONFIGURATIONS.items():
        log = out / (name.split()[0] + ".jsonl")
        log.unlink(missing_ok=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   str(REPO / "examples" / "pretrain_gpt.py"), "--train-iters", str(args.train_iters),
                   "--log-interval", "10", "--eval-interval", str(max(1, args.train_iters // 4)), "--eval-iters", "10",
                   "--log-json", str(log), *flags]
        print(f"== {name}: {' '.join(command[3:])}", flush=True)
        subprocess.run(command, check=True, cwd=REPO)
        rows[name] = summarize(log)
    columns = list(next(iter(rows.values())))
    print("\n| configuration | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        cells = [f"{v:.4f}" if "loss" in k else f"{v:,.0f}" if isinstance(v, float) else str(v) for k, v in row.items()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
