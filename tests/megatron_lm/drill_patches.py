"""The Megatron-LM launcher run as a user runs it, without a checkout of the right version:
its refusals before anything runs, and the exit statuses both launchers give."""

import subprocess
import sys

import pytest

from higgs_megatron.runtime.exits import ExitStatus
from higgs_megatron.training import launch
from higgs_megatron_bench.ranks import REPO_ROOT
from higgs_megatron_patches.megatron_lm.checkout import installed_release, wheel_ships_training


LAUNCHER = REPO_ROOT / "patches" / "run_pretrain_gpt.py"


def run_launcher(*argv, env=None):
    environment = {"PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run([sys.executable, str(LAUNCHER), *argv], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=REPO_ROOT)


def test_launcher_refuses_a_missing_or_untested_checkout_before_running_it(tmp_path, write_checkout):
    proc = run_launcher("--mock-data")
    if wheel_ships_training():  # megatron-core 0.19: its own training code runs; its flags are checked first
        assert proc.returncode == 2 and "pretrain_gpt.py needs --distributed-backend gloo" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 2 and "no Megatron-LM checkout given" in proc.stderr
    old = write_checkout(tmp_path / "old", (0, 15, 0))
    proc = run_launcher("--megatron-lm-path", str(old), "--mock-data")
    assert proc.returncode == 2 and "is version 0.15.0" in proc.stderr
    proc = run_launcher("--mock-data", env={"MEGATRON_LM_PATH": str(tmp_path / "absent")})
    assert proc.returncode == 2 and "no such directory" in proc.stderr


ENDINGS = '''
import os
from higgs_megatron.checkpoint.manifest import CheckpointError
from higgs_megatron.runtime.exits import UsageError
end = os.environ["HIGGS_TEST_END"]
if end == "usage":
    raise UsageError("--micro-batch-size 0: expected 1 or more")
if end == "checkpoint":
    raise CheckpointError("iter_0000002/__0_0.distcp: sha256 differs from the rank map's")
if end == "peer":
    raise RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:29500")
'''


@pytest.mark.parametrize("end,status", [("ok", ExitStatus.OK), ("usage", ExitStatus.USAGE),
                                        ("checkpoint", ExitStatus.CHECKPOINT), ("peer", ExitStatus.RESTART)])
def test_both_launchers_end_a_run_with_the_same_exit_status(end, status, tmp_path, monkeypatch, caplog, write_checkout):
    """Megatron-LM's launcher (a checkout whose pretrain_gpt.py ends the run, on the CPU path
    with no patches) and our pretrain script give one status for each way a run ends
    (``runtime.exits``), and say why once."""
    checkout = write_checkout(tmp_path / "checkout", tuple(int(part) for part in installed_release().split(".")))
    (checkout / "pretrain_gpt.py").write_text(ENDINGS)
    (checkout / "megatron" / "legacy" / "fused_kernels").mkdir(parents=True)
    (checkout / "megatron" / "legacy" / "fused_kernels" / "__init__.py").write_text("def load(*args):\n    pass\n")
    (checkout / "megatron" / "training" / "training.py").write_text(
        "def build_train_valid_test_data_iterators(*args, **kwargs):\n    pass\n\n\n"
        "def initialize_megatron(*args, **kwargs):\n    pass\n")
    proc = run_launcher("--megatron-lm-path", str(checkout), "--higgs-no-patches", env={"HIGGS_TEST_END": end})
    assert proc.returncode == status, proc.stderr[-2000:]

    monkeypatch.setenv("HIGGS_TEST_END", end)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "pretrain", lambda argv: exec(ENDINGS, {}))
    assert launch.main([]) == status
    said = "\n".join(record.getMessage() for record in caplog.records)
    for message in {"usage": ["--micro-batch-size 0: expected 1 or more"], "checkpoint": ["sha256 differs"],
                    "peer": ["a peer rank is gone", "restarts the job"], "ok": []}[end]:
        assert said.count(message) == 1 and proc.stderr.count(message) == 1, (message, said, proc.stderr)
