"""Run a function on N gloo ranks in fresh processes: the harness behind the multi-process tests.

    results = run_ranks(train_fn, world_size=4, args=(argv,), timeout=300)

Each rank is a new process forked from a ``forkserver`` that imported torch, megatron-core and
this package once (``PRELOAD``): a rank starts in a fraction of a second instead of paying those
imports, seconds each, again. The forkserver never runs a rank's code, so every rank starts
from a clean interpreter state, as under ``spawn``. Each rank is given the environment torchrun would give it
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` on a free loopback port), and calls ``fn(*args)``; its return value comes
back pickled, one per rank, in rank order. When a rank raises, the others are killed and
``RankFailure`` carries that rank's traceback; when the job outlives ``timeout``, every
rank is killed and ``RankFailure`` names the ranks that had not finished. ``fn`` must be
importable by name (a module-level function). ``env`` reaches a rank before ``fn`` runs, but
after the preloaded imports: a variable those imports read belongs in the parent's environment.
The rest of a rank's environment is the parent's at the ``run_ranks`` call, as under ``spawn``
(the forkserver's own, from when it started, is replaced).

``run_pretrain_script`` runs ``examples/pretrain_gpt.py`` under torchrun instead, for tests
that check what a user sees (exit status, log lines, the JSONL file).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import pickle
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PRETRAIN_SCRIPT = REPO_ROOT / "examples" / "pretrain_gpt.py"


# Imported once in the forkserver; a module missing here is simply not preloaded.
PRELOAD = ["torch", "torch._dynamo", "megatron.core", "higgs_megatron.training.loop"]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: the first run_ranks
    return ctx


class RankFailure(AssertionError):
    """A rank raised, died, or did not finish in time; the message holds its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], args: tuple, env: dict[str, str], queue: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        # Plain pickle, not the queue's ForkingPickler: that would pass tensors through shared
        # memory handles that die with this process.
        queue.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return their results by rank."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", **(env or {}),
        }
        # Not daemonic: ranks may start processes of their own (the checkpoint writer does).
        proc = ctx.Process(target=_rank_main, args=(fn, args, rank_env, queue), daemon=False)
        proc.start()
        procs.append(proc)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in results]
                if dead:
                    raise RankFailure(f"rank(s) {dead} died with exit code(s) "
                                      f"{[procs[r].exitcode for r in dead]} before reporting")
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankFailure(f"timed out after {timeout:.0f}s; rank(s) {missing} had not finished")
                continue
            if not ok:
                raise RankFailure(_failures(queue, {rank: value}))
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(results) == world_size else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]


def _failures(queue, failed: dict[int, str], grace: float = 3.0) -> str:
    """Every rank's failure that arrives within ``grace`` seconds, the rank that failed on its
    own first (the others typically report only that a peer closed the connection)."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            rank, ok, value = queue.get(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:  # queue.Empty
            break
        if not ok:
            failed[rank] = value
    secondary = ("Connection closed by peer", "Connection reset by peer")
    order = sorted(failed, key=lambda r: (any(s in failed[r] for s in secondary), r))
    return "\n".join(f"rank {r} failed:\n{failed[r]}" for r in order)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux's /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(child) for child in (task / "children").read_text().split()]
    return [found for child in children for found in (child, *_descendants(child))]


def run_pretrain_script(argv: Sequence[str], nproc: int, timeout: float = 300.0,
                        env: dict[str, str] | None = None,
                        script: Path = PRETRAIN_SCRIPT,
                        extra_launcher_args: Sequence[str] = (),
                        signal_launcher_when: Callable[[], bool] | None = None,
                        launcher_signal: int = signal.SIGTERM,
                        signal_every_process: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N [LAUNCHER ARGS] examples/pretrain_gpt.py ARGV``;
    output captured. ``signal_launcher_when``: polled while the job runs; once it is true,
    ``launcher_signal`` goes to torchrun itself (not its workers), as a scheduler sends it;
    with ``signal_every_process`` to torchrun and every process under it (as Slurm's
    ``--signal`` reaches every process of a job step), torchrun started with that signal
    ignored (as ``scripts/megatron_lm_multinode.sh`` starts it)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               *extra_launcher_args, str(script), *argv]
    # A session of its own: on a timeout the launcher and every rank (a stopped one included) go.
    ignored = launcher_signal if signal_every_process else None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=REPO_ROOT,
                            start_new_session=True,
                            preexec_fn=None if ignored is None else lambda: signal.signal(ignored, signal.SIG_IGN))
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                stdout, stderr = proc.communicate(timeout=0.2 if signal_launcher_when else timeout)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise
                if signal_launcher_when is not None and signal_launcher_when():
                    for pid in [proc.pid, *(_descendants(proc.pid) if signal_every_process else ())]:
                        os.kill(pid, launcher_signal)
                    signal_launcher_when = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def run_elastic_replicas(argv: Sequence[str], replicas: int, log_dir: Path, nproc_per_replica: int = 1,
                         max_restarts: int = 2, timeout: float = 420.0) -> subprocess.CompletedProcess:
    """``scripts/elastic_replicas.py``: a torchft Lighthouse on a free port and ``replicas``
    torchruns of the pretrain script (``{replica}`` in ``argv`` becomes each one's index);
    output captured, each replica's in ``log_dir``. On a timeout the launcher is sent SIGTERM,
    which stops every replica it started, and the timeout is raised."""
    command = [sys.executable, str(REPO_ROOT / "scripts" / "elastic_replicas.py"), "--replicas", str(replicas),
               "--nproc-per-replica", str(nproc_per_replica), "--max-restarts", str(max_restarts),
               "--lighthouse-port", str(free_port()), "--log-dir", str(log_dir), "--", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
