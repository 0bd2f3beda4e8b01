"""The stability flags both front-ends add, generated from one dataclass and checked once.

Our pretrain script adds them to its parser; the Megatron-LM patches add them to Megatron-LM's.
``stability_config_from_args`` raises ``ValueError`` naming the flag; the run config
(``runtime.run_config``) turns it into the usage error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ..field_flags import add_field_flags, field_values
from ..field_flags import flag_metadata as _flag
from .faults import Fault, FaultSpecError, parse_fault

DEFAULT_RESTART_TIMEOUT = 300.0
DEFAULT_ALIGNMENTS_IN_A_ROW = 3


@dataclass(frozen=True)
class StabilityConfig:
    """The stability flags' fields, and the faults ``--inject-fault`` parsed into
    (``stability_config_from_args``, which needs the launch's world size to check their ranks)."""

    higgs_step_timeout: float | None = field(default=None, metadata=_flag(
        "--higgs-step-timeout", "warn about ranks that make no progress for this long, and give up on a gradient "
        "sync that takes longer: every rank drops the step, rebuilds its data-parallel groups and runs the "
        "iteration again (a progress alignment)", type=float, metavar="SECONDS"))
    higgs_restart_timeout: float | None = field(default=None, metadata=_flag(
        "--higgs-restart-timeout", "with --higgs-step-timeout: a rank that waits this long for another (in the "
        "step's vote, or stuck anywhere as the watchdog sees it) exits with status 75, so that torchrun "
        f"--max-restarts restarts the job (default: the longer of {DEFAULT_RESTART_TIMEOUT:g} s and two step "
        "timeouts)", type=float, metavar="SECONDS"))
    higgs_max_alignments_in_a_row: int = field(default=DEFAULT_ALIGNMENTS_IN_A_ROW, metadata=_flag(
        "--higgs-max-alignments-in-a-row", "with --higgs-step-timeout: after this many progress alignments with no "
        "step kept between them (a rank that misses the step timeout on every attempt, or a timeout shorter than "
        "the sync itself), every rank exits with status 75 so that torchrun --max-restarts restarts the job",
        type=int, metavar="K"))
    inject_fault: list[str] | None = field(default=None, metadata=_flag(
        "--inject-fault", "inject a fault (hang, slow, freeze, sigterm, crash, nan) on a rank, or (kill-replica, "
        "stop-replica) on every rank of a data-parallel replica, at an iteration; repeatable", action="append", metavar="KIND@RANK:ITER[:SECONDS]"))
    faults: tuple[Fault, ...] = ()
    """``inject_fault`` parsed."""

    def __post_init__(self) -> None:
        for name in ("higgs_step_timeout", "higgs_restart_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.higgs_max_alignments_in_a_row < 1:
            raise ValueError("--higgs-max-alignments-in-a-row must be at least 1, got "
                             f"{self.higgs_max_alignments_in_a_row}")
        if self.higgs_restart_timeout is not None and self.higgs_step_timeout is not None \
                and self.higgs_restart_timeout <= self.higgs_step_timeout:
            raise ValueError(f"--higgs-restart-timeout {self.higgs_restart_timeout:g} must be longer than "
                             f"--higgs-step-timeout {self.higgs_step_timeout:g}")

    @property
    def restart_after(self) -> float | None:
        """``--higgs-restart-timeout``, or its default: the longer of 300 s and two step timeouts."""
        if self.higgs_step_timeout is None:
            return None
        if self.higgs_restart_timeout is not None:
            return self.higgs_restart_timeout
        return max(DEFAULT_RESTART_TIMEOUT, 2 * self.higgs_step_timeout)


def add_stability_args(group: argparse._ActionsContainer) -> None:
    """``--higgs-step-timeout``, ``--higgs-restart-timeout``, ``--higgs-max-alignments-in-a-row``
    and ``--inject-fault``, one per ``StabilityConfig`` field."""
    add_field_flags(group, StabilityConfig)


def stability_config_from_args(args: argparse.Namespace, world_size: int | None) -> StabilityConfig:
    """The config, its faults parsed (``world_size`` None: their ranks unchecked); raises
    ValueError naming the flag, and changes nothing on ``args`` (Megatron-LM pickles its args
    into checkpoints, which are read back weights-only). What the flags need of others is
    checked by the run config's rules (``runtime.run_config``)."""
    values = field_values(args, StabilityConfig)
    try:
        faults = tuple(parse_fault(spec, world_size, data_parallel_size(args, world_size))
                       for spec in values["inject_fault"] or ())
    except FaultSpecError as error:
        raise ValueError(str(error)) from None
    return StabilityConfig(**values, faults=faults)


def data_parallel_size(args: argparse.Namespace, world_size: int | None) -> int | None:
    """The data-parallel size the flags give ``world_size`` ranks (None without a world size)."""
    if getattr(args, "higgs_replicas", None) is not None:  # elastic: one torchrun per replica
        return args.higgs_replicas
    if world_size is None:
        return None
    model_parallel = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model_parallel *= getattr(args, name, None) or 1
    return max(1, world_size // model_parallel)
