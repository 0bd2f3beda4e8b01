"""What a user sees of a run: Megatron-style log lines, a JSONL metrics file, callbacks.

One rank writes (Megatron-LM logs from the last rank, which holds the loss under pipeline
parallelism); the others stay quiet. Each logged iteration becomes one line like
Megatron-LM's ``training_log`` and, with ``--log-json PATH``, one JSON object
``{"type": "iteration", ...}``; every event (corpus built, evaluation, later checkpoints
and alignments) becomes ``{"type": "event", "event": NAME, ...}`` in the same file. Both
also go to the ``callbacks`` (TensorBoard, W&B, a user's own: ``higgs_megatron.callbacks``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO

import torch
import torch.distributed as dist

from ..callbacks import Callback
from ..ddp import SyncStats
from ..device import collective_device
from ..logs import get_logger, setup_logging

log = get_logger(__name__)


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key in ("lm loss", "learning rate", "validation loss"):
            return f"{value:.6E}"
        return f"{value:.3f}"
    return str(value)


class MetricsLogger:
    """Writes log lines and JSONL records on the writing rank; a no-op elsewhere."""

    def __init__(self, is_writer: bool, log_json: str | None = None, callbacks: list[Callback] | None = None,
                 stream: TextIO | None = None) -> None:
        self.is_writer = is_writer
        self.stream = stream  # None: the package's logger (``logs``)
        if is_writer and stream is None:
            setup_logging()
        if is_writer and log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
        self._json = open(log_json, "a", buffering=1) if (is_writer and log_json) else None
        self.callbacks = list(callbacks or []) if is_writer else []
        self._lock = threading.Lock()  # the watchdog's thread logs too

    def print(self, message: str) -> None:
        """A log line, on the writing rank: to ``stream`` if one was given, else the logger."""
        if not self.is_writer:
            return
        if self.stream is not None:
            self.stream.write(message + "\n")
            self.stream.flush()
        else:
            log.info(message)

    def iteration(self, iteration: int, train_iters: int, fields: dict[str, Any]) -> None:
        """One Megatron-style line, one JSON record and TensorBoard scalars for an iteration."""
        if not self.is_writer:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        parts = [f" [{stamp}] iteration {iteration:8d}/{train_iters:8d}"]
        parts += [f"{key}: {_format_value(key, value)}" for key, value in fields.items()]
        self.print(" | ".join(parts) + " |")
        self._write_json({"type": "iteration", "iteration": iteration, "time": time.time(), **_json_keys(fields)})
        for callback in self.callbacks:
            callback.on_iteration(iteration, fields)

    def event(self, name: str, message: str | None = None, **fields: Any) -> None:
        if not self.is_writer:
            return
        if message:
            self.print(message)
        self._write_json({"type": "event", "event": name, "time": time.time(), **fields})
        for callback in self.callbacks:
            callback.on_event(name, fields)

    def _write_json(self, record: dict[str, Any]) -> None:
        if self._json is not None:
            with self._lock:
                self._json.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None
        for callback in self.callbacks:
            callback.close()
        self.callbacks = []


def _json_keys(fields: dict[str, Any]) -> dict[str, Any]:
    return {key.replace(" ", "_").replace("(", "").replace(")", "").replace("/", "_per_"): value
            for key, value in fields.items()}


class LogWindow:
    """Step time (validation and saves excluded) and traffic since the last log line; traffic
    averaged over all ranks."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.excluded = 0.0  # validation and checkpoint time inside the window
        self.iterations = 0
        # bytes sent, dense bytes, compression s, wire bytes, dense wire bytes, density: on the
        # host (a device tensor is made only when reduced)
        self.totals = [0.0] * 6
        self.tokens = 0

    def add(self, stats: SyncStats, tokens: int = 0) -> None:
        self.iterations += 1
        self.tokens += tokens
        values = (stats.bytes_sent, stats.dense_bytes, stats.compress_seconds, stats.wire_bytes,
                  stats.dense_wire_bytes, stats.density)
        self.totals = [total + value for total, value in zip(self.totals, values)]

    def seconds_per_iteration(self) -> float:
        return (time.perf_counter() - self.started - self.excluded) / max(1, self.iterations)

    def reduced(self) -> torch.Tensor:
        """The window's traffic per rank per step, averaged over all ranks, on the collectives'
        device (bytes sent, dense bytes, compression seconds, wire bytes, dense wire bytes, and
        the density in force). One host-to-device copy and one collective over the default
        group: every rank logs at the same iterations."""
        totals = torch.tensor(self.totals, dtype=torch.float64, device=collective_device())
        dist.all_reduce(totals)
        return totals / (dist.get_world_size() * max(1, self.iterations))

    def per_rank_per_step(self) -> list[float]:
        """``reduced``, read on the host (at a log line)."""
        return self.reduced().tolist()
