"""The flags the patches add to Megatron-LM's parser, and what they mean for Megatron-LM.

``pretrain_gpt.py`` already hands ``pretrain()`` an ``extra_args_provider`` (ModelOpt's,
when it is installed): ``chain_args_providers`` runs it first and adds ours after it, never
replacing it. Our flags are those of this project's own pretrain script (``--use-higgs``,
``--higgs-*``, ``--recovery-mode``, ``--checkpoint-version``, ``--async-checkpoint``,
``--checkpoint-interval``, ``--auto-resume``, the stability flags ``--higgs-step-timeout``,
``--higgs-restart-timeout`` and ``--inject-fault``, and the memory manager's ``--higgs-offload*``,
``--higgs-block-allocator``); a flag Megatron-LM already defines with the same meaning
(``--check-weight-hash-across-dp-replicas-interval``) is left to Megatron-LM.

``translate_args`` runs right after Megatron-LM parses, before its own validation and
before any process group exists. It refuses what cannot work, naming the flag
(``UsageError``), and maps ours onto Megatron-LM's where Megatron-LM has the
mechanism: ``--checkpoint-version N`` is ``--ckpt-step N``; ``--async-checkpoint`` is
``--async-save --use-persistent-ckpt-worker``. With ``--use-higgs`` and the distributed
optimizer, checkpoints are saved ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``)
so that ``--recovery-mode reshard`` can always move them to another TP/PP/DP layout.
Without ``--use-higgs`` nothing is changed, and our other flags are refused rather than
silently ignored.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Callable

from higgs_megatron.checkpoint.flags import add_rank_map_args
from higgs_megatron.config import add_higgs_args
from higgs_megatron.ddp import UNSUPPORTED_DDP_OPTIONS
from higgs_megatron.field_flags import flag_dest
from higgs_megatron.given_flags import flags_given
from higgs_megatron.memory.flags import add_offload_args
from higgs_megatron.launcher import launcher_world_size
from higgs_megatron.runtime.exits import UsageError
from higgs_megatron.elastic.flags import add_elastic_args
from higgs_megatron.runtime.run_config import MEGATRON_LM, RunConfig, run_config_from_args
from higgs_megatron.stability.flags import add_stability_args

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def _has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_patch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags to Megatron-LM's parser (once; a second call changes nothing)."""
    if _has_flag(parser, "--use-higgs"):
        return parser
    add_higgs_args(parser, weight_hash_check=not _has_flag(parser, "--check-weight-hash-across-dp-replicas-interval"))
    g = parser.add_argument_group("higgs: checkpoints with a rank map (with --use-higgs)")
    add_rank_map_args(g)
    add_stability_args(parser.add_argument_group("higgs: stability (with --use-higgs)"))
    add_offload_args(parser)
    add_elastic_args(parser.add_argument_group("higgs: elastic replicas (refused here: our pretrain script only)"))
    return parser


def chain_args_providers(existing: ArgsProvider | None) -> ArgsProvider:
    """An args provider that runs ``existing`` (if any), then adds our flags."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if existing is not None:
            parser = existing(parser) or parser
        return escape_bare_percents(add_patch_args(parser))

    provider.chained = existing  # type: ignore[attr-defined]
    return provider


def escape_bare_percents(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """argparse formats each help string with ``%``: one that holds a bare ``%`` makes ``--help``
    raise instead of print (Megatron-LM 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda``
    says "10%)"). Such a help string gets its ``%`` doubled; the others are left as they are."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.help or action.help is argparse.SUPPRESS:
            continue
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError, KeyError):
            action.help = action.help.replace("%", "%%")
    return parser


# (flag, argparse dest, why): Megatron-LM features refused with --use-higgs, before any process
# group exists (docs/megatron_lm.md, the compatibility matrix). A dest the release lacks is skipped.
REFUSED_WITH_HIGGS = (
    ("--inprocess-restart", "inprocess_restart",
     "NVRx's in-process restart re-enters pretrain() around state the patches hold; the stability layer "
     "(--higgs-step-timeout, --auto-resume) recovers instead"),
    ("--enable-ft-package", "enable_ft_package",
     "NVRx's fault tolerance restarts ranks the stability layer is aligning; use --higgs-step-timeout"),
    ("--optimizer-cuda-graph", "optimizer_cuda_graph",
     "it replaces optimizer.step, which the runtime wraps"),
    ("--enable-cuda-graph", "enable_cuda_graph", "CUDA graphs are not tested with HiggsDDP's reduction"),
    ("--external-cuda-graph", "external_cuda_graph", "CUDA graphs are not tested with HiggsDDP's reduction"),
    ("--fp8-format", "fp8", "FP8 training (Transformer Engine on a GPU) is not tested with HiggsDDP"),
    ("--fp8-param-gather", "fp8_param_gather", "FP8 parameter buffers are not tested with HiggsDDP"),
)


def refused_with_higgs(args: argparse.Namespace) -> list[str]:
    """``flag: why`` for each Megatron-LM feature given that --use-higgs refuses."""
    found = [f"{flag}: {why}" for flag, dest, why in REFUSED_WITH_HIGGS if getattr(args, dest, None)]
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none"):
        found.append(f"--cuda-graph-impl {args.cuda_graph_impl}: CUDA graphs are not tested with HiggsDDP's reduction")
    if getattr(args, "num_experts", None) and (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        found.append("--num-experts with --num-distributed-optimizer-instances > 1: the compressed sync of expert "
                     "gradients across optimizer instances is not built")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        found.append(f"--context-parallel-size {args.context_parallel_size}: Megatron's context parallel needs "
                     "Transformer Engine's attention (a GPU), where HiggsDDP over its data-and-context group is "
                     "not tested yet")
    return found


_WEIGHT_HASH_DEST = "check_weight_hash_across_dp_replicas_interval"  # Megatron-LM's own flag when it has one


def _higgs_only_flags_given(args: argparse.Namespace) -> list[str]:
    """Our flags that differ from their defaults (``--use-higgs`` itself and the flag that
    Megatron-LM has of its own aside), named as the user wrote them."""
    return flags_given(args, add_patch_args(argparse.ArgumentParser()), skip=("use_higgs", _WEIGHT_HASH_DEST))


def run_length(args: argparse.Namespace) -> tuple[int, int]:
    """(training iterations, learning-rate warm-up iterations) of a Megatron-LM run, as its
    scheduler counts them: ``--train-iters``, or ``--train-samples`` over the global batch; the
    warm-up from ``--lr-warmup-fraction`` of the decay, ``--lr-warmup-iters`` or
    ``--lr-warmup-samples``. What the compressed sync's derived schedule is cut from."""
    batch = getattr(args, "global_batch_size", None)
    if not batch:  # parsed, not yet validated: Megatron-LM's default, a micro-batch per data-parallel rank
        model_parallel = (getattr(args, "tensor_model_parallel_size", 1) * getattr(args, "pipeline_model_parallel_size", 1)
                          * getattr(args, "context_parallel_size", 1))
        world = getattr(args, "world_size", None) or launcher_world_size()
        batch = (getattr(args, "micro_batch_size", None) or 1) * max(1, world // max(1, model_parallel))
    iters = getattr(args, "train_iters", None) or (getattr(args, "train_samples", None) or 0) // batch
    decay = getattr(args, "lr_decay_iters", None) or (getattr(args, "lr_decay_samples", None) or 0) // batch or iters
    if getattr(args, "lr_warmup_fraction", None) is not None:
        return iters, int(args.lr_warmup_fraction * decay)
    if getattr(args, "lr_warmup_iters", None):
        return iters, args.lr_warmup_iters
    return iters, (getattr(args, "lr_warmup_samples", None) or 0) // batch


def translate_args(args: argparse.Namespace) -> RunConfig | None:
    """Check our flags against Megatron-LM's and map them onto it; the run's typed config
    (``runtime.run_config``), or None without --use-higgs. Raises ``UsageError`` naming the
    flag; changes ``args`` only when every check has passed."""
    if not args.use_higgs:
        given = _higgs_only_flags_given(args)
        if given:
            raise UsageError(f"{', '.join(given)}: only with --use-higgs (without it, Megatron-LM "
                                  "runs exactly as unpatched)")
        return None
    config = run_config_from_args(args, MEGATRON_LM, getattr(args, "world_size", None), *run_length(args))
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        raise UsageError("--use-higgs replaces the reduction of Megatron's DistributedDataParallel; "
                              "it does not combine with --use-torch-fsdp2 or --use-megatron-fsdp")
    for flag, name in (("--non-persistent-save-interval", "non_persistent_save_interval"),
                       ("--save-retain-interval", "save_retain_interval"), ("--adlr-autoresume", "adlr_autoresume")):
        if getattr(args, name, None):
            raise UsageError(f"{flag}: its saves bypass the rank map (or delete before the commit); "
                                  "not with --use-higgs")
    refused = refused_with_higgs(args)
    if refused:
        raise UsageError(f"{'; '.join(refused)}: not with --use-higgs")
    for flag in UNSUPPORTED_DDP_OPTIONS.values():
        if getattr(args, flag_dest(flag), None):
            raise UsageError(f"{flag}: HiggsDDP does its own reduction, not Megatron's, which this option changes; "
                             "not with --use-higgs")
    if getattr(args, "optimizer", "adam") not in ("adam", "sgd"):
        raise UsageError(f"--optimizer {args.optimizer}: --use-higgs wraps Megatron's Adam and SGD (its checkpoints "
                         "restore their state through the distributed optimizer's own layout); use adam or sgd")
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        raise UsageError(f"--ckpt-format {args.ckpt_format}: with --use-higgs, checkpoints carry a rank map, "
                              "which covers the torch_dist format; use --ckpt-format torch_dist")
    if args.checkpoint_version is None and getattr(args, "ckpt_step", None) is not None and args.ckpt_step < 1:
        raise UsageError(f"--ckpt-step {args.ckpt_step}: expected an iteration, 1 or more")
    if args.checkpoint_version is not None and getattr(args, "ckpt_step", None) not in (None, args.checkpoint_version):
        raise UsageError(f"--checkpoint-version {args.checkpoint_version} and --ckpt-step {args.ckpt_step} "
                              "disagree; give one")
    if config.stability.higgs_step_timeout is not None and getattr(args, "calculate_per_token_loss", False):
        raise UsageError("--higgs-step-timeout with --calculate-per-token-loss: Megatron-LM then all-reduces the "
                              "token count over the data-parallel group right after the sync, a wait this layer cannot "
                              "bound; give one")
    if any(fault.kind == "nan" for fault in config.stability.faults) and getattr(args, "check_for_nan_in_loss_and_grad", False):
        raise UsageError("--inject-fault nan: Megatron-LM's own check stops the run at a NaN before --use-higgs "
                              "can skip the step; add --no-check-for-nan-in-loss-and-grad")
    offload = config.memory.offload
    if offload is not None and getattr(args, "log_params_norm", False):
        raise UsageError("--log-params-norm with --higgs-offload: Megatron-LM reads the optimizer's main "
                              "parameters for the norm after the step, while offloaded state is away; give one")
    if offload is not None and getattr(args, "optimizer_cpu_offload", False):
        raise UsageError("--higgs-offload and --optimizer-cpu-offload both move the optimizer's state off the "
                              "device; give one (--higgs-offload decides from measured memory, "
                              "--optimizer-offload-fraction by hand)")

    if args.checkpoint_version is None and getattr(args, "ckpt_step", None) is not None:
        args.checkpoint_version = args.ckpt_step  # Megatron-LM's name for the same choice: validated as ours
        config = replace(config, checkpoint=replace(config.checkpoint, checkpoint_version=args.ckpt_step))
    if args.checkpoint_version is not None:
        args.ckpt_step = args.checkpoint_version
    args.load = config.checkpoint.load
    if args.async_checkpoint:
        args.async_save = True
        args.use_persistent_ckpt_worker = True
    if getattr(args, "async_save", False) and hasattr(args, "async_strategy"):
        args.async_strategy = "mcore"  # from 0.19: megatron-core's writer, which the rank map's commit follows
    if args.use_distributed_optimizer and not getattr(args, "distrib_optim_fully_reshardable_mem_efficient", False):
        args.dist_ckpt_optim_fully_reshardable = True
    return config  # kept off ``args``: Megatron-LM pickles args into checkpoints, read back weights-only
