"""Log lines and their step-time window."""

import io
import json
import time

import sys
import types

from higgs_megatron_bench.runs import finished
from higgs_megatron.callbacks import Callback, WandbCallback
from higgs_megatron.ddp import SyncStats
from higgs_megatron.runtime.metrics import LogWindow, MetricsLogger


def test_window_leaves_validation_and_save_time_out_of_step_time(monkeypatch):
    import higgs_megatron.runtime.metrics as metrics

    clock = [100.0]  # a clock the test moves: no sleeping, no timing noise
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    window = LogWindow()
    for _ in range(4):
        clock[0] += 0.01
        window.add(SyncStats(bytes_sent=10, dense_bytes=20, density=0.5))
    paused = clock[0]
    clock[0] += 0.2  # an evaluation inside the window
    window.excluded += clock[0] - paused
    assert abs(window.seconds_per_iteration() - 0.01) < 1e-12


def test_logger_writes_megatron_line_and_json(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(is_writer=True, log_json=str(tmp_path / "m.jsonl"), stream=out)
    log.iteration(10, 100, {"consumed samples": 80, "lm loss": 2.5, "tokens per second": 1000.0})
    log.event("validation", " validation loss at iteration 10: 2.4", iteration=10, loss=2.4)
    log.close()
    assert "iteration       10/     100 | consumed samples: 80 | lm loss: 2.500000E+00" in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert time.time() - 60 < records[0].pop("time") <= time.time()
    assert records[0] == {"type": "iteration", "iteration": 10, "consumed_samples": 80, "lm_loss": 2.5,
                          "tokens_per_second": 1000.0}
    assert records[1]["event"] == "validation" and records[1]["loss"] == 2.4
    quiet = MetricsLogger(is_writer=False, log_json=str(tmp_path / "other.jsonl"))
    quiet.event("x")
    assert not (tmp_path / "other.jsonl").exists()


def test_a_benchmark_keeps_only_finished_runs(tmp_path):
    """``bench_convergence.py --keep`` trains again any run whose log did not reach the end
    (stopped, failed, or cut mid-line by a kill)."""
    path = tmp_path / "run.jsonl"
    assert not finished(path, 20)
    log = MetricsLogger(is_writer=True, log_json=str(path), stream=io.StringIO())
    for iteration in (10, 20):
        log.iteration(iteration, 20, {"lm loss": 2.5, "tokens per second": 1000.0})
    assert not finished(path, 20)  # no validation at the end yet
    log.event("validation", " validation loss at iteration 20: 2.4", iteration=20, loss=2.4)
    log.close()
    assert finished(path, 20) and not finished(path, 40)
    path.write_text(path.read_text() + '{"type": "iteration", "itera')
    assert not finished(path, 20)


def test_a_scripts_logger_reaches_the_packages_handlers():
    """A script's ``get_logger("bench_x")`` logs through the package's handlers (a logger
    outside the package would print nothing at INFO)."""
    import logging

    from higgs_megatron.logs import get_logger, logger, setup_logging

    setup_logging()
    assert get_logger("bench_x").name == "higgs_megatron.bench_x"
    assert get_logger("higgs_megatron.training").name == "higgs_megatron.training"
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        get_logger("bench_x").info("kept")
    finally:
        logger.removeHandler(handler)
    assert seen == ["kept"]


class Recording(Callback):
    def __init__(self):
        self.seen, self.closed = [], False

    def on_iteration(self, iteration, fields):
        self.seen.append(("iteration", iteration, dict(fields)))

    def on_event(self, name, fields):
        self.seen.append(("event", name, dict(fields)))

    def close(self):
        self.closed = True


def test_callbacks_hear_iterations_and_events_on_the_logging_rank_only():
    heard, unheard = Recording(), Recording()
    log = MetricsLogger(is_writer=True, callbacks=[heard], stream=io.StringIO())
    log.iteration(3, 10, {"lm loss": 2.0})
    log.event("progress_alignment", " aligned", iteration=3, cause="rank 0: timeout", seconds_lost=4.5)
    log.close()
    assert heard.seen == [("iteration", 3, {"lm loss": 2.0}),
                          ("event", "progress_alignment", {"iteration": 3, "cause": "rank 0: timeout",
                                                           "seconds_lost": 4.5})]
    assert heard.closed
    quiet = MetricsLogger(is_writer=False, callbacks=[unheard])
    quiet.event("progress_alignment", iteration=1)
    assert unheard.seen == []


def test_wandb_callback_logs_offline_runs(monkeypatch, tmp_path):
    """Against a stand-in for the wandb package (not a dependency): what the callback asks of it."""
    calls = []

    class Run:
        def log(self, values, step=None):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    callback = WandbCallback("higgs", directory=str(tmp_path), config={"lr": 0.1})
    callback.on_iteration(5, {"lm loss": 2.5, "tokens per second": 100.0, "note": "x"})
    callback.on_event("progress_alignment", {"iteration": 6, "seconds_lost": 3.0, "cause": "timeout"})
    callback.on_event("progress_alignment", {"iteration": 9, "seconds_lost": 1.0, "cause": "timeout"})
    callback.close()
    assert calls[0] == ("init", {"project": "higgs", "mode": "offline", "dir": str(tmp_path), "config": {"lr": 0.1}})
    assert calls[1] == ("log", {"lm loss": 2.5, "tokens per second": 100.0}, 5)
    assert calls[2] == ("log", {"progress_alignment/seconds_lost": 3.0, "progress_alignment/count": 1}, 6)
    assert calls[3] == ("log", {"progress_alignment/seconds_lost": 1.0, "progress_alignment/count": 2}, 9)
    assert calls[4] == ("finish",)


def test_tensorboard_callback_writes_iterations_and_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from higgs_megatron.callbacks import TensorBoardCallback

    log = MetricsLogger(is_writer=True, callbacks=[TensorBoardCallback(str(tmp_path))], stream=io.StringIO())
    log.iteration(1, 10, {"lm loss": 3.0})
    log.iteration(2, 10, {"lm loss": 2.5})
    log.event("progress_alignment", iteration=2, cause="timeout", seconds_lost=4.0)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 3.0), (2, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("progress_alignment/seconds_lost")] == [(2, 4.0)]


def test_the_benchmarks_schedules_make_the_configs_they_describe():
    """``bench_convergence.py``'s compressed runs, at the script's own defaults, parse into the
    HiggsConfigs its docstring describes (a flag the config refuses would fail the benchmark's
    run, hours in; a changed default would change every table built with it)."""
    import argparse
    import importlib.util
    from pathlib import Path

    from higgs_megatron_bench.runs import higgs_flags
    from higgs_megatron.config import add_higgs_args, higgs_config_from_args

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_convergence.py"
    spec = importlib.util.spec_from_file_location("bench_convergence", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.build_parser().parse_args(["--train-iters", "2400"])
    parser = add_higgs_args(argparse.ArgumentParser())
    lean = higgs_config_from_args(parser.parse_args(bench.lean_schedule(args)), 2400, 240)
    assert (lean.dense_iters, lean.density_warmup_iters, lean.variance_refresh_iters) == (240, 120, 0)
    assert not lean.freeze_adam_variance and lean.dense_int8 and lean.payload == "int4"
    assert lean.compression_ratio == 0.25 and lean.sync == "sparse"
    frozen = higgs_config_from_args(parser.parse_args(bench.lean_schedule(
        bench.build_parser().parse_args(["--train-iters", "2400", "--lean-freeze-variance"]))), 2400, 240)
    assert frozen.freeze_adam_variance and (frozen.dense_iters, frozen.variance_refresh_iters) == (240, 20)
    ef = higgs_config_from_args(parser.parse_args(higgs_flags(args.density, args.train_iters, args.dense_iters,
                                                              args.density_warmup_iters)), 2400, 240)
    assert (ef.compression_ratio, ef.dense_iters, ef.density_warmup_iters) == (0.01, 600, 800)
    assert ef.freeze_adam_variance and ef.payload == "wide" and ef.error_feedback
