import os
import tempfile

import pytest

# Every test process (and the ranks it spawns) builds the corpus into one throwaway cache.
os.environ.setdefault("HIGGS_CACHE_DIR", tempfile.mkdtemp(prefix="higgs-test-cache-"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny_gpt_args():
    """A GPT small enough that four ranks train it on two cores in seconds."""
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4",
            "--log-interval", "1000", "--eval-interval", "1000", "--eval-iters", "1", "--num-threads", "1"]
