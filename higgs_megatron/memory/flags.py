"""The memory manager's command-line flags, and the config (or the error) they make."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..field_flags import add_field_flags, field_values
from ..given_flags import flags_given
from .manager import OffloadConfig, OffloadError
from .probe import ScriptedProbe

BLOCK_ALLOCATORS = ("off", "expandable")


@dataclass(frozen=True)
class MemoryConfig:
    """What the memory flags ask for: the manager's config (None without ``--higgs-offload``),
    a replayed memory schedule instead of measuring, and CUDA's block allocator."""

    offload: OffloadConfig | None = None
    schedule: str | None = None
    block_allocator: str = "off"


def add_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--higgs-offload``, one flag per ``OffloadConfig`` field (from its metadata, with its
    default), and the flags that are not config fields: the pinned-memory cap in GiB, the
    replayed schedule and the block allocator."""
    g = parser.add_argument_group("higgs: optimizer state off the device while memory runs short")
    g.add_argument("--higgs-offload", action="store_true",
                   help="move optimizer state (moments, fp32 main params) off the device while peak device "
                        "memory use is above the threshold, back when it falls")
    add_field_flags(g, OffloadConfig)
    g.add_argument("--higgs-pin-memory-limit-gb", type=float, default=None,
                   help="cap on this rank's pinned host copies, beyond which they are pageable (default: a quarter "
                        "of host memory, shared by this host's ranks)")
    g.add_argument("--higgs-offload-schedule", default=None, metavar="F[xN],...",
                   help="replay this device-memory schedule (one fraction per step, e.g. 0.5x3,0.95x2,0.6) "
                        "instead of measuring: for tests and what-ifs")
    g.add_argument("--higgs-block-allocator", choices=BLOCK_ALLOCATORS, default="off",
                   help="expandable: CUDA caching allocator with expandable segments (fewer fragmented blocks)")
    return parser


def offload_flags_given(args: argparse.Namespace) -> list[str]:
    """The memory manager's flags given (``--higgs-block-allocator``, which configures CUDA's
    allocator with or without the manager, aside): only with ``--higgs-offload``."""
    return flags_given(args, add_offload_args(argparse.ArgumentParser()),
                       skip=("higgs_offload", "higgs_block_allocator"))


def offload_config_from_args(args: argparse.Namespace) -> OffloadConfig | None:
    """The config, None without --higgs-offload; ``OffloadError`` naming the flag otherwise."""
    if not args.higgs_offload:
        return None
    if args.higgs_pin_memory_limit_gb is not None and args.higgs_pin_memory_limit_gb < 0:
        raise OffloadError(f"--higgs-pin-memory-limit-gb {args.higgs_pin_memory_limit_gb}: expected 0 or more")
    if args.higgs_offload_schedule is not None:
        try:
            ScriptedProbe.parse(args.higgs_offload_schedule)
        except ValueError as error:
            raise OffloadError(f"--higgs-offload-schedule {args.higgs_offload_schedule!r}: {error}") from None
    limit = args.higgs_pin_memory_limit_gb
    return OffloadConfig(**field_values(args, OffloadConfig),
                         pin_limit_bytes=None if limit is None else int(limit * (1 << 30)))


def memory_config_from_args(args: argparse.Namespace) -> MemoryConfig:
    """The memory flags' config; ``OffloadError`` naming the flag."""
    return MemoryConfig(offload=offload_config_from_args(args), schedule=args.higgs_offload_schedule,
                        block_allocator=args.higgs_block_allocator)


def apply_block_allocator(choice: str) -> bool:
    """``--higgs-block-allocator``: configure CUDA's caching allocator; call before the first
    CUDA allocation. False when there is nothing to configure (``off``, or no CUDA)."""
    if choice == "expandable" and torch.cuda.is_available():
        # One growing segment per stream instead of fixed blocks.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        return True
    return False
