"""The memory manager's command-line flags, and the config (or the error) they make."""

from __future__ import annotations

import argparse

import torch

from ..given_flags import flags_given
from .manager import OFFLOAD_DEVICES, OffloadConfig, OffloadError
from .probe import ScriptedProbe

BLOCK_ALLOCATORS = ("off", "expandable")


def add_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = OffloadConfig()
    g = parser.add_argument_group("higgs: optimizer state off the device while memory runs short")
    g.add_argument("--higgs-offload", action="store_true",
                   help="move optimizer state (moments, fp32 main params) off the device while peak device "
                        "memory use is above the threshold, back when it falls")
    g.add_argument("--higgs-offload-threshold", type=float, default=defaults.threshold,
                   help="fraction of device memory, in (0, 1)")
    g.add_argument("--higgs-offload-hysteresis", type=float, default=defaults.hysteresis,
                   help="state comes back only below threshold - hysteresis")
    g.add_argument("--higgs-offload-device", choices=OFFLOAD_DEVICES, default=defaults.device,
                   help="cpu: host memory; nvme: files under --higgs-offload-dir")
    g.add_argument("--higgs-offload-dir", default=None, metavar="DIR", help="where the nvme tier writes its files")
    g.add_argument("--no-higgs-pin-memory", dest="higgs_pin_memory", action="store_false",
                   help="pageable host copies (pinned memory is faster to a GPU but never reclaimable)")
    g.add_argument("--higgs-pin-memory-limit-gb", type=float, default=None,
                   help="cap on this rank's pinned host copies (default: a quarter of host memory, shared by this "
                        "host's ranks); beyond it, pageable")
    g.add_argument("--higgs-offload-schedule", default=None, metavar="F[xN],...",
                   help="replay this device-memory schedule (one fraction per step, e.g. 0.5x3,0.95x2,0.6) "
                        "instead of measuring: for tests and what-ifs")
    g.add_argument("--higgs-block-allocator", choices=BLOCK_ALLOCATORS, default="off",
                   help="expandable: CUDA caching allocator with expandable segments (fewer fragmented blocks)")
    return parser


def offload_config_from_args(args: argparse.Namespace) -> OffloadConfig | None:
    """The config, None without --higgs-offload; ``OffloadError`` naming the flag otherwise."""
    if not args.higgs_offload:
        # --higgs-block-allocator configures CUDA's allocator with or without the manager.
        given = flags_given(args, add_offload_args(argparse.ArgumentParser()),
                            skip=("higgs_offload", "higgs_block_allocator"))
        if given:
            raise OffloadError(f"{', '.join(given)}: only with --higgs-offload")
        return None
    if args.higgs_pin_memory_limit_gb is not None and args.higgs_pin_memory_limit_gb < 0:
        raise OffloadError(f"--higgs-pin-memory-limit-gb {args.higgs_pin_memory_limit_gb}: expected 0 or more")
    if args.higgs_offload_schedule is not None:
        try:
            ScriptedProbe.parse(args.higgs_offload_schedule)
        except ValueError as error:
            raise OffloadError(f"--higgs-offload-schedule {args.higgs_offload_schedule!r}: {error}") from None
    limit = args.higgs_pin_memory_limit_gb
    return OffloadConfig(threshold=args.higgs_offload_threshold, hysteresis=args.higgs_offload_hysteresis,
                         device=args.higgs_offload_device, directory=args.higgs_offload_dir,
                         pin_memory=args.higgs_pin_memory,
                         pin_limit_bytes=None if limit is None else int(limit * (1 << 30)))


def apply_block_allocator(choice: str) -> bool:
    """``--higgs-block-allocator``: configure CUDA's caching allocator; call before the first
    CUDA allocation. False when there is nothing to configure (``off``, or no CUDA)."""
    if choice == "expandable" and torch.cuda.is_available():
        # One growing segment per stream instead of fixed blocks.
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        return True
    return False
