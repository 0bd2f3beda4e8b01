"""How a failure is named for every rank (``checkpoint.outcome``); the agreement itself is
drilled in real multi-process runs (``drill_checkpoint.py``)."""

import traceback

from torch.distributed.checkpoint.api import CheckpointException

from higgs_megatron.checkpoint.manifest import CheckpointError
from higgs_megatron.checkpoint.outcome import describe


def test_a_failure_names_the_rank_that_failed_and_its_error():
    assert describe(3, OSError(5, "Input/output error")) == "rank 3: OSError: [Errno 5] Input/output error"
    assert describe(3, CheckpointError("rank 1: already said")) == "rank 1: already said"
    failed = CheckpointException("write", {1: (PermissionError(13, "Permission denied"), traceback.StackSummary()),
                                           0: (RuntimeError("Worker failure"), traceback.StackSummary())})
    assert describe(2, failed) == ("rank 0: RuntimeError: Worker failure; "
                                   "rank 1: PermissionError: [Errno 13] Permission denied")
    # megatron-core gathers the failed ranks' errors on one rank; the others' copies name none
    assert describe(2, CheckpointException("write", {})) is None
