"""Every private megatron-core symbol this package overrides, swaps or calls, and what of it we rely on.

Each entry names a module attribute (``module:qualname``) and, for a callable, the leading
parameters our code passes or overrides, in order. ``check_symbols`` reads them all before
any model is built: a release that renamed or reshaped one is refused, naming it, however
the version check was answered (``--higgs-allow-untested-megatron`` skips only that one).
Front-ends add their own (the Megatron-LM patches' rebinding targets) through ``extra``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Symbol:
    """``module:qualname``; ``params``: the leading parameter names we rely on (None: only that it exists)."""

    path: str
    params: tuple[str, ...] | None = None
    why: str = ""

    def problem(self) -> str | None:
        """What is wrong with this symbol in the installed release (None: as we expect)."""
        module_name, qualname = self.path.split(":")
        try:
            value = importlib.import_module(module_name)
            for part in qualname.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError):
            return f"{self.path} is missing ({self.why})"
        if self.params is None:
            return None
        try:
            names = list(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            return f"{self.path} is not a callable with a signature ({self.why})"
        if names[:len(self.params)] != list(self.params):
            return f"{self.path} takes ({', '.join(names)}); expected ({', '.join(self.params)}, ...) ({self.why})"
        return None


_BUCKETS = "megatron.core.distributed.param_and_grad_buffer"
_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"

MEGATRON_CORE = (
    Symbol(f"{_BUCKETS}:_ParamAndGradBucketGroup.__init__",
           ("self", "buckets", "ddp_config", "collective_group", "collective_group_size"),
           "ddp.HiggsBucketGroup: each bucket group's class is swapped after construction"),
    Symbol(f"{_BUCKETS}:_ParamAndGradBucketGroup.start_grad_sync", ("self", "force_all_reduce"),
           "ddp.HiggsBucketGroup overrides it: the compressed reduction"),
    Symbol(f"{_BUCKETS}:_ParamAndGradBucketGroup.finish_grad_sync", ("self", "force_all_reduce"),
           "ddp.HiggsBucketGroup overrides it with several optimizer instances"),
    Symbol(f"{_BUCKETS}:_ParamAndGradBucketGroup.check_grads", ("self", "check_for_nan_or_inf", "check_for_large"),
           "called by ddp.HiggsBucketGroup before its reduction"),
    Symbol(f"{_BUCKETS}:shard_buffer", ("buffer", "data_parallel_world_size"),
           "ddp.HiggsBucketGroup's dense reduce-scatter into this rank's shard"),
    Symbol("megatron.core.distributed:DistributedDataParallel.__init__",
           ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection"), "ddp.HiggsDDP subclasses it"),
    Symbol("megatron.core.distributed:DistributedDataParallel.finish_grad_sync", ("self", "force_all_reduce"),
           "ddp.HiggsDDP overrides it: the routing bias is copied as the sync finishes"),
    Symbol("megatron.core.distributed.finalize_model_grads:_update_router_expert_bias", None,
           "expert_bias: Megatron moves the routing bias after the sync, which HiggsDDP settles at the next forward"),
    Symbol("megatron.core.transformer.moe.router:TopKRouter", None,
           "expert_bias.KeptExpertBias reads its expert_bias buffer"),
    Symbol(f"{_FS_ASYNC}:_results_queue", None, "checkpoint.save.thread_results_queue swaps the writer's queue"),
    Symbol(f"{_FS_ASYNC}:FileSystemWriterAsync.write_preloaded_data",
           ("transform_list", "local_proc_idx", "write_bucket", "results_queue", "count_queue", "use_fsync"),
           "checkpoint.async_save writes each bucket through it on its own thread"),
    Symbol(f"{_DISTOPT}:DistributedOptimizer._set_main_param_and_optimizer_states", ("self", "model_param", "tensors"),
           "checkpoint.state swaps it for torch Adam's step counter"),
    Symbol(f"{_DISTOPT}:DistributedOptimizer._get_main_param_and_optimizer_states", ("self", "model_param"),
           "checkpoint.state reads each parameter's optimizer state through it"),
    Symbol(f"{_DISTOPT}:DistributedOptimizer.sharded_state_dict",
           ("self", "model_sharded_state_dict", "is_loading", "sharding_type", "metadata"),
           "checkpoint.state swaps it for a reshardable layout"),
    Symbol(f"{_DISTOPT}:DistributedOptimizer.sharded_param_state_fully_reshardable",
           ("self", "model_sharded_state_dict", "is_loading", "metadata"), "checkpoint.state swaps it"),
    Symbol("megatron.core.parallel_state:_global_process_group_list", None,
           "compat.groups swaps a rebuilt data-parallel group into the list of every group"),
    Symbol("megatron.core.process_groups_config:ProcessGroupCollection", None,
           "compat.groups swaps rebuilt groups into the modules' pg_collection"),
    Symbol("megatron.core.optimizer:get_megatron_optimizer", ("config", "model_chunks"),
           "both front-ends build Megatron's optimizer through it"),
)


class SymbolMismatch(RuntimeError):
    """A private symbol we rely on is missing or reshaped in the installed release."""


def symbol_problems(extra: Iterable[Symbol] = ()) -> list[str]:
    """What is wrong with ``MEGATRON_CORE`` and ``extra`` in the installed releases."""
    return [problem for symbol in (*MEGATRON_CORE, *extra) if (problem := symbol.problem()) is not None]


def check_symbols(extra: Iterable[Symbol] = ()) -> None:
    """Raise ``SymbolMismatch`` naming every symbol that is not as we rely on it."""
    problems = symbol_problems(extra)
    if problems:
        raise SymbolMismatch("the installed megatron-core does not have what higgs-megatron relies on: "
                             + "; ".join(problems))
