"""The elastic-replica flags, generated from one dataclass and checked once.

``--higgs-replicas R`` turns the mode on: the job is R data-parallel replicas, each its own
torchrun of TP x PP ranks (data-parallel size 1 inside), kept together by a torchft Lighthouse
(``--higgs-lighthouse``). Without it nothing here is read and the job is one torchrun, as always.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from ..field_flags import add_field_flags, field_values
from ..field_flags import flag_metadata as _flag

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the Lighthouse's address


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic-replica flags' fields (see the module docstring)."""

    higgs_replicas: int | None = field(default=None, metadata=_flag(
        "--higgs-replicas", "elastic data-parallel replicas: the job is R replicas, each one torchrun of TP x PP "
        "ranks; a replica that dies or hangs is dropped from the quorum and the others keep training, and it heals "
        "from a live peer when it comes back (docs/stability.md)", type=int, metavar="R"))
    higgs_replica_id: int | None = field(default=None, metadata=_flag(
        "--higgs-replica-id", "with --higgs-replicas: this torchrun's replica, 0 to R-1 (its share of each global "
        "batch)", type=int, metavar="D"))
    higgs_lighthouse: str | None = field(default=None, metadata=_flag(
        "--higgs-lighthouse", f"with --higgs-replicas: the torchft Lighthouse's address, http://HOST:PORT (default: "
        f"${LIGHTHOUSE_ENV})", metavar="URL"))
    higgs_min_replicas: int = field(default=1, metadata=_flag(
        "--higgs-min-replicas", "with --higgs-replicas: a step is kept only when at least this many replicas took "
        "part in it", type=int, metavar="N"))

    def __post_init__(self) -> None:
        if self.higgs_replicas is None:
            return
        if self.higgs_replicas < 1:
            raise ValueError(f"--higgs-replicas must be at least 1, got {self.higgs_replicas}")
        if self.higgs_replica_id is None or not 0 <= self.higgs_replica_id < self.higgs_replicas:
            raise ValueError(f"--higgs-replica-id: expected 0 to {self.higgs_replicas - 1} with --higgs-replicas "
                             f"{self.higgs_replicas}, got {self.higgs_replica_id}")
        if not 1 <= self.higgs_min_replicas <= self.higgs_replicas:
            raise ValueError(f"--higgs-min-replicas: expected 1 to --higgs-replicas {self.higgs_replicas}, got "
                             f"{self.higgs_min_replicas}")
        if not self.lighthouse:
            raise ValueError(f"--higgs-replicas needs the torchft Lighthouse's address: --higgs-lighthouse "
                             f"http://HOST:PORT or ${LIGHTHOUSE_ENV}")

    @property
    def lighthouse(self) -> str | None:
        return self.higgs_lighthouse or os.environ.get(LIGHTHOUSE_ENV)


def add_elastic_args(group: argparse._ActionsContainer) -> None:
    """One flag per ``ElasticConfig`` field."""
    add_field_flags(group, ElasticConfig)


def elastic_config_from_args(args: argparse.Namespace) -> ElasticConfig | None:
    """The config, None without ``--higgs-replicas``; ValueError naming the flag."""
    values = field_values(args, ElasticConfig)
    if values["higgs_replicas"] is None:
        given = [name for name in ("higgs_replica_id", "higgs_lighthouse") if values[name] is not None]
        if given or values["higgs_min_replicas"] != 1:
            names = [f"--{name.replace('_', '-')}" for name in given] or ["--higgs-min-replicas"]
            raise ValueError(f"{', '.join(names)}: only with --higgs-replicas")
        return None
    return ElasticConfig(**values)


def elastic_flags_given(args: argparse.Namespace) -> list[str]:
    """The elastic flags given (``run_config``'s rules name them)."""
    return ["--higgs-replicas"] if getattr(args, "higgs_replicas", None) is not None else []
