"""How a run ends, the same under both launchers: one usage-error type, one table of exit
statuses a launcher or a scheduler can act on, and ``exit_status``, which runs a job and turns
how it ended into its status, with one message.

| status | ``ExitStatus`` | what ended the run |
|---|---|---|
| 0 | ``OK`` | it finished (or an ``--exit-*`` condition stopped it cleanly) |
| 2 | ``USAGE`` | bad input (``UsageError``): a flag, a file, a checkout, named before any state is touched |
| 3 | ``CHECKPOINT`` | a checkpoint that cannot be loaded or saved (``CheckpointError``) |
| 75 | ``RESTART`` | a lost peer, or a rank stuck past ``--higgs-restart-timeout`` (EX_TEMPFAIL: try again) |

On 75, ``torchrun --max-restarts`` restarts the job, and ``--auto-resume`` resumes it from the
latest committed checkpoint.

Any other error is not ours to name: it propagates, with its traceback (Python's status 1).
"""

from __future__ import annotations

import datetime
import enum
from typing import Callable

from ..checkpoint.manifest import CheckpointError
from ..logs import get_logger, setup_logging
from ..reduce.wire import peer_lost
from ..stability.regroup import RESTART_EXIT_CODE
from ..launcher import attempt_store, launcher_rank, process_rank

log = get_logger(__name__)


class ExitStatus(enum.IntEnum):
    OK = 0
    USAGE = 2
    CHECKPOINT = 3
    RESTART = RESTART_EXIT_CODE


class UsageError(SystemExit):
    """Bad input, named in the message: printed once (by the launcher's rank 0), and the
    process exits with status 2 wherever it is not caught."""

    def __init__(self, message: str) -> None:
        super().__init__(ExitStatus.USAGE)
        self.message = message
        self.reported = False  # report_usage_error has said it

    def __str__(self) -> str:
        return self.message


REPORT_WAIT = datetime.timedelta(seconds=30)
_REPORTED_KEY = "usage_error_reported"


def report_usage_error(error: UsageError) -> None:
    """Print the message once per job (on the launcher's rank 0).

    Every rank finds the same error, but the ranks do not reach it together: under torchrun, a
    rank that exits first makes the agent stop the others, and rank 0 could be stopped before
    it prints. So under torchrun's agent store the other ranks wait (bounded) for rank 0 to
    say it has printed before they exit. Once per error: a second call does nothing."""
    if error.reported:
        return
    error.reported = True
    rank = launcher_rank()
    if rank == 0:
        setup_logging().error(error.message)
    try:
        store = attempt_store(REPORT_WAIT).get("store")
        if store is None:
            return
        if rank == 0:
            store.set(_REPORTED_KEY, "1")
        else:
            store.wait([_REPORTED_KEY], REPORT_WAIT)
    except (RuntimeError, OSError):  # no store, or rank 0 never reported: exit anyway
        pass


def exit_status(run: Callable[[], object], prog: str) -> int:
    """Run ``run()`` and return its exit status (the table above), having said why on the
    right rank: a usage error and a checkpoint error once (rank 0), a lost peer on each rank
    that saw it. ``prog`` names the front-end in the messages."""
    setup_logging()
    try:
        run()
    except UsageError as error:
        report_usage_error(error)
        return ExitStatus.USAGE
    except CheckpointError as error:
        if process_rank() == 0:
            log.error(f"{prog}: checkpoint error: {error}")
        return ExitStatus.CHECKPOINT
    except RuntimeError as error:
        if not peer_lost(error):
            raise
        log.error(f"[rank {process_rank()}] a peer rank is gone ({str(error).splitlines()[0][:200]}); exiting with "
                  f"status {ExitStatus.RESTART} so that torchrun --max-restarts restarts the job (with --auto-resume "
                  "it resumes from the latest committed checkpoint)")
        return ExitStatus.RESTART
    return ExitStatus.OK
