"""Megatron-LM's own unit tests of the gradient buffers, run with HiggsDDP (compressor none).

``test_param_and_grad_buffer.py::test_grad_sync`` (tag core_v0.16.1) checks what a bucket
group's reduction leaves in the buffer, for one and for two distributed-optimizer instances,
with and without overlap and averaging in the collective. It runs here unmodified, on 4 ranks
over gloo, through ``tests/megatron_lm/megatron_unit/higgs_megatron_unit_plugin.py``. Needs
``MEGATRON_LM_PATH`` (a full checkout: its ``tests/`` folder) and skips without it.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from higgs_megatron_bench.ranks import REPO_ROOT

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
TEST_FILE = "tests/unit_tests/distributed/test_param_and_grad_buffer.py"


@pytest.mark.skipif(not CHECKOUT or not (Path(CHECKOUT) / TEST_FILE).exists(),
                    reason=f"set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1) with {TEST_FILE}")
def test_megatrons_grad_sync_cases_pass_with_higgs_ddp(tmp_path):
    shutil.copy(Path(CHECKOUT) / TEST_FILE, tmp_path / "test_param_and_grad_buffer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": str(REPO_ROOT / "tests" / "megatron_lm" / "megatron_unit")}  # not the repository: its tests/ is not Megatron's
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m", "pytest",
         "-p", "higgs_megatron_unit_plugin", "-p", "no:cacheprovider", "-q", "-k", "test_grad_sync",
         "test_param_and_grad_buffer.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summaries = [line for line in proc.stdout.splitlines() if " passed" in line]
    # Every rank: 8 cases with one instance, 4 with two (Megatron skips two without the distributed optimizer).
    assert len(summaries) == 4 and all("12 passed" in line and "failed" not in line for line in summaries), summaries
    assert proc.stdout.count("higgs plugin: 12 models built, bucket groups ['HiggsBucketGroup']") == 4, proc.stdout[-3000:]
