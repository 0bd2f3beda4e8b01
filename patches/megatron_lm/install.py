"""Where the patches enter Megatron-LM's training code, and when.

Megatron-LM's ``megatron.training.training`` imports by name what it builds a run from
(``DDP``, ``get_megatron_optimizer``, ``save_checkpoint``, ``load_checkpoint``,
``train_step``, ``checkpoint_and_decide_exit``); rebinding those names in that module, before
``pretrain()`` uses them, changes what it builds without editing or copying its code.
Nothing is rebound for good: every original is kept and ``uninstall()`` restores it.

Two stages:

1. ``install()``, before ``pretrain_gpt.py`` runs: ``megatron.training.pretrain`` becomes a
   wrapper that chains our flags after the ``extra_args_provider`` the script passes, and
   ``initialize.parse_args`` a wrapper that checks our flags right after Megatron-LM has
   parsed (``arguments.translate_args``). Without ``--use-higgs`` that is all: Megatron-LM
   runs as unpatched.
2. ``activate(args)``, with ``--use-higgs``, still before any process group exists:
   * ``DDP`` becomes HiggsDDP bound to the run's ``HiggsConfig`` (a subclass, so Megatron-LM's
     ``isinstance(model_chunk, DDP)`` checks keep holding);
   * ``get_megatron_optimizer`` returns the optimizer wrapped by ``wrap_optimizer``;
   * ``train_step`` runs under the stability layer (``stability.StepRunner``: injected faults,
     progress phases for the watchdog, the step's bounded decision, progress alignments that
     run the iteration again on the same data) and adds, per iteration, the bytes HiggsDDP handed to collectives, the dense
     equivalent, the density in force and the compression time to the loss dict Megatron-LM
     logs (so they appear in its iteration line, TensorBoard and W&B as "higgs ..." values,
     per rank per step);
   * ``save_checkpoint`` / ``load_checkpoint`` / ``checkpointing.generate_state_dict`` /
     ``checkpointing.schedule_async_save`` go through ``rank_map.RankMapHooks``;
   * with ``--checkpoint-interval``, ``checkpoint_and_decide_exit`` also saves when that much
     wall-clock time has passed since the last save, as agreed by a MAX all-reduce;
   * with ``--higgs-offload``, the memory manager is attached to the optimizer
     ``get_megatron_optimizer`` returns, and each rank prints its own moves.
"""

from __future__ import annotations

import atexit
import logging
import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

import megatron.training as megatron_training
import megatron.training.checkpointing as checkpointing
import megatron.training.initialize as initialize
import megatron.training.training as training

from higgs_megatron import HiggsConfig, HiggsDDP, wrap_optimizer
from higgs_megatron.checkpoint.interval import SaveSchedule
from higgs_megatron.ddp import sync_traffic
from higgs_megatron.device import collective_device
from higgs_megatron.logs import get_logger, log_single_rank, setup_logging
from higgs_megatron.memory import MemoryManager
from higgs_megatron.memory.flags import apply_block_allocator, offload_config_from_args
from higgs_megatron.runtime.exits import UsageError, report_usage_error
from higgs_megatron.runtime.offload import attach_offload
from higgs_megatron.launcher import launcher_rank
from higgs_megatron.stability.regroup import prepare_backend

from .cpu import cpu_flag_problems
from .arguments import chain_args_providers, translate_args
from .rank_map import RankMapHooks
from .stability import StepRunner, build_resilience

_originals: dict[tuple[Any, str], Any] = {}


log = get_logger("higgs_megatron.patches.install")

def _rebind(owner: Any, name: str, value: Any) -> None:
    _originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before the patches."""
    return _originals.get((owner, name), getattr(owner, name))


def uninstall() -> None:
    """Put every rebound name back."""
    for (owner, name), value in _originals.items():
        setattr(owner, name, value)
    _originals.clear()


def install() -> None:
    """Stage 1 (see the module docstring)."""
    _rebind(megatron_training, "pretrain", _pretrain)
    _rebind(training, "pretrain", _pretrain)
    _rebind(initialize, "parse_args", _parse_args)


@functools.wraps(training.pretrain)
def _pretrain(*args: Any, **kwargs: Any) -> Any:
    pretrain = original(training, "pretrain")
    bound = inspect.signature(pretrain).bind(*args, **kwargs)
    bound.arguments["extra_args_provider"] = chain_args_providers(bound.arguments.get("extra_args_provider"))
    return pretrain(*bound.args, **bound.kwargs)


def _parse_args(*args: Any, **kwargs: Any) -> Any:
    parsed = original(initialize, "parse_args")(*args, **kwargs)
    try:
        if not torch.cuda.is_available():
            missing = cpu_flag_problems(parsed)
            if missing:
                raise UsageError(f"on a machine without CUDA, pretrain_gpt.py needs {' '.join(missing)}")
        config = translate_args(parsed)
    except UsageError as error:
        # said here, whoever launched Megatron-LM (ours says nothing more: exits.exit_status)
        usage = UsageError(f"pretrain_gpt.py: error: {error}")
        report_usage_error(usage)
        raise usage from None
    if config is not None:
        activate(parsed, config)
    return parsed


def higgs_ddp_class(config: HiggsConfig) -> type:
    """HiggsDDP with the run's config bound, constructed as Megatron-LM constructs its DDP."""

    class MegatronLMHiggsDDP(HiggsDDP):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, higgs_config=config, **kwargs)

    MegatronLMHiggsDDP.__qualname__ = "HiggsDDP"
    return MegatronLMHiggsDDP


def activate(args: Any, config: HiggsConfig) -> None:
    """Stage 2 (see the module docstring)."""
    hooks = RankMapHooks(args, config)
    apply_block_allocator(args.higgs_block_allocator)  # before process groups: no CUDA allocation yet
    if args.higgs_step_timeout is not None:
        prepare_backend(args.distributed_backend)  # before process groups: NCCL's error handling
    _rebind(training, "DDP", higgs_ddp_class(config))
    _rebind(training, "get_megatron_optimizer", _get_megatron_optimizer)
    _rebind(training, "train_step", _train_step)
    _rebind(training, "save_checkpoint", functools.partial(
        _save_then_settle, functools.partial(hooks.save_checkpoint, original(training, "save_checkpoint"))))
    _rebind(training, "load_checkpoint", functools.partial(hooks.load_checkpoint, original(training, "load_checkpoint")))
    _rebind(checkpointing, "generate_state_dict",
            functools.partial(hooks.generate_state_dict, original(checkpointing, "generate_state_dict")))
    _rebind(checkpointing, "schedule_async_save",
            functools.partial(hooks.schedule_async_save, original(checkpointing, "schedule_async_save")))
    if args.checkpoint_interval is not None:
        _rebind(training, "checkpoint_and_decide_exit", _IntervalSaver(args.save_interval, args.checkpoint_interval))
    setup_logging()
    if launcher_rank() == 0:
        log.info(f" [higgs] HiggsDDP replaces Megatron's DDP ({config.compressor}, density {config.compression_ratio}, "
                 f"sync {config.sync}); checkpoints carry a rank map (--recovery-mode {args.recovery_mode})")


_memory: MemoryManager | None = None
_steps: StepRunner | None = None  # built with the optimizer


def _get_megatron_optimizer(config: Any, model_chunks: list, *args: Any, **kwargs: Any) -> Any:
    """The wrapped optimizer; with ``--higgs-offload``, the memory manager attached to it."""
    global _memory
    global _steps
    optimizer = wrap_optimizer(original(training, "get_megatron_optimizer")(config, model_chunks, *args, **kwargs),
                               model_chunks)
    margs = megatron_training.get_args()
    _steps = build_resilience(margs, model_chunks, optimizer)
    offload = offload_config_from_args(margs)  # validated in translate_args
    if offload is not None:
        _memory = attach_offload(optimizer, model_chunks, offload, margs.higgs_offload_schedule,
                                 on_event=_offload_event,
                                 say=lambda name, message, fields: log_single_rank(log, logging.INFO, f" [higgs]{message}"))
        atexit.register(_memory.close)  # state back, the nvme tier's files removed
    return optimizer


def _offload_event(name: str, message: str, **fields: Any) -> None:
    """Moves differ per rank (each reads its own device): every rank prints its own."""
    iteration = getattr(megatron_training.get_args(), "curr_iteration", 0) + 1
    log.info(f" [higgs] [rank {dist.get_rank()}] iteration {iteration}: {name}:{message}")


def _save_then_settle(save: Callable, *args: Any, **kwargs: Any) -> Any:
    """Once a save returns, it has what it needs of the state it brought back (an async
    save's host copy included: megatron-core's callers finish ``preload_fn`` before
    ``schedule_async_request`` returns, the persistent worker through its joined preload
    queue), so offloaded state leaves again now, not at the end of the next step."""
    if _steps is not None:
        _steps.checkpoint_phase()  # the watchdog lets a long write be
    result = save(*args, **kwargs)
    if _memory is not None:
        _memory.settle()
    return result


def _train_step(forward_step_func: Callable, data_iterator: Any, model: list, *args: Any, **kwargs: Any) -> tuple:
    train_step = original(training, "train_step")
    if _steps is not None:
        result = _steps(train_step, forward_step_func, data_iterator, model, *args, **kwargs)
    else:
        result = train_step(forward_step_func, data_iterator, model, *args, **kwargs)
    stats = sync_traffic(model)
    # One small host-to-device copy and one all-reduce per step, every rank: the mean over the
    # ranks (each pipeline stage counts its own chunks) of what Megatron-LM logs.
    totals = torch.tensor([stats.bytes_sent * 1e-6, stats.dense_bytes * 1e-6, stats.density,
                           stats.compress_seconds * 1e3, stats.wire_bytes * 1e-6, stats.dense_wire_bytes * 1e-6],
                          dtype=torch.float64, device=collective_device())
    dist.all_reduce(totals)
    totals = (totals / dist.get_world_size()).float()
    loss_dict = result[0]
    if loss_dict:  # the last pipeline stage logs; Megatron-LM reads these at its log interval
        totals = totals.to(next(iter(loss_dict.values())).device)
        for index, key in enumerate(("higgs MB sent", "higgs MB dense", "higgs density", "higgs compress ms",
                                     "higgs MB wire", "higgs MB dense wire")):
            loss_dict[key] = totals[index]
    return result


class _IntervalSaver:
    """``checkpoint_and_decide_exit`` that also saves every ``seconds`` of wall-clock time
    (``SaveSchedule``: Megatron-LM makes its own ``--save-interval`` saves)."""

    def __init__(self, save_interval: int | None, seconds: float) -> None:
        self.schedule = SaveSchedule(save_interval, seconds)

    def __call__(self, model: Any, optimizer: Any, scheduler: Any, iteration: int, flops: Any,
                 checkpointing_context: Any, train_data_iterator: Any) -> bool:
        regular = self.schedule.by_iteration(iteration)
        extra = not regular and self.schedule.by_wall_clock()
        if extra:
            training.save_checkpoint_and_time(iteration, model, optimizer, scheduler, flops, checkpointing_context,
                                              train_data_iterator=train_data_iterator)
        if extra or regular:
            self.schedule.saved()
        return original(training, "checkpoint_and_decide_exit")(
            model, optimizer, scheduler, iteration, flops, checkpointing_context, train_data_iterator)
