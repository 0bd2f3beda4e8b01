"""The rank-map checkpoint flags both front-ends add, declared once with one set of defaults.

Our pretrain script adds them beside ``--save``/``--load``; the Megatron-LM patches add them to
Megatron-LM's parser, whose own ``--save``, ``--load`` and ``--save-interval`` they extend.
"""

from __future__ import annotations

import argparse

from .validation import RECOVERY_MODES


def add_rank_map_args(group: argparse._ArgumentGroup, async_help: str) -> None:
    """``--recovery-mode``, ``--checkpoint-version``, ``--async-checkpoint`` (``async_help``
    says what the front-end's background save is), ``--checkpoint-interval`` and ``--auto-resume``."""
    group.add_argument("--recovery-mode", choices=RECOVERY_MODES, default="same-sharding",
                       help="on --load: same-sharding refuses a checkpoint saved with another layout, naming each "
                            "difference; reshard loads it into this layout")
    group.add_argument("--checkpoint-version", type=int, default=None, metavar="ITER",
                       help="load the committed checkpoint of this iteration instead of the latest")
    group.add_argument("--async-checkpoint", action="store_true", help=async_help)
    group.add_argument("--checkpoint-interval", type=float, default=None, metavar="SECONDS",
                       help="also save when this much wall-clock time has passed since the last save "
                            "(decided together by all ranks)")
    group.add_argument("--auto-resume", action="store_true",
                       help="resume from the latest committed checkpoint in --save if there is one (--load defaults "
                            "to --save): what a job restarted by torchrun --max-restarts needs")
