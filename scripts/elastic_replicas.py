#!/usr/bin/env python3
"""Launch elastic data-parallel replicas on one host: a torchft Lighthouse, then one torchrun per
replica of the pretrain script, each restarted by its own torchrun when it dies.

    python scripts/elastic_replicas.py --replicas 3 --nproc-per-replica 1 --max-restarts 3 -- \\
        --use-higgs --train-iters 200 --save runs/elastic/ckpt --save-interval 50 --auto-resume \\
        --higgs-step-timeout 10 --log-json runs/elastic/replica-{replica}.jsonl

Everything after ``--`` goes to ``examples/pretrain_gpt.py`` (``{replica}`` in it becomes the
replica's index), with ``--higgs-replicas``, ``--higgs-replica-id`` and ``--higgs-lighthouse``
added. Each replica's output goes to ``--log-dir``/replica-D.log. The launcher exits when every
replica has, with the first non-zero status, and stops the Lighthouse. Across hosts, run one
Lighthouse and on each host this script's torchrun line for its replicas
(``scripts/slurm_elastic.sbatch``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("elastic_replicas")


def lighthouse_command(args: argparse.Namespace) -> list[str]:
    """torchft's own Lighthouse, next to this Python's torchft."""
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) \
        or shutil.which("torchft_lighthouse")
    if binary is None:
        raise SystemExit("torchft_lighthouse not found: pip install 'higgs-megatron[elastic]'")
    return [binary, "--bind", f"[::]:{args.lighthouse_port}", "--min_replicas", str(args.min_replicas),
            "--join_timeout_ms", str(int(args.join_timeout * 1000)),
            "--heartbeat_timeout_ms", str(int(args.heartbeat_timeout * 1000))]


def replica_command(args: argparse.Namespace, replica: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.nproc_per_replica}", f"--max-restarts={args.max_restarts}",
            str(REPO / "examples" / "pretrain_gpt.py"),
            *[flag.replace("{replica}", str(replica)) for flag in flags],
            "--higgs-replicas", str(args.replicas), "--higgs-replica-id", str(replica),
            "--higgs-lighthouse", f"http://localhost:{args.lighthouse_port}",
            *(["--higgs-min-replicas", str(args.min_replicas)] if args.min_replicas != 1 else [])]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, required=True, metavar="R")
    parser.add_argument("--nproc-per-replica", type=int, default=1, metavar="N",
                        help="ranks per replica: its TP x PP (default 1)")
    parser.add_argument("--max-restarts", type=int, default=3, help="per replica's torchrun (default 3)")
    parser.add_argument("--min-replicas", type=int, default=1, help="a step needs this many replicas (default 1)")
    parser.add_argument("--lighthouse-port", type=int, default=29510)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="a replica silent this long is left out of the next quorum (default 2)")
    parser.add_argument("--join-timeout", type=float, default=1.0, metavar="SECONDS",
                        help="how long a quorum waits for replicas that are alive but late (default 1)")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/elastic"))
    args = parser.parse_args(ours)
    if args.replicas < 1 or not 1 <= args.min_replicas <= args.replicas:
        parser.error(f"--replicas {args.replicas} --min-replicas {args.min_replicas}: expected 1 <= min <= replicas")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    # SIGTERM (a scheduler, a test's timeout) ends the launcher through ``finally``: its replicas go too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    lighthouse = subprocess.Popen(lighthouse_command(args), stdout=open(args.log_dir / "lighthouse.log", "w"),
                                  stderr=subprocess.STDOUT)
    replicas = []
    try:
        time.sleep(0.5)  # the Lighthouse binds its port
        if lighthouse.poll() is not None:
            raise SystemExit(f"the Lighthouse exited with status {lighthouse.returncode}: see "
                             f"{args.log_dir / 'lighthouse.log'}")
        for replica in range(args.replicas):
            output = open(args.log_dir / f"replica-{replica}.log", "w")
            log.info(f"replica {replica}: {args.log_dir / f'replica-{replica}.log'}")
            replicas.append(subprocess.Popen(replica_command(args, replica, flags), cwd=REPO, stdout=output,
                                             stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                             start_new_session=True))
        statuses = [replica.wait() for replica in replicas]
    finally:
        for replica in replicas:
            if replica.poll() is None:
                os.killpg(replica.pid, signal.SIGTERM)  # torchrun, which stops its ranks
        for replica in replicas:
            try:
                replica.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(replica.pid, signal.SIGKILL)
        lighthouse.terminate()
        lighthouse.wait()
    failed = [(replica, status) for replica, status in enumerate(statuses) if status != 0]
    for replica, status in failed:
        log.error(f"replica {replica} exited with status {status}: see {args.log_dir / f'replica-{replica}.log'}")
    return failed[0][1] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
