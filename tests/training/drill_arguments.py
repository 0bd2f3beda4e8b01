"""Bad input under torchrun: one message, from rank 0, and every rank exits with status 2."""

import subprocess
import sys

import pytest

from higgs_megatron_bench.ranks import PRETRAIN_SCRIPT, run_pretrain_script


def _run_single(argv):
    return subprocess.run([sys.executable, str(PRETRAIN_SCRIPT), *argv], capture_output=True, text=True,
                          timeout=120)


def _lines(stderr: str) -> list[str]:
    """stderr's lines, less torch's own warning at import on a machine with ``nvcc`` and no GPU
    (its CUDA build on a CPU): the environment's, not ours."""
    return [line for line in stderr.strip().splitlines() if "No CUDA runtime is found" not in line]


@pytest.mark.oracle
def test_empty_data_folder_exits_2_with_one_line(tmp_path):
    proc = _run_single(["--data-path", str(tmp_path)])
    assert proc.returncode == 2
    assert _lines(proc.stderr) == [f"--data-path {tmp_path}: the folder holds no text files "
                                   "(looked for .py, .txt, .md, .rst, .json, .jsonl, .c, .h, .html, .csv)"]
    assert "Traceback" not in proc.stderr


LATE_RANK0 = """import os, sys, time
if os.environ["RANK"] == "0":
    time.sleep(5)  # rank 1 finds the error first; torchrun must not stop rank 0 before it prints
from higgs_megatron.training.launch import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("rank0", ["first", "late"])
def test_under_torchrun_the_message_appears_once_and_ranks_exit_2(rank0, tmp_path):
    script = PRETRAIN_SCRIPT
    if rank0 == "late":
        script = tmp_path / "late_rank0.py"
        script.write_text(LATE_RANK0)
    proc = run_pretrain_script(["--tensor-model-parallel-size", "3"], nproc=2, timeout=120, script=script)
    assert proc.returncode != 0
    message = "world size 2 is not divisible by --tensor-model-parallel-size 3"
    assert (proc.stdout + proc.stderr).count(message) == 1
    assert "Traceback (most recent call last)" not in proc.stdout
    assert "exitcode  : 2" in proc.stderr
