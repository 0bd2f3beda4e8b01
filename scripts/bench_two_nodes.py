"""Nodes on one machine, each behind a shaped link: is --use-higgs faster than dense sync?

Run through ``scripts/bench_two_nodes.sh`` (root, iproute2). Each "node" is a network
namespace with one address on 10.231.0.0/24; its veth pair leads to a bridge in one more
namespace, the switch. ``tc`` shapes both directions of every node's link with a token
bucket (1 Gbit/s, 10 Gbit/s), as a NIC of that rate would, or leaves it unshaped. Each
configuration is one ``torchrun --nnodes N`` job per namespace (``GLOO_SOCKET_IFNAME`` on the
node's veth), on the default corpus, same model, per-rank batch and iterations:

* ``megatron-ddp``: Megatron's own DDP (the dense baseline);
* ``torch-ddp+fp16``: PyTorch DDP with its fp16 compression hook (``scripts/peer_torch_ddp.py``),
  the peer a user would pick instead;
* ``higgs``: ``--use-higgs`` and nothing else: the schedule it derives from the run (1-bit
  Adam: a dense int8 stage over the learning-rate warm-up of ``WARMUP`` iterations, every run's
  the same, then each rank's share of Adam's first moment as signs);
* the floor, once: the same model and per-rank batch on one rank, no gradient traffic.

Reported per node count, link and configuration: median step time, tokens/s, ratios
(tokens/s against Megatron DDP and the peer, step time against the floor, written like
``1.62x``), wire bytes per rank per step at the end of the run (what a ring puts on one
rank's link, at this number of ranks) and over the run against Megatron's dense reduction,
the sync share of the step (1 - floor / step: communication and compression the step waits
for), and validation loss at the end.

    sudo scripts/bench_two_nodes.sh [--quick] [--train-iters 40] [--bandwidths 1gbit 10gbit unshaped] [--nodes 2 4]
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron_bench.nodes import NodeLinks, bits_per_second, run_on_nodes  # noqa: E402
from higgs_megatron_bench.runs import REPO, run_pretrain, summarize  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--num-threads", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "1000000"]
# the learning-rate warm-up, as long as --use-higgs's dense stage, the shortest it derives 1-bit Adam for
WARMUP = 10
CONFIGURATIONS = {
    "megatron-ddp": ("pretrain", []),
    "torch-ddp+fp16": ("peer", ["--comm-hook", "fp16"]),
    "higgs": ("pretrain", ["--use-higgs"]),
}
SCRIPTS = {"pretrain": REPO / "examples" / "pretrain_gpt.py", "peer": REPO / "scripts" / "peer_torch_ddp.py"}


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def _log(out: Path, nodes: int, rate: str, index: int) -> Path:
    # two nodes keep the names the script wrote before it took --nodes
    return out / (f"{rate}-{index}.jsonl" if nodes == 2 else f"{nodes}n-{rate}-{index}.jsonl")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few-minute version: fewer iterations")
    parser.add_argument("--train-iters", type=int, default=None, help="iterations per run (default 40; --quick 24)")
    parser.add_argument("--bandwidths", nargs="+", default=["1gbit", "10gbit", "unshaped"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2], help="node counts to run (one namespace each)")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "runs" / "two_nodes"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; run nothing")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # unwind: the runs are killed, the namespaces removed
    for rate in args.bandwidths:
        if rate != "unshaped":
            bits_per_second(rate)
    iters = args.train_iters or (24 if args.quick else 40)
    if iters <= WARMUP:
        raise SystemExit(f"bench_two_nodes.py: --train-iters {iters}: past the learning-rate warm-up ({WARMUP}), "
                         "which --use-higgs sends dense, is where the runs differ")
    out = Path(args.out)
    common = MODEL + ["--train-iters", str(iters), "--lr-warmup-iters", str(WARMUP),
                      "--log-interval", str(max(1, iters // 4)),
                      "--eval-interval", str(iters), "--eval-iters", "4"]
    if not args.reuse:
        prefix = os.environ.get("HIGGS_BENCH_NS")
        if not prefix:
            raise SystemExit("bench_two_nodes.py: run it through scripts/bench_two_nodes.sh (root, namespaces)")
        run_pretrain(common + ["--global-batch-size", "4"], out / "floor.jsonl", nproc=1, quiet=True)
        for nodes in args.nodes:
            world = nodes * args.ranks_per_node
            with NodeLinks(prefix, nodes) as links:
                for rate in args.bandwidths:
                    links.shape(rate)
                    for i, (script, flags) in enumerate(CONFIGURATIONS.values()):
                        run_on_nodes(links, SCRIPTS[script], common + ["--global-batch-size", str(4 * world)] + flags,
                                     _log(out, nodes, rate, i), args.ranks_per_node, args.timeout)
    floor = summarize(out / "floor.jsonl")["step time (ms)"]
    rows = []
    for nodes in args.nodes:
        for rate in args.bandwidths:
            summaries = {name: summarize(_log(out, nodes, rate, i)) for i, name in enumerate(CONFIGURATIONS)}
            dense, peer = summaries["megatron-ddp"], summaries["torch-ddp+fp16"]
            for i, (name, row) in enumerate(summaries.items()):
                rows.append({
                    "nodes": nodes, "link": rate, "configuration": name, "step (ms)": f"{row['step time (ms)']:,.0f}",
                    "tokens/s": f"{row['tokens/s']:,.0f}",
                    "vs megatron-ddp": f"{row['tokens/s'] / dense['tokens/s']:.2f}x",
                    "vs torch-ddp+fp16": f"{row['tokens/s'] / peer['tokens/s']:.2f}x",
                    "step vs floor": f"{row['step time (ms)'] / floor:.2f}x",
                    "wire/step at the end": _megabytes(row["wire bytes per step at the end"]),
                    "wire over the run vs dense": _times(row["wire over the run vs dense"]),
                    "sync share": f"{max(0.0, 1 - floor / row['step time (ms)']):.0%}",
                    "valid loss": f"{row['final validation loss']:.4f} "
                                  f"({row['final validation loss'] / dense['final validation loss']:.3f}x)",
                    "_tokens": row["tokens/s"],
                })
    columns = [c for c in rows[0] if not c.startswith("_")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    floor_line = (f"floor: {floor:,.0f} ms/step (one rank, same model and per-rank batch, no gradient traffic); "
                  f"{iters} iterations per run, {args.ranks_per_node} rank(s) per node; wire bytes are per rank, "
                  f"at that run's number of ranks; model flags: {' '.join(MODEL)}")
    table = "\n".join(lines) + "\n\n" + floor_line + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "two_nodes.md").write_text(table)
    print(table)
    plot(rows, args.bandwidths, args.nodes, floor, out / "two_nodes.png", tokens_per_rank_step=4 * 128,
         ranks_per_node=args.ranks_per_node)
    return 0


def _megabytes(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / 1e6:.2f} MB"


def _times(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}x"


def plot(rows: list[dict], bandwidths: list[str], node_counts: list[int], floor_ms: float, path: Path,
         tokens_per_rank_step: int, ranks_per_node: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'higgs-megatron[bench]')")
        return
    fig, axes = plt.subplots(1, len(node_counts), figsize=(6 * len(node_counts), 4.5), squeeze=False)
    for ax, nodes in zip(axes[0], node_counts):
        for name in CONFIGURATIONS:
            ax.plot(bandwidths, [r["_tokens"] for r in rows if r["configuration"] == name and r["nodes"] == nodes],
                    marker="o", label=name)
        ranks = nodes * ranks_per_node
        ax.axhline(tokens_per_rank_step * ranks * 1000 / floor_ms, color="grey", linestyle="--",
                   label="floor x ranks (no traffic)")
        ax.set_xlabel("each node's link")
        ax.set_ylabel("tokens/s (whole job)")
        ax.set_title(f"{nodes} nodes on shaped veth links, CPU, gloo")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path.with_suffix('.md')} and {path}")


if __name__ == "__main__":
    sys.exit(main())
