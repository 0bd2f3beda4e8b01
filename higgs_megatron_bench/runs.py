"""Shared pieces of the benchmark and demo scripts: run the pretrain script, read its metrics.

Each configuration runs as its own ``torchrun`` job of ``examples/pretrain_gpt.py`` with
``--log-json``; everything reported comes from those JSONL files, so a table is always
reproducible from the files it names.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from higgs_megatron.config import HiggsConfig
from higgs_megatron.field_flags import config_flags
from higgs_megatron.logs import get_logger, setup_logging

from .ranks import REPO_ROOT as REPO  # one root for the kit


log = get_logger(__name__)


def higgs_config(density: float, train_iters: int, dense_iters: int | None = None,
                 warmup_iters: int | None = None) -> HiggsConfig:
    """At ``density``, compressing on one host (``sparse``), with the schedule that converges best
    in ``scripts/bench_convergence.py``: dense for the first quarter of the run, Adam's second
    moment frozen as that ends, then density from 1 to the target over the next third."""
    dense_iters = train_iters // 4 if dense_iters is None else dense_iters
    warmup_iters = train_iters // 3 if warmup_iters is None else warmup_iters
    return HiggsConfig.for_run(train_iters, dense_iters, compression_ratio=density, sync="sparse", payload="wide",
                               density_warmup_iters=warmup_iters, freeze_adam_variance=bool(dense_iters))


def lean_config(train_iters: int, density: float = 0.25, payload: str = "int4", dense_wire: str = "int8",
                dense_iters: int | None = None, ramp_iters: int | None = None, freeze_variance: bool = False,
                refresh_iters: int = 20, sync: str = "sparse") -> HiggsConfig:
    """The schedule for fewest bytes over a run: what ``--use-higgs`` derives by itself
    (``HiggsConfig.for_run``: a dense stage as long as the pretrain script's learning-rate
    warm-up, a tenth of the run, a ramp over a twentieth to ``density``, the ``payload``
    format, Adam as it is), its dense stage sent as ``dense_wire`` ('int8' or 'bf16'), and
    ``sync`` the compressed form, ``sparse`` (all-gathered) or ``agreed``/``sharded`` (wire bytes
    per rank that do not grow with P). ``freeze_variance`` freezes Adam's second moment after
    the dense stage instead, refreshed for ``refresh_iters`` at 2, 4, 8... times the dense
    stage (0: never)."""
    dense_iters = train_iters // 10 if dense_iters is None else dense_iters
    freeze = bool(dense_iters and freeze_variance)
    return HiggsConfig.for_run(
        train_iters, dense_iters, compression_ratio=density, payload=payload, sync=sync,
        density_warmup_iters=train_iters // 20 if ramp_iters is None else ramp_iters,
        dense_int8=bool(dense_iters) and dense_wire == "int8", dense_bf16=bool(dense_iters) and dense_wire == "bf16",
        freeze_adam_variance=freeze, variance_refresh_iters=min(dense_iters, refresh_iters) if freeze else 0)


def higgs_flags(*args: Any, **kwargs: Any) -> list[str]:
    """``higgs_config``'s schedule as the pretrain script's flags."""
    return ["--use-higgs", *config_flags(higgs_config(*args, **kwargs))]


def lean_flags(*args: Any, **kwargs: Any) -> list[str]:
    """``lean_config``'s schedule as the pretrain script's flags."""
    return ["--use-higgs", *config_flags(lean_config(*args, **kwargs))]


def run_pretrain(flags: Sequence[str], log_json: Path, nproc: int, quiet: bool = False,
                 script: str = "examples/pretrain_gpt.py", virtual_dp: int | None = None) -> None:
    """One training job of ``script`` (the pretrain script, or a peer taking its flags) on
    ``nproc`` ranks, or with ``virtual_dp`` the pretrain script over that many virtual ranks in
    one process (``scripts/virtual_dp.py``); raises CalledProcessError if it fails."""
    log_json.parent.mkdir(parents=True, exist_ok=True)
    log_json.unlink(missing_ok=True)
    if virtual_dp is None:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(REPO / script)]
        shown = f"torchrun --nproc_per_node {nproc} {script}"
    else:
        launcher = [str(REPO / "scripts" / "virtual_dp.py"), "--dp", str(virtual_dp), "--"]
        shown = f"python scripts/virtual_dp.py --dp {virtual_dp} --"
    command = [sys.executable, *launcher, *flags, "--log-json", str(log_json)]
    setup_logging()
    log.info(f"$ {shown} {' '.join(flags)}")
    subprocess.run(command, check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.DEVNULL if quiet else None)


def read_log(log_json: Path) -> tuple[list[dict], list[dict]]:
    """(iteration records, event records) of one run."""
    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    return ([r for r in records if r["type"] == "iteration"], [r for r in records if r["type"] == "event"])


def _validations(events: list[dict]) -> list[dict]:
    """A log's validation events, in order (KeyError on an event record without its name)."""
    return [e for e in events if e["event"] == "validation"]


def finished(log_json: Path, train_iters: int) -> bool:
    """Whether ``log_json`` holds a whole run: its last iteration record at ``train_iters`` and a
    validation after it (a run that was stopped, or failed, is not finished)."""
    if not log_json.is_file():
        return False
    try:
        iterations, events = read_log(log_json)
        validations = _validations(events)
    except (json.JSONDecodeError, KeyError):  # a line cut short by a kill
        return False
    return bool(iterations and validations and iterations[-1]["iteration"] == train_iters
                and validations[-1]["iteration"] == train_iters)


def summarize(log_json: Path) -> dict:
    iterations, events = read_log(log_json)
    validations = _validations(events)
    steady = iterations[1:] or iterations  # the first window holds start-up costs
    return {
        "iterations": iterations[-1]["iteration"],
        "final validation loss": validations[-1]["loss"] if validations else float("nan"),
        # from the end of set-up to the last validation: the wall-clock time to the final loss
        "time to the final loss (s)": _time_to_final_loss(events, validations),
        "tokens/s": statistics.median(r["tokens_per_second"] for r in steady),
        "step time (ms)": statistics.median(r["elapsed_time_per_iteration_ms"] for r in steady),
        "bytes sent per step": statistics.median(r["bytes_sent"] for r in steady),
        "dense bytes per step": statistics.median(r["dense_bytes"] for r in steady),
        "compression time (ms)": statistics.median(r.get("compression_time_ms", 0.0) for r in steady),
        "bytes sent per step at the end": iterations[-1]["bytes_sent"],  # after any warm-up
        # Each record holds its window's per-step bytes: scaled by the steps the records stand for.
        "bytes over the run": sum(r["bytes_sent"] for r in iterations) * iterations[-1]["iteration"] / len(iterations),
        "traffic over the run vs dense": _ratio(sum(r["bytes_sent"] for r in iterations),
                                                sum(r["dense_bytes"] for r in iterations)),
        # Wire bytes per rank at this run's DP size (``reduce.wire``); NaN for a log written before they were logged.
        "wire bytes per step at the end": iterations[-1].get("wire_bytes", math.nan),
        "wire bytes over the run": (sum(r.get("wire_bytes", math.nan) for r in iterations)
                                    * iterations[-1]["iteration"] / len(iterations)),
        "wire over the run vs dense": _ratio(sum(r.get("wire_bytes", math.nan) for r in iterations),
                                             sum(r.get("dense_wire_bytes", math.nan) for r in iterations)),
    }


def _time_to_final_loss(events: list[dict], validations: list[dict]) -> float:
    started = [e["time"] for e in events if e["event"] == "setup_done"]
    return validations[-1]["time"] - started[0] if validations and started else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def validation_curve(log_json: Path) -> list[tuple[int, float]]:
    _, events = read_log(log_json)
    return [(e["iteration"], e["loss"]) for e in _validations(events)]


def markdown_table(rows: dict[str, dict], columns: Sequence[str], baseline: str | None = None) -> str:
    """Rows as a markdown table; with ``baseline``, tokens/s also as a ratio to it (``1.62x``).
    A column named "... vs dense" holds ratios, written like ``1.043x``."""
    head = ["configuration", *columns] + (["tokens/s vs " + baseline] if baseline else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        cells = [name]
        for column in columns:
            value = row[column]
            if isinstance(value, str):
                cells.append(value)
            elif column.endswith("vs dense"):
                cells.append(f"{value:.3f}x")
            elif column.endswith("(s)"):
                cells.append(f"{value:,.1f}")
            elif "loss" in column:
                cells.append(f"{value:.4f}")
            elif "bytes" in column:
                cells.append(f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.3f} MB")
            elif isinstance(value, float):
                cells.append(f"{value:,.1f}")
            else:
                cells.append(str(value))
        if baseline:
            cells.append(f"{row['tokens/s'] / rows[baseline]['tokens/s']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
