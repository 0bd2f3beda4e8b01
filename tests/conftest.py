import os
import shutil
import tempfile

import numpy
import pytest

# Every test process (and the ranks it spawns) builds the corpus into one throwaway cache,
# removed when the session ends.
_CACHE = None
if "HIGGS_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["HIGGS_CACHE_DIR"] = tempfile.mkdtemp(prefix="higgs-test-cache-")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_gpt_args():
    """A GPT small enough that four ranks train it on two cores in seconds."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4",
            "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "1", "--num-threads", "1"]


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory):
    """Short documents of varied length (10 to 300 bytes), so that batches land in every bucket."""
    root = tmp_path_factory.mktemp("short_docs")
    rng = numpy.random.RandomState(0)
    for i in range(400):
        (root / f"doc{i}.txt").write_text("".join(chr(97 + c) for c in rng.randint(0, 26, rng.randint(10, 300))))
    return root


@pytest.fixture
def write_checkout():
    """Writes the skeleton of a Megatron-LM checkout of a given version (what the launcher checks)."""

    def write(path, version=(0, 16, 1)):
        (path / "megatron" / "core").mkdir(parents=True)
        (path / "megatron" / "training").mkdir(parents=True)
        (path / "pretrain_gpt.py").write_text("raise SystemExit('not to be run in this test')\n")
        (path / "megatron" / "training" / "training.py").write_text("")
        major, minor, patch = version
        (path / "megatron" / "core" / "package_info.py").write_text(
            f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = ''\n")
        return path

    return write


def pytest_collection_modifyitems(items):
    """Every test of a drill_*.py file is a multi-process run: marked ``drill``."""
    for item in items:
        if item.path.name.startswith("drill_"):
            item.add_marker(pytest.mark.drill)


def pytest_sessionfinish(session, exitstatus):
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)
