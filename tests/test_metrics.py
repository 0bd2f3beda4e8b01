"""Log lines and their step-time window."""

import io
import json
import time

from higgs_megatron.training.loop import _Window
from higgs_megatron.training.metrics import MetricsLogger


def test_window_leaves_validation_and_save_time_out_of_step_time():
    window = _Window()
    for _ in range(4):
        time.sleep(0.01)
        window.add(10, 20, 0.0, 0.5)
    paused = time.perf_counter()
    time.sleep(0.2)  # an evaluation inside the window
    window.excluded += time.perf_counter() - paused
    assert 0.009 < window.seconds_per_iteration() < 0.03


def test_logger_writes_megatron_line_and_json(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(is_writer=True, log_json=str(tmp_path / "m.jsonl"), stream=out)
    log.iteration(10, 100, {"consumed samples": 80, "lm loss": 2.5, "tokens per second": 1000.0})
    log.event("validation", " validation loss at iteration 10: 2.4", iteration=10, loss=2.4)
    log.close()
    assert "iteration       10/     100 | consumed samples: 80 | lm loss: 2.500000E+00" in out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[0] == {"type": "iteration", "iteration": 10, "consumed_samples": 80, "lm_loss": 2.5,
                          "tokens_per_second": 1000.0}
    assert records[1]["event"] == "validation" and records[1]["loss"] == 2.4
    quiet = MetricsLogger(is_writer=False, log_json=str(tmp_path / "other.jsonl"))
    quiet.event("x")
    assert not (tmp_path / "other.jsonl").exists()
