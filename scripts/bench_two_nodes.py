"""Two-node benchmark on one machine: is --use-higgs faster than dense sync on a slow link?

Run through ``scripts/bench_two_nodes.sh`` (root, iproute2). Two network namespaces, "node
a" (10.231.0.1) and "node b" (10.231.0.2), are joined by a veth pair; ``tc`` shapes both
directions with a token bucket (1 Gbit/s, 10 Gbit/s) or leaves it unshaped. Each
configuration is one ``torchrun --nnodes 2`` job per namespace (``GLOO_SOCKET_IFNAME`` on the
veth), on the default corpus, same model, per-rank batch and iterations:

* ``megatron-ddp``: Megatron's own DDP (the dense baseline);
* ``torch-ddp+fp16``: PyTorch DDP with its fp16 compression hook (``scripts/peer_torch_ddp.py``),
  the peer a user would pick instead;
* ``higgs 1% auto`` and ``higgs 0.1% auto``: ``--use-higgs --higgs-sync auto`` (the cost
  model measures the link at start-up and picks the path per bucket; its choices are
  reported), with the sampled-threshold selector (on CPU the exact top-k alone costs a
  third of the floor's step);
* the floor, once: the same model and per-rank batch on one rank, no gradient traffic.

Reported per link and configuration: median step time, tokens/s, ratios (tokens/s against
Megatron DDP and the peer, step time against the floor, written like ``1.62x``), bytes
handed to collectives per step, the sync share of the step (1 - floor / step: communication
and compression the step waits for), validation loss at the end, and what ``auto`` chose.

    sudo scripts/bench_two_nodes.sh [--quick] [--train-iters 40] [--bandwidths 1gbit 10gbit unshaped]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.benchmarks import REPO, read_log, run_pretrain, summarize  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--num-threads", "1", "--overlap-grad-reduce", "--ddp-bucket-size", "1000000"]
SUBNET = "10.231.0"
PORT = 29731
CONFIGURATIONS = {
    "megatron-ddp": ("pretrain", []),
    "torch-ddp+fp16": ("peer", ["--comm-hook", "fp16"]),
    "higgs 1% auto": ("pretrain", ["--use-higgs", "--higgs-compression-ratio", "0.01", "--higgs-sync", "auto",
                                   "--higgs-compressor", "sampled-topk"]),
    "higgs 0.1% auto": ("pretrain", ["--use-higgs", "--higgs-compression-ratio", "0.001", "--higgs-sync", "auto",
                                     "--higgs-compressor", "sampled-topk"]),
}
SCRIPTS = {"pretrain": REPO / "examples" / "pretrain_gpt.py", "peer": REPO / "scripts" / "peer_torch_ddp.py"}


def sh(*command: str) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


class TwoNodeLink:
    """Two namespaces and the veth pair between them; ``close`` removes everything."""

    def __init__(self, prefix: str) -> None:
        self.namespaces = (f"{prefix}a", f"{prefix}b")
        self.interfaces = (f"{prefix}-a", f"{prefix}-b")
        self.addresses = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.created: list[str] = []

    def __enter__(self) -> "TwoNodeLink":
        for ns in self.namespaces:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
        a, b = self.interfaces
        sh("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth", "peer", "name", b,
           "netns", self.namespaces[1])
        for ns, interface, address in zip(self.namespaces, self.interfaces, self.addresses):
            sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", interface)
            sh("ip", "-n", ns, "link", "set", interface, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        return self

    def shape(self, rate: str) -> None:
        """Token-bucket both directions to ``rate`` (e.g. '1gbit'), or remove it ('unshaped')."""
        for ns, interface in zip(self.namespaces, self.interfaces):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", interface, "root"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if rate != "unshaped":
                bits = _bits_per_second(rate)
                burst = max(64 * 1024, int(bits / 8 / 100))  # 10 ms at the rate
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", interface, "root", "tbf", "rate", rate,
                   "burst", str(burst), "latency", "100ms")

    def __exit__(self, *exc) -> None:
        for ns in self.created:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        self.created.clear()


def _bits_per_second(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"--bandwidths: {rate!r} is not like 1gbit, 500mbit or unshaped")


def run_two_nodes(link: TwoNodeLink, script: Path, flags: list[str], log_json: Path, ranks_per_node: int,
                  timeout: float) -> None:
    """One torchrun per namespace; both must succeed. The JSONL comes from the last rank (node b)."""
    log_json.parent.mkdir(parents=True, exist_ok=True)
    log_json.unlink(missing_ok=True)
    print(f"$ torchrun --nnodes 2 --nproc_per_node {ranks_per_node} {script.relative_to(REPO)} {' '.join(flags)}",
          flush=True)
    processes = []
    for node, (ns, interface) in enumerate(zip(link.namespaces, link.interfaces)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, OMP_NUM_THREADS="1")
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node_rank", str(node), "--nproc_per_node", str(ranks_per_node), "--master_addr",
                   link.addresses[0], "--master_port", str(PORT), str(script), *flags, "--log-json", str(log_json)]
        processes.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    failed = [p for p in processes if p.returncode != 0]
    if failed:
        raise RuntimeError(f"a node failed (exit {failed[0].returncode}):\n{failed[0].stderr.read()[-3000:]}")


def auto_choice(log_json: Path) -> str:
    """What --higgs-sync auto chose, from its start-up event: '13 sparse' or '12 dense, 1 sparse'."""
    _, events = read_log(log_json)
    plans = [e for e in events if e["event"] == "higgs_sync_plan"]
    if not plans:
        return "-"
    counts: dict[str, int] = {}
    for bucket in plans[0]["buckets"]:
        counts[bucket["path"]] = counts.get(bucket["path"], 0) + 1
    link = plans[0]["costs"]
    gbps = 8e-9 / link["dense"]["seconds_per_byte"] if link["dense"]["seconds_per_byte"] else float("inf")
    return ", ".join(f"{n} {path}" for path, n in counts.items()) + f" (measured {gbps:.2f} Gbit/s)"


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few-minute version: fewer iterations")
    parser.add_argument("--train-iters", type=int, default=None, help="iterations per run (default 40; --quick 12)")
    parser.add_argument("--bandwidths", nargs="+", default=["1gbit", "10gbit", "unshaped"])
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "runs" / "two_nodes"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; run nothing")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # unwind: the runs are killed, the namespaces removed
    for rate in args.bandwidths:
        if rate != "unshaped":
            _bits_per_second(rate)
    iters = args.train_iters or (12 if args.quick else 40)
    out = Path(args.out)
    world = 2 * args.ranks_per_node
    common = MODEL + ["--train-iters", str(iters), "--log-interval", str(max(1, iters // 4)),
                      "--eval-interval", str(iters), "--eval-iters", "4", "--global-batch-size", str(4 * world)]
    if not args.reuse:
        prefix = os.environ.get("HIGGS_BENCH_NS")
        if not prefix:
            raise SystemExit("bench_two_nodes.py: run it through scripts/bench_two_nodes.sh (root, namespaces)")
        run_pretrain(MODEL + ["--train-iters", str(iters), "--log-interval", str(max(1, iters // 4)),
                              "--eval-interval", str(iters), "--eval-iters", "4", "--global-batch-size", "4"],
                     out / "floor.jsonl", nproc=1, quiet=True)
        with TwoNodeLink(prefix) as link:
            for rate in args.bandwidths:
                link.shape(rate)
                for i, (name, (script, flags)) in enumerate(CONFIGURATIONS.items()):
                    run_two_nodes(link, SCRIPTS[script], common + flags, out / f"{rate}-{i}.jsonl",
                                  args.ranks_per_node, args.timeout)
    floor = summarize(out / "floor.jsonl")["step time (ms)"]
    rows = []
    for rate in args.bandwidths:
        summaries = {name: summarize(out / f"{rate}-{i}.jsonl") for i, name in enumerate(CONFIGURATIONS)}
        dense_loss = summaries["megatron-ddp"]["final validation loss"]
        for i, (name, row) in enumerate(summaries.items()):
            rows.append({
                "link": rate, "configuration": name, "step (ms)": f"{row['step time (ms)']:,.0f}",
                "tokens/s": f"{row['tokens/s']:,.0f}",
                "vs megatron-ddp": f"{row['tokens/s'] / summaries['megatron-ddp']['tokens/s']:.2f}x",
                "vs torch-ddp+fp16": f"{row['tokens/s'] / summaries['torch-ddp+fp16']['tokens/s']:.2f}x",
                "step vs floor": f"{row['step time (ms)'] / floor:.2f}x",
                "bytes sent/step": f"{row['bytes sent per step'] / 1e6:.2f} MB",
                "sync share": f"{max(0.0, 1 - floor / row['step time (ms)']):.0%}",
                "valid loss": f"{row['final validation loss']:.4f} ({row['final validation loss'] / dense_loss:.3f}x)",
                "auto chose": auto_choice(out / f"{rate}-{i}.jsonl") if "auto" in name else "-",
                "_tokens": row["tokens/s"],
            })
    columns = [c for c in rows[0] if not c.startswith("_")]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    floor_line = (f"floor: {floor:,.0f} ms/step (one rank, same model and per-rank batch, no gradient traffic); "
                  f"{iters} iterations per run, {world} ranks as 2 nodes, model flags: {' '.join(MODEL)}")
    table = "\n".join(lines) + "\n\n" + floor_line + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "two_nodes.md").write_text(table)
    print(table)
    plot(rows, args.bandwidths, floor, out / "two_nodes.png", tokens_per_step=4 * 128 * world)
    return 0


def plot(rows: list[dict], bandwidths: list[str], floor_ms: float, path: Path, tokens_per_step: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'higgs-megatron[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in CONFIGURATIONS:
        ax.plot(bandwidths, [r["_tokens"] for r in rows if r["configuration"] == name], marker="o", label=name)
    ax.axhline(tokens_per_step * 1000 / floor_ms, color="grey", linestyle="--", label="floor x ranks (no traffic)")
    ax.set_xlabel("link between the two nodes")
    ax.set_ylabel("tokens/s (whole job)")
    ax.set_title("two nodes on a shaped veth link, CPU, gloo")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path.with_suffix('.md')} and {path}")


if __name__ == "__main__":
    sys.exit(main())
