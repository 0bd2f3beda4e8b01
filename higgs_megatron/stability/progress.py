"""Each rank's progress, published through the rendezvous store, and a watchdog reading it.

The side channel is the c10d store the job already rendezvoused on (torchrun's TCPStore),
not a process group: a rank stuck inside a collective, or a broken group, does not stop it.
Protocol: at each phase change a rank sets ``progress/<rank>`` to ``"<iteration> <phase>"``
(one small store write). The watchdog, a daemon thread on one rank with its own store
connection, reads every rank's entry every ``poll`` seconds and remembers when each entry
last changed, by its own clock (so hosts' clocks need not agree). A rank whose entry has not
changed for ``timeout`` seconds is reported once per stall: rank, phase, iteration, and how
long. Phases: forward-backward (forward, backward and the overlapped grad sync),
grad-sync (waiting for it), optimizer, checkpoint, idle.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch.distributed as dist

WAITING = ("grad-sync", "vote")  # phases in which a rank waits for the others


def describe(stalled: list[dict], timeout: float) -> str:
    """The stalled ranks, those that hold the others up first."""
    def names(entries: list[dict]) -> str:
        return ", ".join(f"rank {s['rank']} ({s['phase']}, iteration {s['iteration']}, {s['seconds']:.0f}s)"
                         for s in entries)

    stuck = [s for s in stalled if s["phase"] not in WAITING]
    waiting = [s for s in stalled if s["phase"] in WAITING]
    message = f"no progress for {timeout:g}s or more: {names(stuck or waiting)}"
    if stuck and waiting:
        message += f"; waiting for it: {names(waiting)}"
    return message


def job_store(prefix: str) -> dist.Store:
    """A store client of this job, under ``prefix`` (include the restart count: keys of an
    earlier attempt of the job must not be read as this one's)."""
    from torch.distributed import distributed_c10d

    return dist.PrefixStore(prefix, distributed_c10d._get_default_store())


class ProgressBoard:
    """This rank's writer."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.iteration, self.phase = 0, "start"

    def publish(self, iteration: int, phase: str) -> None:
        self.iteration, self.phase = iteration, phase
        self.store.set(f"progress/{self.rank}", f"{iteration} {phase}")


class Watchdog:
    """Warns through ``warn(message, stalled)`` about ranks that stopped advancing; with
    ``give_up_after``, calls ``give_up(message, ranks)`` once some ranks have not advanced for that long
    (outside ``checkpoint``, whose writes may take long): a hang no wait of ours bounds, such
    as one inside Megatron's own tensor- or pipeline-parallel collectives."""

    def __init__(self, store: dist.Store, world_size: int, timeout: float,
                 warn: Callable[[str, list[dict]], None], poll: float | None = None,
                 give_up_after: float | None = None, give_up: Callable[[str, list[int]], None] | None = None) -> None:
        self.store, self.world_size, self.timeout, self.warn = store, world_size, timeout, warn
        self.give_up_after, self.give_up = give_up_after, give_up
        self.poll = poll or max(0.2, min(5.0, timeout / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="higgs-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll * 2 + 1)

    def _run(self) -> None:
        keys = [f"progress/{rank}" for rank in range(self.world_size)]
        seen: dict[int, tuple[str, float, bool]] = {}  # rank -> (entry, changed at, reported)
        while not self._stop.wait(self.poll):
            try:
                if not all(self.store.check([key]) for key in keys):
                    continue
                entries = [self.store.get(key).decode() for key in keys]
            except Exception:  # the store is gone: the job is ending
                return
            now = time.monotonic()
            stalled, lost = [], []
            for rank, entry in enumerate(entries):
                last, changed, reported = seen.get(rank, (None, now, False))
                if entry != last:
                    seen[rank] = (entry, now, False)
                    continue
                iteration, phase = entry.split(" ", 1)
                if (self.give_up_after is not None and now - changed >= self.give_up_after
                        and phase not in ("done", "checkpoint")):
                    lost.append({"rank": rank, "iteration": int(iteration), "phase": phase,
                                 "seconds": round(now - changed, 1)})
                if now - changed >= self.timeout and not reported and phase != "done":
                    stalled.append({"rank": rank, "iteration": int(iteration), "phase": phase,
                                    "seconds": round(now - changed, 1)})
                    seen[rank] = (entry, changed, True)
            if stalled:
                self.warn(describe(stalled, self.timeout), stalled)
            if lost and self.give_up is not None:
                self.give_up(describe(lost, self.give_up_after), [entry["rank"] for entry in lost])
                return
