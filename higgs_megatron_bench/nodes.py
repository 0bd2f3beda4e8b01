"""Nodes on one machine, each a network namespace behind its own link to a bridge, the link
shaped with ``tc`` (``scripts/bench_two_nodes.py``, ``scripts/demo.py``). Needs root and
iproute2 (``ip``, ``tc``); only the private addresses of ``SUBNET`` are used, and leaving a
``NodeLinks`` block removes every namespace it made (and what runs in them)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .runs import REPO

SUBNET = "10.231.0"
PORT = 29731


def why_no_nodes() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "not root (network namespaces need it)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} (iproute2)" if missing else None


def sh(*command: str) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


class NodeLinks:
    """``nodes`` namespaces, each joined to a bridge in a switch namespace by its own veth pair;
    leaving the ``with`` block removes everything (killing what still runs in them)."""

    def __init__(self, prefix: str, nodes: int) -> None:
        if not 2 <= nodes <= 200:
            raise ValueError(f"--nodes: {nodes} is not between 2 and 200")
        self.switch = f"{prefix}s"
        self.namespaces = tuple(f"{prefix}n{i}" for i in range(nodes))
        self.interfaces = tuple(f"{prefix}-{i}" for i in range(nodes))  # the node's end of its link
        self.ports = tuple(f"{prefix}-p{i}" for i in range(nodes))  # the switch's end
        self.addresses = tuple(f"{SUBNET}.{i + 1}" for i in range(nodes))
        self.created: list[str] = []

    def __enter__(self) -> "NodeLinks":
        try:
            for ns in (self.switch, *self.namespaces):
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
            sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for ns, interface, port, address in zip(self.namespaces, self.interfaces, self.ports, self.addresses):
                sh("ip", "link", "add", interface, "netns", ns, "type", "veth", "peer", "name", port,
                   "netns", self.switch)
                sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                sh("ip", "-n", self.switch, "link", "set", port, "up")
                sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", interface)
                sh("ip", "-n", ns, "link", "set", interface, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, rate: str) -> None:
        """Token-bucket both directions of every node's link to ``rate`` (e.g. '1gbit'): the
        node's end shapes what it sends, the switch's end what it receives; 'unshaped' removes it."""
        ends = [(ns, interface) for ns, interface in zip(self.namespaces, self.interfaces)]
        ends += [(self.switch, port) for port in self.ports]
        for ns, interface in ends:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", interface, "root"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if rate != "unshaped":
                bits = bits_per_second(rate)
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


def bits_per_second(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"--bandwidths: {rate!r} is not like 1gbit, 500mbit or unshaped")


def run_on_nodes(links: NodeLinks, script: Path, flags: list[str], log_json: Path, ranks_per_node: int,
                 timeout: float) -> None:
    """One torchrun per namespace; all must succeed. The JSONL comes from the last rank."""
    log_json.parent.mkdir(parents=True, exist_ok=True)
    log_json.unlink(missing_ok=True)
    nodes = len(links.namespaces)
    print(f"$ torchrun --nnodes {nodes} --nproc_per_node {ranks_per_node} {script.relative_to(REPO)} "
          f"{' '.join(flags)}", flush=True)
    processes = []
    for node, (ns, interface) in enumerate(zip(links.namespaces, links.interfaces)):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface, OMP_NUM_THREADS="1")
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--node_rank", str(node), "--nproc_per_node", str(ranks_per_node), "--master_addr",
                   links.addresses[0], "--master_port", str(PORT), str(script), *flags, "--log-json", str(log_json)]
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


