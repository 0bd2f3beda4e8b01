"""The stability flags both front-ends add, generated from one dataclass and checked once.

Our pretrain script adds them to its parser; the Megatron-LM patches add them to Megatron-LM's.
``check_stability`` raises ``ValueError`` naming the flag; each front-end turns that into
its own usage error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..field_flags import add_field_flags
from ..field_flags import flag_metadata as _flag
from .faults import Fault, FaultSpecError, parse_fault

DEFAULT_RESTART_TIMEOUT = 300.0


@dataclass(frozen=True)
class StabilityConfig:
    """The stability flags' fields (checked by ``check_stability``, which needs the launch too)."""

    higgs_step_timeout: float | None = field(default=None, metadata=_flag(
        "--higgs-step-timeout", "warn about ranks that make no progress for this long, and give up on a gradient "
        "sync that takes longer: every rank drops the step, rebuilds its data-parallel groups and runs the "
        "iteration again (a progress alignment)", type=float, metavar="SECONDS"))
    higgs_restart_timeout: float | None = field(default=None, metadata=_flag(
        "--higgs-restart-timeout", "with --higgs-step-timeout: a rank that waits this long for another (in the "
        "step's vote, or stuck anywhere as the watchdog sees it) exits with status 75, so that torchrun "
        f"--max-restarts restarts the job (default: the longer of {DEFAULT_RESTART_TIMEOUT:g} s and two step "
        "timeouts)", type=float, metavar="SECONDS"))
    inject_fault: list[str] | None = field(default=None, metadata=_flag(
        "--inject-fault", "inject a fault (hang, slow, freeze, sigterm, crash, nan) on a rank at an iteration; "
        "repeatable", action="append", metavar="KIND@RANK:ITER[:SECONDS]"))


def add_stability_args(group: argparse._ActionsContainer) -> None:
    """``--higgs-step-timeout``, ``--higgs-restart-timeout`` and ``--inject-fault``, one per
    ``StabilityConfig`` field."""
    add_field_flags(group, StabilityConfig)


def check_stability(args: argparse.Namespace, world_size: int | None, use_higgs: bool) -> list[Fault]:
    """The parsed ``--inject-fault`` specs (``world_size`` None: ranks unchecked); raises
    ValueError naming the flag, and changes nothing. (The faults are not put on ``args``:
    Megatron-LM pickles its args into checkpoints, which are read back weights-only.)"""
    if args.higgs_step_timeout is not None and not use_higgs:
        raise ValueError("--higgs-step-timeout needs --use-higgs (it bounds the compressed sync's waits)")
    for flag in ("higgs_step_timeout", "higgs_restart_timeout"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.higgs_restart_timeout is not None and args.higgs_step_timeout is None:
        raise ValueError("--higgs-restart-timeout needs --higgs-step-timeout")
    if args.higgs_restart_timeout is not None and args.higgs_restart_timeout <= args.higgs_step_timeout:
        raise ValueError(f"--higgs-restart-timeout {args.higgs_restart_timeout:g} must be longer than "
                         f"--higgs-step-timeout {args.higgs_step_timeout:g}")
    try:
        return [parse_fault(spec, world_size) for spec in args.inject_fault or ()]
    except FaultSpecError as error:
        raise ValueError(str(error)) from None


def restart_timeout(args: argparse.Namespace) -> float | None:
    """``--higgs-restart-timeout``, or its default: the longer of 300 s and two step timeouts."""
    if args.higgs_step_timeout is None:
        return None
    if args.higgs_restart_timeout is not None:
        return args.higgs_restart_timeout
    return max(DEFAULT_RESTART_TIMEOUT, 2 * args.higgs_step_timeout)
