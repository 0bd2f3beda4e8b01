"""The README's main job: the same GPT trained on the default corpus, dense and with --use-higgs.

Runs ``examples/pretrain_gpt.py`` under torchrun twice (Megatron's own DDP, then
``--use-higgs`` at 1% density with error feedback, on ``benchmarks.higgs_flags``'s schedule:
dense for the first quarter, then Adam's second moment frozen and the density ramped down
to 1% over the next third), each writing ``--log-json`` into ``--out``, and prints one
side-by-side table from those files: final validation loss, tokens/s (and its ratio to
dense), bytes handed to collectives per step per rank at the end and over the whole run.

    python scripts/demo.py [--nproc 2] [--train-iters 300] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.benchmarks import REPO, higgs_flags, markdown_table, run_pretrain, summarize  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "runs" / "demo"))
    args = parser.parse_args()
    common = ["--train-iters", str(args.train_iters), "--log-interval", "20",
              "--eval-interval", str(max(1, args.train_iters // 4)), "--eval-iters", "10",
              "--overlap-grad-reduce", "--ddp-bucket-size", "250000"]
    configurations = {"megatron-ddp (dense)": [],
                      "higgs top-k 1% + error feedback": higgs_flags(0.01, args.train_iters)}
    rows = {}
    for i, (name, flags) in enumerate(configurations.items()):
        print(f"\n== {name}", flush=True)
        log = Path(args.out) / f"run{i}.jsonl"
        run_pretrain(common + flags, log, args.nproc)
        rows[name] = summarize(log)
    print()
    print(markdown_table(rows, ["iterations", "final validation loss", "tokens/s", "step time (ms)",
                                "wire bytes per step at the end", "wire over the run vs dense"],
                         baseline="megatron-ddp (dense)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
