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


def test_a_step_torch_ran_on_this_process_alone_names_this_rank():
    """megatron-core 0.19 reads its common state with torch's checkpoint steps on each rank
    alone (``no_dist``), which call the process rank 0: the failure is this rank's."""
    import pytest
    from torch.distributed.checkpoint.utils import _DistWrapper

    def read():
        raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointException) as raised:
        _DistWrapper(group=None, use_dist=False, coordinator_rank=0).all_gather("read", read)
    assert list(raised.value.failures) == [0]
    assert describe(3, raised.value) == "rank 3: OSError: [Errno 5] Input/output error"


def test_a_failure_every_rank_raised_together_is_told_from_one_rank_raised_alone():
    """Our own agreements and torch's steps over a group raise on every rank at one point;
    an error of this rank's, a step torch ran on this rank alone, or our error wrapping a local
    one do not."""
    import pytest
    from torch.distributed.checkpoint.utils import _DistWrapper

    from higgs_megatron.checkpoint.outcome import RanksOutOfStep, agreed

    def read():
        raise OSError(5, "Input/output error")

    with pytest.raises(CheckpointException) as alone:
        _DistWrapper(group=None, use_dist=False, coordinator_rank=0).all_gather("read", read)
    assert not agreed(alone.value) and not agreed(OSError(5, "Input/output error"))
    assert agreed(CheckpointError("cannot be resharded")) and agreed(CheckpointException("write", {}))
    try:
        try:
            raise OSError(5, "Input/output error")
        except OSError as local:
            raise CheckpointError("rank 1: OSError") from local
    except CheckpointError as wrapped:
        assert not agreed(wrapped)
    assert not agreed(RanksOutOfStep("rank 1: OSError"))
