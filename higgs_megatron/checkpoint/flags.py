"""The rank-map checkpoint flags both front-ends add, generated and checked from one dataclass.

``CheckpointConfig``'s fields carry their flags (``field_flags``), so our pretrain script and the
Megatron-LM patches get the same flags with the same defaults, and the same checks
(``checkpoint_config_from_args``). Our script adds them beside ``--save``/``--load``; the
Megatron-LM patches add them to Megatron-LM's parser, whose own ``--save``, ``--load`` and
``--save-interval`` they extend.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from ..field_flags import add_field_flags, field_flag, field_values
from ..field_flags import flag_metadata as _flag
from .load import RECOVERY_MODES


class CheckpointConfigError(ValueError):
    """A CheckpointConfig value out of range; the message starts with the field's flag."""


@dataclass(frozen=True)
class CheckpointConfig:
    recovery_mode: str = field(default="same-sharding", metadata=_flag(
        "--recovery-mode", "on --load: same-sharding refuses a checkpoint saved with another layout, naming each "
        "difference; reshard loads it into this layout", choices=RECOVERY_MODES))
    """What a layout different from the checkpoint's does on load: refuse, or reshard."""

    checkpoint_version: int | None = field(default=None, metadata=_flag(
        "--checkpoint-version", "load the committed checkpoint of this iteration instead of the latest",
        type=int, metavar="ITER"))
    """The iteration to load; None loads the latest committed checkpoint."""

    async_checkpoint: bool = field(default=False, metadata=_flag(
        "--async-checkpoint", "save in the background: the loop pays for planning the save and a host copy of "
        "the state; writing, hashing and the commit overlap the next iterations (under Megatron-LM, its "
        "--async-save with the rank map's commit)", action="store_true"))
    """Write, hash and commit in the background."""

    checkpoint_interval: float | None = field(default=None, metadata=_flag(
        "--checkpoint-interval", "also save when this much wall-clock time has passed since the last save "
        "(decided together by all ranks)", type=float, metavar="SECONDS"))
    """Seconds of wall-clock time between saves, on top of any iteration interval."""

    auto_resume: bool = field(default=False, metadata=_flag(
        "--auto-resume", "resume from the latest committed checkpoint in --save if there is one (--load defaults "
        "to --save): what a job restarted by torchrun --max-restarts needs", action="store_true"))
    """Load from ``--save`` when ``--load`` is not given."""

    # The front-end's own flags (Megatron-LM's names), read with ours.
    save: str | None = None
    """``--save``: where checkpoints go; None saves nothing."""
    load: str | None = None
    """Where the run loads from: ``--load``, or with ``auto_resume`` and no ``--load`` the run's
    own ``save`` (``load_directory``)."""
    save_interval: int | None = None
    """``--save-interval``: a save every N iterations."""
    keep_last: int | None = None
    """``--keep-last`` (our pretrain script): only the newest N checkpoints are kept."""

    def __post_init__(self) -> None:
        if self.recovery_mode not in RECOVERY_MODES:
            self._error("recovery_mode", f"{self.recovery_mode!r}: expected one of {', '.join(RECOVERY_MODES)}")
        if self.checkpoint_version is not None and self.checkpoint_version < 1:
            # Megatron-LM reads ckpt_step 0 as "not given", and no run commits iteration 0.
            self._error("checkpoint_version", f"{self.checkpoint_version}: expected an iteration, 1 or more")
        interval = self.checkpoint_interval
        if interval is not None and not (interval > 0 and math.isfinite(interval)):
            self._error("checkpoint_interval", f"{interval}: expected a positive number of seconds")

    @staticmethod
    def _error(field_name: str, message: str) -> None:
        raise CheckpointConfigError(f"{field_flag(CheckpointConfig, field_name)} {message}")


def add_rank_map_args(group: argparse._ActionsContainer) -> None:
    """The flags, one per ``CheckpointConfig`` field."""
    add_field_flags(group, CheckpointConfig)


def checkpoint_config_from_args(args: argparse.Namespace) -> CheckpointConfig:
    """Build the config from ``args`` (``--save``/``--load`` included); raises ValueError naming
    the flag, and changes nothing on ``args``. What the flags need of others (``--save DIR``)
    is checked by the run config's rules (``runtime.run_config``)."""
    return CheckpointConfig(**field_values(args, CheckpointConfig), save=args.save, load=load_directory(args),
                            save_interval=getattr(args, "save_interval", None),
                            keep_last=getattr(args, "keep_last", None))


def load_directory(args: argparse.Namespace) -> str | None:
    """Where the run loads from, under both front-ends: ``--load``, or with ``--auto-resume``
    and no ``--load`` the job's own ``--save`` (its first attempt finds nothing there and
    starts from scratch)."""
    return args.save if args.auto_resume and not args.load else args.load
