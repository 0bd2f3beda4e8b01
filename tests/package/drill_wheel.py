"""The wheel a user installs: built from this tree, installed into a fresh venv, every command run.

The fresh venv takes torch and megatron-core from the test venv (a path entry, not its .pth
files, so the test venv's editable install of this project stays out), and runs from an empty
folder, so only the wheel's copy of the package can be imported.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from higgs_megatron_bench.ranks import REPO_ROOT
from tests.megatron_lm.drill_megatron_lm import CHECKOUT, CPU_FLAGS, MODEL, pytestmark as needs_megatron_lm


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""})


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel, checked for every source file and command, installed into a fresh venv: its bin/."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info/ beside the sources
    for name in ("higgs_megatron", "patches"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                  "-w", str(tmp_path / "dist"), str(source)], cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("higgs_megatron-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {str(p.relative_to(REPO_ROOT)) for pattern in ("higgs_megatron/**/*.py", "higgs_megatron/**/*.c")
               for p in REPO_ROOT.glob(pattern)}  # the fused codec's C source too, built at first use
    sources |= {"higgs_megatron_patches/" + str(p.relative_to(REPO_ROOT / "patches"))
                for p in REPO_ROOT.glob("patches/**/*.py")}
    assert sources - names == set(), "left out of the wheel (pyproject.toml's package list)"
    kit = {name for name in names if name.split("/")[0] in ("higgs_megatron_bench", "tests", "scripts")}
    assert not kit, f"the test and benchmark kit is not for a training job: {sorted(kit)}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert {"higgs-pretrain-gpt", "higgs-megatron-lm", "higgs-megatron"} <= {
        line.split("=")[0].strip() for line in zipfile.ZipFile(wheel).read(entry_points).decode().splitlines()}

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path).returncode == 0
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    (Path(purelib.stdout.strip()) / "test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                      "--quiet", str(wheel)], cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = _run([str(python), "-c", "import higgs_megatron, higgs_megatron_patches.megatron_lm.arguments as i; "
                  "print(higgs_megatron.__file__); print(i.__file__)"], cwd=tmp_path)
    assert where.returncode == 0 and all(line.startswith(str(venv)) for line in where.stdout.split()), where
    return venv / "bin"


def test_the_wheel_ships_both_front_ends_and_their_commands_run(installed, tmp_path, tiny_gpt_args):
    for command, expected in (("higgs-pretrain-gpt", "--use-higgs"), ("higgs-megatron", "checkpoint"),
                              ("higgs-megatron-lm", "--megatron-lm-path")):
        shown = _run([str(installed / command), "--help"], cwd=tmp_path, timeout=120)
        assert shown.returncode == 0 and expected in shown.stdout + shown.stderr, (command, shown.stderr[-2000:])

    trained = _run([str(installed / "higgs-pretrain-gpt"), *tiny_gpt_args, "--train-iters", "2", "--log-interval", "1",
                    "--use-higgs", "--save", str(tmp_path / "ckpt")], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert " iteration        2/       2 |" in trained.stdout
    inspected = _run([str(installed / "higgs-megatron"), "checkpoint", "verify", str(tmp_path / "ckpt")], cwd=tmp_path)
    assert inspected.returncode == 0 and "files match the rank map" in inspected.stdout, inspected.stderr[-2000:]


@needs_megatron_lm[0]
@needs_megatron_lm[1]
def test_the_installed_megatron_lm_command_trains_with_the_patches(installed, tmp_path):
    trained = _run([str(installed / "python"), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "--no-python", str(installed / "higgs-megatron-lm"),
                    *(["--megatron-lm-path", CHECKOUT] if CHECKOUT else []), *MODEL,  # none: the wheel's (0.19)
                    *CPU_FLAGS, "--train-iters", "2", "--global-batch-size", "2", "--use-higgs"],
                   cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    assert "higgs" in trained.stdout and " iteration        2/       2 |" in trained.stdout
