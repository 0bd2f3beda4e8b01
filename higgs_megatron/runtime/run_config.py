"""The run's typed config: one tree, built once from the parsed flags, that the runtime reads.

    RunConfig
      compression  HiggsConfig, or None without --use-higgs    (--use-higgs, --higgs-*)
      checkpoint   CheckpointConfig                            (--save, --load, --recovery-mode, ...)
      stability    StabilityConfig, the faults parsed          (--higgs-step-timeout, --inject-fault, ...)
      memory       MemoryConfig                                (--higgs-offload*, --higgs-block-allocator)
      elastic      ElasticConfig, or None without --higgs-replicas (--higgs-replicas, --higgs-replica-id, ...)

Each node is a dataclass whose fields declare their flags (``field_flags``), defaults and
help, and check their own values. What a flag needs of another ("--higgs-restart-timeout
needs --higgs-step-timeout") is not checked in the nodes but in one table, ``RULES``, read by
both front-ends and rendered into the docs (``scripts/flag_tables.py``). ``run_config_from_args``
applies the rules, then builds the nodes; it raises ``UsageError`` (exit 2) naming the flag,
before anything is created.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from ..checkpoint.flags import CheckpointConfig, checkpoint_config_from_args
from ..compat.symbols import SymbolMismatch, check_symbols
from ..compat.versions import UntestedMegatron, check_megatron_core
from ..config import HiggsConfig, compression_flags_given, higgs_config_from_args
from ..field_flags import field_values
from ..logs import get_logger
from ..schedule import why_not_onebit
from ..elastic.flags import ElasticConfig, elastic_config_from_args, elastic_flags_given
from ..memory.flags import MemoryConfig, memory_config_from_args, offload_flags_given
from ..stability.flags import StabilityConfig, stability_config_from_args
from .exits import UsageError

log = get_logger(__name__)

PRETRAIN = "our pretrain script"  # examples/pretrain_gpt.py
MEGATRON_LM = "Megatron-LM"  # Megatron-LM's pretrain_gpt.py under the patches
FRONT_ENDS = (PRETRAIN, MEGATRON_LM)


@dataclass(frozen=True)
class RunConfig:
    """What one run asks of the runtime (see the module docstring)."""

    compression: HiggsConfig | None
    checkpoint: CheckpointConfig
    stability: StabilityConfig
    memory: MemoryConfig
    elastic: ElasticConfig | None = None


def _flag(name: str, given: Callable[[argparse.Namespace], object]) -> Callable[[argparse.Namespace], list[str]]:
    return lambda args: [name] if given(args) not in (None, False) else []


@dataclass(frozen=True)
class Rule:
    """Flags that need something else: ``given(args)`` names those given, ``met(args)``
    whether what they need is there."""

    flags: str  # as the docs show them
    needs: str  # as a user writes it
    given: Callable[[argparse.Namespace], list[str]]
    met: Callable[[argparse.Namespace], bool]
    why: str = ""
    front_ends: tuple[str, ...] = FRONT_ENDS
    word: str = "needs"  # "only with": a feature's settings without the feature

    def problem(self, args: argparse.Namespace) -> str | None:
        given = self.given(args)
        if not given or self.met(args):
            return None
        return f"{', '.join(given)}: {self.word} {self.needs}" + (f" ({self.why})" if self.why else "")


def _saves(args: argparse.Namespace) -> bool:
    return bool(args.save)


RULES: tuple[Rule, ...] = (
    Rule("--higgs-* (compression)", "--use-higgs", compression_flags_given, lambda a: a.use_higgs,
         "the compressed sync's settings; without --use-higgs it is off", front_ends=(PRETRAIN,), word="only with"),
    Rule("--higgs-step-timeout", "--use-higgs", _flag("--higgs-step-timeout", lambda a: a.higgs_step_timeout),
         lambda a: a.use_higgs, "it bounds the compressed sync's waits", front_ends=(PRETRAIN,)),
    Rule("--higgs-restart-timeout", "--higgs-step-timeout",
         _flag("--higgs-restart-timeout", lambda a: a.higgs_restart_timeout),
         lambda a: a.higgs_step_timeout is not None),
    Rule("--save-interval", "--save DIR", _flag("--save-interval", lambda a: a.save_interval), _saves,
         front_ends=(PRETRAIN,)),
    Rule("--checkpoint-interval", "--save DIR", _flag("--checkpoint-interval", lambda a: a.checkpoint_interval),
         _saves),
    Rule("--async-checkpoint", "--save DIR", _flag("--async-checkpoint", lambda a: a.async_checkpoint), _saves),
    Rule("--auto-resume", "--save DIR", _flag("--auto-resume", lambda a: a.auto_resume), _saves),
    Rule("--checkpoint-version", "--load DIR", _flag("--checkpoint-version", lambda a: a.checkpoint_version),
         lambda a: bool(a.load), "the checkpoints to choose from"),
    Rule("--higgs-offload-* (memory)", "--higgs-offload", offload_flags_given, lambda a: a.higgs_offload,
         word="only with"),
    Rule("--higgs-freeze-adam-variance", "--optimizer adam",
         _flag("--higgs-freeze-adam-variance", lambda a: a.higgs_freeze_adam_variance),
         lambda a: a.optimizer == "adam", "it freezes Adam's second moment"),
    Rule("--num-distributed-optimizer-instances N > 1", "--use-distributed-optimizer",
         _flag("--num-distributed-optimizer-instances", lambda a: a.num_distributed_optimizer_instances > 1),
         lambda a: a.use_distributed_optimizer, front_ends=(PRETRAIN,)),
    Rule("--higgs-replicas", "--use-higgs", elastic_flags_given, lambda a: a.use_higgs,
         "the replicas' gradients meet in the compressed sync's buckets (--higgs-compressor none: dense)",
         front_ends=(PRETRAIN,)),
    Rule("--higgs-replicas", "our pretrain script (examples/pretrain_gpt.py)", elastic_flags_given, lambda a: False,
         "elastic replicas are not built into Megatron-LM's training loop", front_ends=(MEGATRON_LM,),
         word="is only in"),
)


def _onebit(args: argparse.Namespace) -> bool:
    return bool(args.use_higgs) and args.higgs_sync == "onebit"


_ONEBIT = _flag("--higgs-sync onebit", _onebit)
RULES += (
    Rule("--higgs-sync onebit", "--optimizer adam", _ONEBIT, lambda a: a.optimizer == "adam",
         "it exchanges Adam's first moment"),
    Rule("--higgs-sync onebit", "--higgs-replicas", _ONEBIT, lambda a: not elastic_flags_given(a),
         "a replica's share of the first moment is sized by the quorum", front_ends=(PRETRAIN,),
         word="does not work with"),
    Rule("--higgs-sync onebit", "--higgs-offload", _ONEBIT, lambda a: not a.higgs_offload,
         "the sync reads Adam's first moment on the device in the backward pass", word="does not work with"),
    Rule("--higgs-sync onebit", "--num-distributed-optimizer-instances N > 1", _ONEBIT,
         lambda a: a.num_distributed_optimizer_instances == 1,
         "across the instances the compressed exchange is the hierarchical top-k form", word="does not work with"),
)


def onebit_refused(args: argparse.Namespace, front_end: str) -> str | None:
    """Why the run's flags rule out 1-bit Adam's exchange, the default sync (the rules above
    that name ``--higgs-sync onebit``, read as reasons), or None."""
    chosen = argparse.Namespace(**{**vars(args), "higgs_sync": "onebit"})
    for rule in RULES:
        if rule.given is _ONEBIT and front_end in rule.front_ends:
            problem = rule.problem(chosen)
            if problem:
                return "1-bit Adam's exchange " + problem.removeprefix("--higgs-sync onebit: ")
    return None


def check_rules(args: argparse.Namespace, front_end: str) -> None:
    """The first rule of ``front_end`` that ``args`` breaks, as a ``UsageError``."""
    for rule in RULES:
        if front_end in rule.front_ends:
            problem = rule.problem(args)
            if problem:
                raise UsageError(problem)


def run_config_from_args(args: argparse.Namespace, front_end: str, world_size: int | None,
                         train_iters: int, lr_warmup_iters: int) -> RunConfig:
    """The rules, then the tree; ``UsageError`` naming the flag. ``train_iters`` and
    ``lr_warmup_iters`` are the run's length as the front-end counts it (the compression
    schedule is cut from it); ``world_size`` None leaves injected faults' ranks unchecked.
    Changes nothing on ``args``. First of all, the installed megatron-core: a release not
    tested (unless ``--higgs-allow-untested-megatron``), or one whose private symbols we rely on
    changed (whatever the flags), is refused here, before any process group exists."""
    try:
        check_megatron_core(getattr(args, "higgs_allow_untested_megatron", False))
        check_symbols()
    except (UntestedMegatron, SymbolMismatch) as error:
        raise UsageError(str(error)) from None
    check_rules(args, front_end)
    try:
        compression = None
        if args.use_higgs:
            why = None if args.higgs_sync is not None else why_not_onebit(
                field_values(args, HiggsConfig), lr_warmup_iters, onebit_refused(args, front_end))
            fallback = "sparse" if elastic_flags_given(args) else "auto"  # across replicas: each rank's own top-k
            compression = higgs_config_from_args(args, train_iters, lr_warmup_iters, why, fallback)
            if why:
                log.info(f"--use-higgs: the top-k forms (--higgs-sync {fallback}) instead of 1-bit Adam's exchange, the "
                         f"default: {why}")
        return RunConfig(
            compression=compression,
            checkpoint=checkpoint_config_from_args(args),
            stability=stability_config_from_args(args, world_size),
            memory=memory_config_from_args(args),
            elastic=elastic_config_from_args(args),
        )
    except ValueError as error:  # each node's own checks (ConfigError, OffloadError...) name the flag
        raise UsageError(str(error)) from None
