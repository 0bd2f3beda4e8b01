"""The README's main job: the same GPT trained on the default corpus, dense and with --use-higgs.

Runs ``examples/pretrain_gpt.py`` twice, one rank per "node" over a real slow link where it
can: each node a network namespace behind its own link, shaped to ``--link`` (1 Gbit/s) with
``tc`` (``higgs_megatron_bench.nodes``; root and iproute2). Without them, or with ``--link
loopback``, the ranks talk over loopback, and one line says so. The runs: Megatron's own DDP,
then ``--use-higgs`` with nothing else, which derives its schedule from the run (``higgs_megatron.schedule``: 1-bit
Adam's exchange, after a dense int8 stage as long as the learning-rate warm-up). Each run writes
``--log-json`` into ``--out``; one table compares them: the time to the final loss, final
validation loss, tokens/s, wire bytes per rank per step and over the run at this P against dense's, and the same run's wire
bytes over the run projected to P = 64 and 1,024 (counted on torch's fake process group,
``project_wire.py``: the same model and schedule at that P). ``--link-gbps G`` runs the top-k
forms under 'auto' instead, told the link is G Gbit/s (the demo before 1-bit Adam was the default).

    python scripts/demo.py [--nproc 2] [--train-iters 300] [--link 1gbit | loopback] [--link-gbps G] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from higgs_megatron_bench.nodes import NodeLinks, bits_per_second, run_on_nodes, why_no_nodes  # noqa: E402
from higgs_megatron_bench.runs import REPO, markdown_table, run_pretrain, summarize  # noqa: E402
from project_wire import projected_ratio  # noqa: E402

PROJECTED = (64, 1024)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="the top-k forms under 'auto', told the link is this many Gbit/s (default: the derived "
                             "schedule, 1-bit Adam's exchange)")
    parser.add_argument("--link", default="1gbit",
                        help="the rate of each node's link (like 1gbit or 500mbit), or 'loopback'")
    parser.add_argument("--out", default=str(REPO / "runs" / "demo"))
    args = parser.parse_args()
    if args.link != "loopback":
        bits_per_second(args.link)  # a bad rate fails here, before any run
    why = "--link loopback" if args.link == "loopback" else why_no_nodes()
    if why:
        print(f"no slow link ({why}): the ranks talk over loopback", flush=True)
    else:
        print(f"{args.nproc} nodes, each behind a {args.link} link (network namespaces, tc)", flush=True)
        signal.signal(signal.SIGTERM, _interrupted)  # unwind: the namespaces are removed
    common = ["--train-iters", str(args.train_iters), "--log-interval", "20",
              "--eval-interval", str(max(1, args.train_iters // 4)), "--eval-iters", "10",
              "--overlap-grad-reduce", "--ddp-bucket-size", "250000"]
    higgs = ["--use-higgs"] + ([] if args.link_gbps is None else ["--higgs-link-gbps", f"{args.link_gbps:g}"])
    configurations = {"megatron-ddp (dense)": [], " ".join(higgs): higgs}
    rows = {}
    for i, (name, flags) in enumerate(configurations.items()):
        print(f"\n== {name}", flush=True)
        log = Path(args.out) / f"run{i}.jsonl"
        if why:
            run_pretrain(common + flags, log, args.nproc)
        else:
            with NodeLinks(f"hd{os.getpid()}", args.nproc) as links:
                links.shape(args.link)
                run_on_nodes(links, REPO / "examples" / "pretrain_gpt.py", common + flags, log, 1, timeout=1800)
        rows[name] = summarize(log)
    print()
    dense = next(iter(rows.values()))
    for (name, flags), row in zip(configurations.items(), rows.values()):
        row["loss vs dense"] = row["final validation loss"] / dense["final validation loss"]
        for size in PROJECTED:
            print(f"== {name}: wire bytes over the run at P={size:,} (fake process group)", flush=True)
            row[f"wire at P={size:,} vs dense"] = projected_ratio(size, common + flags) if flags else 1.0
    print(markdown_table(rows, ["iterations", "time to the final loss (s)", "final validation loss", "loss vs dense", "tokens/s", "step time (ms)",
                                "wire bytes per step at the end", "wire over the run vs dense",
                                *(f"wire at P={size:,} vs dense" for size in PROJECTED)],
                         baseline="megatron-ddp (dense)"))
    return 0


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
