import os
import shutil
import tempfile

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


def pytest_sessionfinish(session, exitstatus):
    if _CACHE is not None:
        shutil.rmtree(_CACHE, ignore_errors=True)
