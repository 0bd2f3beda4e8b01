"""scripts/gpu_check.sh runs end to end without a GPU (every stage small, over gloo), so that
the one command a GPU machine runs cannot rot in between."""

import json
import os
import subprocess
import sys

import pytest
import torch

from higgs_megatron_bench.ranks import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run scripts/gpu_check.sh itself")
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("MEGATRON_LM_PATH", None)  # its stage is covered by tests/megatron_lm/drill_megatron_lm.py
    proc = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and report["machine"].startswith("CPU figures")
    status = {row["stage"]: row["status"] for row in report["rows"]}
    assert status == {"ddp-oracle": "PASS", "optimizer-instances": "PASS", "one-percent-topk": "PASS", "one-percent-sampled-topk": "PASS",
                      "compressor-throughput": "PASS", "onebit": "PASS", "async-save-resume": "PASS", "offload": "PASS",
                      "megatron-lm": "SKIP", "transformer-engine": "SKIP"}, status
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith("GPU check: CPU figures") and table.count("| PASS |") == 8
    rows = {row["stage"]: row["values"] for row in report["rows"]}
    assert rows["ddp-oracle"]["bitwise_equal"] and rows["async-save-resume"]["bitwise_equal"]
    assert rows["optimizer-instances"]["bitwise_equal"] and rows["optimizer-instances"]["replicas_equal"]
    assert rows["offload"]["offloaded"] >= 1 and rows["offload"]["reloaded"] >= 1
    assert rows["one-percent-topk"]["bytes_ratio"] < 1 / 20
