"""Where the patches enter Megatron-LM's training code, and when.

Megatron-LM's ``megatron.training.training`` imports by name what it builds a run from
(``DDP``, ``get_megatron_optimizer``, ``save_checkpoint``, ``load_checkpoint``,
``train_step``, ``checkpoint_and_decide_exit``); rebinding those names in that module, before
``pretrain()`` uses them, changes what it builds without editing or copying its code.
Nothing is rebound for good: every original is kept (``higgs_megatron.compat.rebind``) and
``uninstall()`` restores it.

Two stages:

1. ``install()``, before ``pretrain_gpt.py`` runs, puts our flags into Megatron-LM's parser
   and checks them right after it has parsed, before its own validation
   (``arguments.translate_args``). Where depends on the release:
   * 0.16.1 parses inside ``pretrain()``: ``megatron.training.pretrain`` becomes a wrapper that
     chains our flags after the ``extra_args_provider`` the script passes, and
     ``initialize.parse_args`` a wrapper that checks them;
   * from 0.18 on the script parses before ``pretrain()``
     (``arguments.parse_and_validate_args``): ``arguments.parse_args`` becomes a wrapper that
     does both. Its other callers (the fault-tolerance and in-process-restart probes, which
     parse ignoring unknown flags) get the original.

   Without ``--use-higgs`` that is all: Megatron-LM runs as unpatched.
2. ``activate(args)``, with ``--use-higgs``, still before any process group exists:
   * ``DDP`` becomes HiggsDDP bound to the run's ``HiggsConfig`` (a subclass, so Megatron-LM's
     ``isinstance(model_chunk, DDP)`` checks keep holding); from 0.18 on, also the name the
     model builder wraps with (``models.dist_utils.DistributedDataParallel``), which is
     what ``pretrain_gpt.py``'s model config builds through;
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
import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist

import megatron.training as megatron_training
import megatron.training.arguments as arguments
import megatron.training.checkpointing as checkpointing
import megatron.training.initialize as initialize
import megatron.training.training as training

from higgs_megatron import HiggsConfig, HiggsDDP
from higgs_megatron.compat.moe import define_absent_te_gemm
from higgs_megatron.compat.rebind import Rebinds
from higgs_megatron.compat.symbols import Symbol, check_symbols
from higgs_megatron.ddp import sync_traffic
from higgs_megatron.logs import get_logger, setup_logging
from higgs_megatron.memory.flags import apply_block_allocator
from higgs_megatron.runtime.attach import Runtime, attach
from higgs_megatron.runtime.exits import UsageError, report_usage_error
from higgs_megatron.runtime.metrics import LogWindow, MetricsLogger
from higgs_megatron.runtime.run_config import RunConfig
from higgs_megatron.launcher import launcher_rank
from higgs_megatron.stability.regroup import prepare_backend

from .cpu import cpu_flag_problems
from .arguments import chain_args_providers, translate_args
from .checkout import installed_release, wheel_ships_training
from .rank_map import RankMapHooks
from .stability import MegatronLMWriters, StepRunner

log = get_logger("higgs_megatron.patches.install")

_rebinds = Rebinds()  # every name the patches rebind, and what it was (``higgs_megatron.compat.rebind``)
_rebind = _rebinds.rebind
original = _rebinds.original  # what ``owner.name`` was before the patches
uninstall = _rebinds.restore  # put every rebound name back

_T, _C, _I = "megatron.training.training", "megatron.training.checkpointing", "megatron.training.initialize"
_A, _M = "megatron.training.arguments", "megatron.training.models.dist_utils"
# Whether Megatron-LM parses before ``pretrain()`` and builds models through its model builder
# (from 0.18 on: the wheel ships megatron.training) or parses inside it (0.16.1).
PARSES_BEFORE_PRETRAIN = wheel_ships_training(installed_release())
# What the rebinding below relies on in Megatron-LM's training code (higgs_megatron.compat.symbols),
# checked by ``install`` before anything is rebound, with megatron-core's own.
_ENTRY = (
    Symbol(f"{_A}:parse_args", ("extra_args_provider", "ignore_unknown_args"),
           "rebound: our flags join its parser and are checked right after it"),
    Symbol(f"{_M}:DistributedDataParallel", ("config", "ddp_config", "module"),
           "rebound to HiggsDDP: the model builder wraps with it"),
) if PARSES_BEFORE_PRETRAIN else (
    Symbol(f"{_T}:pretrain", ("train_valid_test_dataset_provider", "model_provider", "model_type",
                              "forward_step_func"), "our flags join its extra_args_provider"),
    Symbol(f"{_I}:parse_args", ("extra_args_provider", "ignore_unknown_args"), "our flags are checked right after it"),
)
MEGATRON_LM_SYMBOLS = _ENTRY + (
    Symbol(f"{_T}:DDP", ("config", "ddp_config", "module"), "rebound to HiggsDDP"),
    Symbol(f"{_T}:get_megatron_optimizer", ("config", "model_chunks"), "rebound: the runtime attaches to its optimizer"),
    Symbol(f"{_T}:train_step", ("forward_step_func", "data_iterator", "model", "optimizer"),
           "rebound: each iteration runs under the stability layer"),
    Symbol(f"{_T}:save_checkpoint", ("iteration", "model", "optimizer", "opt_param_scheduler"),
           "rebound: the rank map and its commit"),
    Symbol(f"{_T}:load_checkpoint", ("ddp_model", "optimizer", "opt_param_scheduler", "load_arg"),
           "rebound: the rank map's validation"),
    Symbol(f"{_C}:generate_state_dict", ("args", "model", "optimizer", "opt_param_scheduler", "rng_state"),
           "rebound: the residuals join the state"),
    Symbol(f"{_C}:schedule_async_save", ("async_request",), "rebound: an async save commits after its writers"),
    Symbol(f"{_T}:checkpoint_and_decide_exit", ("model", "optimizer", "opt_param_scheduler", "iteration"),
           "rebound with --checkpoint-interval"),
    Symbol(f"{_T}:maybe_finalize_async_save", ("blocking",),
           "called: an async save whose writers are done commits before the ranks leave together for a restart"),
)


def install() -> None:
    """Stage 1 (see the module docstring). Raises ``SymbolMismatch`` naming what Megatron-LM's
    code or megatron-core lacks of what the patches rely on, before anything is rebound."""
    check_symbols(MEGATRON_LM_SYMBOLS)
    if PARSES_BEFORE_PRETRAIN:
        _rebind(arguments, "parse_args", _parse_chained_args)
    else:
        _rebind(megatron_training, "pretrain", _pretrain)
        _rebind(training, "pretrain", _pretrain)
        _rebind(initialize, "parse_args", _parse_args)


@functools.wraps(training.pretrain)
def _pretrain(*args: Any, **kwargs: Any) -> Any:
    pretrain = original(training, "pretrain")
    bound = inspect.signature(pretrain).bind(*args, **kwargs)
    bound.arguments["extra_args_provider"] = chain_args_providers(bound.arguments.get("extra_args_provider"))
    return pretrain(*bound.args, **bound.kwargs)


def _parse_chained_args(extra_args_provider: Any = None, ignore_unknown_args: bool = False) -> Any:
    parse_args = original(arguments, "parse_args")
    if ignore_unknown_args:  # a probe for one of Megatron-LM's own flags, not the run's parse
        return parse_args(extra_args_provider, ignore_unknown_args)
    return _checked(parse_args(chain_args_providers(extra_args_provider), ignore_unknown_args))


def _parse_args(*args: Any, **kwargs: Any) -> Any:
    return _checked(original(initialize, "parse_args")(*args, **kwargs))


def _checked(parsed: Any) -> Any:
    """Megatron-LM's parsed flags, ours among them, checked and mapped (``translate_args``);
    with ``--use-higgs`` the patches activated."""
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


def activate(args: Any, run: RunConfig) -> None:
    """Stage 2 (see the module docstring)."""
    global _run
    _run = run
    config = run.compression
    hooks = RankMapHooks(args, run)
    apply_block_allocator(run.memory.block_allocator)  # before process groups: no CUDA allocation yet
    if run.stability.higgs_step_timeout is not None:
        prepare_backend(args.distributed_backend)  # before process groups: NCCL's error handling
    if getattr(args, "num_experts", None):
        define_absent_te_gemm()  # megatron-core 0.16.1's MoE router without Transformer Engine (compat.moe)
    ddp_class = higgs_ddp_class(config)
    _rebind(training, "DDP", ddp_class)
    if PARSES_BEFORE_PRETRAIN:
        import megatron.training.models.dist_utils as dist_utils

        _rebind(dist_utils, "DistributedDataParallel", ddp_class)
    _rebind(training, "get_megatron_optimizer", _get_megatron_optimizer)
    _rebind(training, "train_step", _train_step)
    _rebind(training, "save_checkpoint", functools.partial(
        _save_then_settle, functools.partial(hooks.save_checkpoint, original(training, "save_checkpoint"))))
    _rebind(training, "load_checkpoint", functools.partial(hooks.load_checkpoint, original(training, "load_checkpoint")))
    _rebind(checkpointing, "generate_state_dict",
            functools.partial(hooks.generate_state_dict, original(checkpointing, "generate_state_dict")))
    _rebind(checkpointing, "schedule_async_save",
            functools.partial(hooks.schedule_async_save, original(checkpointing, "schedule_async_save")))
    if run.checkpoint.checkpoint_interval is not None:
        _rebind(training, "checkpoint_and_decide_exit", _interval_save)
    setup_logging()
    if launcher_rank() == 0:
        log.info(f" [higgs] HiggsDDP replaces Megatron's DDP ({config.compressor}, density {config.compression_ratio}, "
                 f"sync {config.sync}); checkpoints carry a rank map (--recovery-mode {run.checkpoint.recovery_mode})")


_run: RunConfig | None = None  # set by ``activate``
_runtime: Runtime | None = None  # attached with the optimizer
_steps: StepRunner | None = None


def _get_megatron_optimizer(config: Any, model_chunks: list, *args: Any, **kwargs: Any) -> Any:
    """Megatron-LM's optimizer, the runtime attached to it (``runtime.attach``): the optimizer
    Megatron-LM steps is the runtime's, wrapped. Its events go where Megatron-LM logs, from the
    last rank, and to Megatron-LM's TensorBoard and W&B writers."""
    global _runtime, _steps
    optimizer = original(training, "get_megatron_optimizer")(config, model_chunks, *args, **kwargs)
    events = MetricsLogger(is_writer=dist.get_rank() == dist.get_world_size() - 1, callbacks=[MegatronLMWriters()])
    _runtime = attach(model_chunks, optimizer, _run, events)
    # Megatron-LM's async save in flight, if its writers are done, commits (its finalization
    # commits our rank map too) before the ranks leave together for a restart.
    _runtime.resilience.before_orderly_restart = lambda: training.maybe_finalize_async_save(blocking=False)
    _steps = StepRunner(_runtime)
    atexit.register(_runtime.close)
    return _runtime.optimizer


def _save_then_settle(save: Callable, *args: Any, **kwargs: Any) -> Any:
    """Once a save returns, it has what it needs of the state it brought back (an async
    save's host copy included: megatron-core's callers finish ``preload_fn`` before
    ``schedule_async_request`` returns, the persistent worker through its joined preload
    queue): ``Runtime.saved`` (the wall clock restarts, offloaded state leaves again)."""
    if _runtime is not None:
        _runtime.checkpoint_phase(_runtime.iteration)  # the iteration just run (Megatron-LM's counter is past it)
    result = save(*args, **kwargs)
    if _runtime is not None:
        _runtime.saved()
    return result


_TRAFFIC_KEYS = (("higgs MB sent", 1e-6), ("higgs MB dense", 1e-6), ("higgs compress ms", 1e3),
                 ("higgs MB wire", 1e-6), ("higgs MB dense wire", 1e-6), ("higgs density", 1.0))  # LogWindow.reduced's order


def _train_step(forward_step_func: Callable, data_iterator: Any, model: list, *args: Any, **kwargs: Any) -> tuple:
    train_step = original(training, "train_step")
    if _steps is not None:
        result = _steps(train_step, forward_step_func, data_iterator, model, *args, **kwargs)
    else:
        result = train_step(forward_step_func, data_iterator, model, *args, **kwargs)
    # One all-reduce per step, every rank (``LogWindow``, as our loop's at its log lines): the
    # mean over the ranks of what Megatron-LM averages over its log interval and logs, left on
    # the device (Megatron-LM reads its loss dict on the host only at its log interval).
    window = LogWindow()
    window.add(sync_traffic(model))
    totals = window.reduced()
    loss_dict = result[0]
    if loss_dict:  # the last pipeline stage logs
        totals = totals.float().to(next(iter(loss_dict.values())).device)
        for index, (key, scale) in enumerate(_TRAFFIC_KEYS):
            loss_dict[key] = totals[index] * scale
    return result


def _interval_save(model: Any, optimizer: Any, scheduler: Any, iteration: int, flops: Any,
                   checkpointing_context: Any, train_data_iterator: Any) -> bool:
    """``checkpoint_and_decide_exit`` that also saves every ``--checkpoint-interval`` seconds of
    wall-clock time (the runtime's ``SaveSchedule``; Megatron-LM makes its own
    ``--save-interval`` saves, and any save restarts the clock: ``Runtime.saved``)."""
    schedule = _runtime.saves
    if not schedule.by_iteration(iteration) and schedule.by_wall_clock():
        training.save_checkpoint_and_time(iteration, model, optimizer, scheduler, flops, checkpointing_context,
                                          train_data_iterator=train_data_iterator)
    return original(training, "checkpoint_and_decide_exit")(
        model, optimizer, scheduler, iteration, flops, checkpointing_context, train_data_iterator)
