"""The README's main job: the same GPT trained on the default corpus, dense and with --use-higgs.

Runs ``examples/pretrain_gpt.py`` under torchrun twice: Megatron's own DDP, then ``--use-higgs``
with nothing else but the link it should assume (``--higgs-link-gbps``, default 0.1). On one
host the links measure fast, and 'auto' would rightly stay dense; and a CPU computes,
compresses and decodes about a hundred times slower than a GPU, so at 1 Gbit/s 'auto' finds
top-k costing more than it saves here and sends every step dense in int8. A tenth of a
Gbit/s keeps the balance of compute and link that a GPU sees at about 10 Gbit/s. The schedule is the one
``--use-higgs`` derives from the run (``higgs_megatron.schedule``: a quarter of the
coordinates in int4, a dense int8 stage as long as the learning-rate warm-up, a short ramp),
and the form the one 'auto' picks for this many ranks. Each run writes ``--log-json`` into
``--out``; one table compares them: final validation loss, tokens/s, wire bytes per rank per
step and over the run at this P against dense's, and the same run's wire bytes over the run
projected to P = 64 and 1,024 (counted on torch's fake process group, ``project_wire.py``:
the same model, schedule and 'auto' at that P).

    python scripts/demo.py [--nproc 2] [--train-iters 300] [--link-gbps 0.1] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from higgs_megatron_bench.runs import REPO, markdown_table, run_pretrain, summarize  # noqa: E402
from project_wire import projected_ratio  # noqa: E402

PROJECTED = (64, 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--link-gbps", type=float, default=0.1, help="the link --use-higgs assumes (Gbit/s)")
    parser.add_argument("--out", default=str(REPO / "runs" / "demo"))
    args = parser.parse_args()
    common = ["--train-iters", str(args.train_iters), "--log-interval", "20",
              "--eval-interval", str(max(1, args.train_iters // 4)), "--eval-iters", "10",
              "--overlap-grad-reduce", "--ddp-bucket-size", "250000"]
    configurations = {"megatron-ddp (dense)": [],
                      f"--use-higgs --higgs-link-gbps {args.link_gbps:g}": ["--use-higgs", "--higgs-link-gbps",
                                                                           f"{args.link_gbps:g}"]}
    rows = {}
    for i, (name, flags) in enumerate(configurations.items()):
        print(f"\n== {name}", flush=True)
        log = Path(args.out) / f"run{i}.jsonl"
        run_pretrain(common + flags, log, args.nproc)
        rows[name] = summarize(log)
    print()
    dense = next(iter(rows.values()))
    for (name, flags), row in zip(configurations.items(), rows.values()):
        row["loss vs dense"] = row["final validation loss"] / dense["final validation loss"]
        for size in PROJECTED:
            print(f"== {name}: wire bytes over the run at P={size:,} (fake process group)", flush=True)
            row[f"wire at P={size:,} vs dense"] = projected_ratio(size, common + flags) if flags else 1.0
    print(markdown_table(rows, ["iterations", "final validation loss", "loss vs dense", "tokens/s", "step time (ms)",
                                "wire bytes per step at the end", "wire over the run vs dense",
                                *(f"wire at P={size:,} vs dense" for size in PROJECTED)],
                         baseline="megatron-ddp (dense)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
