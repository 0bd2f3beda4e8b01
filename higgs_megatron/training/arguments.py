"""Command-line flags of the pretrain script, named as in Megatron-LM, and their validation.

``parse_args`` returns an ``argparse.Namespace`` whose fields carry Megatron-LM's names
(``tensor_model_parallel_size``, ``global_batch_size``...). Every check that can be made
without a process group is made here, so bad input stops the job before any collective
runs: the launcher's rank 0 prints one message naming the flag and what was expected, and
every rank exits with status 2 (``UsageError``).
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

import torch

from ..checkpoint.flags import add_rank_map_args
from ..config import add_higgs_args
from ..elastic.flags import add_elastic_args
from ..memory.flags import add_offload_args
from ..stability.exit_conditions import add_exit_args, check_exit_args
from ..runtime.exits import UsageError
from ..runtime.run_config import PRETRAIN, run_config_from_args
from ..launcher import launcher_world_size
from ..stability.flags import add_stability_args
from .length_buckets import parse_buckets

class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: unknown flags, bad choices
        raise UsageError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain_gpt.py",
        description="Pretrain a megatron-core GPT model (dense Megatron DDP baseline).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=256, help="model width")
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP width (default: 4 x --hidden-size)")
    g.add_argument("--num-attention-heads", type=int, default=4, help="attention heads; divisible by TP")
    g.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="learned positions (default: --seq-length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="the vocabulary is padded to a multiple of this x TP, as Megatron-LM pads it")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="dropout of the attention probabilities")
    g.add_argument("--disable-bias-linear", action="store_true", help="no bias in the linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer instead of the input embedding's transpose")
    g.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                   help="auto: Transformer Engine when it is importable and CUDA is present, else local")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 main weights")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recomputation (Megatron's): full layers, or the attention core only")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="with full: recompute groups of --recompute-num-layers (uniform) or the first N (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="with full (default 1)")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP; DP = world / (TP x PP)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP; divides --num-layers")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0, help="process groups' timeout")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch each bucket's gradient reduction as backward fills it (Megatron's DDP)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="optimizer state sharded over DP: reduce-scatter the gradients, all-gather the parameters")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1, metavar="N",
                   help="the distributed optimizer sharded inside each of N groups of DP ranks: reduce-scatter "
                        "inside an instance, all-reduce across instances (Megatron's hierarchical data parallelism; "
                        "with --use-higgs the cross-instance all-reduce is the compressed one)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (Megatron's default: max(40M, 1M x DP))")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="with --bf16: gradients accumulated and reduced in fp32")

    g = parser.add_argument_group("experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts in each layer's MLP (default: no MoE, a dense MLP)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="EP",
                   help="EP: the experts split over this many ranks; expert DP = world / (ETP x EP x PP)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="ETP",
                   help="each expert's tensor parallelism (default: --tensor-model-parallel-size)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's MLP width (default: --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "none"),
                   default="aux_loss", help="the router's load balancing")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="the load-balancing loss's weight")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax",
                   help="the router's scores")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="a per-expert routing bias, moved towards balance once per step (aux-loss-free balancing)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="how far the expert bias moves per step")
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather",
                   help="how tokens reach their experts' ranks")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4, help="samples per rank per forward-backward")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step; a multiple of micro batch x DP gives gradient accumulation "
                        "(default: micro batch x data-parallel size)")
    g.add_argument("--train-iters", type=int, default=100, help="optimizer steps")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Megatron's optimizer")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end of the decay")
    g.add_argument("--lr-warmup-iters", type=int, default=None,
                   help="linear warm-up of the learning rate (default: a tenth of --train-iters)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="iterations of the decay (default: --train-iters)")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "inverse-square-root"),
                   default="cosine", help="the decay's shape")
    g.add_argument("--weight-decay", type=float, default=0.01, help="decoupled weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam's epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip")
    g.add_argument("--seed", type=int, default=1234, help="initialisation, dropout and data order")

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", default=None,
                   help="a text file or a folder of text files (default: this Python's standard library sources)")
    g.add_argument("--data-cache-path", default=None, help="where the indexed corpus is cached (default: $HIGGS_CACHE_DIR, else ~/.cache/higgs_megatron)")
    g.add_argument("--split", default="98,2,0", help="train,validation,test weights over documents")
    g.add_argument("--higgs-length-buckets", default=None, metavar="L1,L2,...",
                   help="train on whole documents (not packed), each batch padded to the smallest of these "
                        "lengths that holds it (--seq-length is always the last): few activation shapes, "
                        "little padding, less allocator fragmentation")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10, help="iterations per log line")
    g.add_argument("--eval-interval", type=int, default=50, help="iterations between validations")
    g.add_argument("--eval-iters", type=int, default=5, help="validation batches; 0 skips validation")
    g.add_argument("--log-json", default=None, metavar="PATH",
                   help="append one JSON object per logged iteration and per event")
    g.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars here (the tensorboard extra)")
    g.add_argument("--wandb-project", default=None, help="also log to Weights & Biases, in this project")
    g.add_argument("--wandb-mode", choices=("offline", "online"), default="offline",
                   help="offline (default) writes the run locally, for `wandb sync` later")
    g.add_argument("--wandb-dir", default=None, help="where W&B writes its files")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads per rank on CPU (default: cores / local ranks)")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, metavar="DIR", help="save checkpoints here (and at the end of training)")
    g.add_argument("--save-interval", type=int, default=None, metavar="ITERS", help="save every N iterations")
    g.add_argument("--load", default=None, metavar="DIR", help="resume from the latest committed checkpoint here")
    add_rank_map_args(g)
    g.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep only the newest N checkpoints")

    g = parser.add_argument_group("stability")
    add_stability_args(g)
    add_exit_args(g)
    add_higgs_args(parser)
    add_offload_args(parser)
    add_elastic_args(parser.add_argument_group("higgs: elastic replicas (torchft)"))
    return parser


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check the flags against each other and the launch, group by group, and fill derived
    fields (``world_size``, ``data_parallel_size``, ``num_microbatches``, and ``run_config``,
    the typed config the runtime reads: ``runtime.run_config``). No side effects: nothing is
    created on disk here; directories are made when they are first used."""
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
              "global_batch_size", "train_iters", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "log_interval", "eval_interval", "ddp_bucket_size",
              "make_vocab_size_divisible_by", "ffn_hidden_size", "num_threads", "num_distributed_optimizer_instances",
              "num_experts", "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_ffn_hidden_size",
              "moe_router_topk",
              "check_weight_hash_across_dp_replicas_interval", "save_interval", "keep_last", "higgs_step_timeout")
    # The compressed sync's schedule is derived from the LR schedule's: after it.
    for check in (_check_optimizer, _check_recompute, _check_layout, _check_elastic, _check_experts, _check_model,
                  _check_schedule,
                  _check_run_config, _check_data, _check_runtime):
        check(args, world_size)
    return args


def _check_run_config(args: argparse.Namespace, world_size: int) -> None:
    """Our flags (compression, checkpoints, stability, memory): the rules of what needs what,
    then the typed config; the exit flags; and a --load directory that must exist."""
    args.run_config = run_config_from_args(args, PRETRAIN, world_size, args.train_iters, args.lr_warmup_iters)
    try:
        check_exit_args(args)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.load is not None and not os.path.isdir(args.load):  # --auto-resume's own --save may not exist yet
        raise UsageError(f"--load {args.load}: no such directory")


def _check_optimizer(args: argparse.Namespace, world_size: int) -> None:
    if args.optimizer != "adam" and args.use_distributed_optimizer:
        raise UsageError(f"--optimizer {args.optimizer}: megatron-core's --use-distributed-optimizer supports adam only")


def _check_recompute(args: argparse.Namespace, world_size: int) -> None:
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise UsageError("--recompute-granularity full needs --recompute-method uniform or block")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise UsageError("--recompute-method and --recompute-num-layers: only with --recompute-granularity full")
    if args.recompute_granularity == "full":
        args.recompute_num_layers = args.recompute_num_layers or 1
        per_stage = args.num_layers // max(1, args.pipeline_model_parallel_size)
        if not 1 <= args.recompute_num_layers <= per_stage:
            raise UsageError(f"--recompute-num-layers {args.recompute_num_layers}: expected 1 to {per_stage} "
                             "(the layers of one pipeline stage)")
    if args.eval_iters < 0:
        raise UsageError(f"--eval-iters must be 0 or more, got {args.eval_iters}")


def _check_layout(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp) != 0:
        raise UsageError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}"
        )
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp)
    instances = args.num_distributed_optimizer_instances
    if args.data_parallel_size % instances != 0:
        raise UsageError(f"--num-distributed-optimizer-instances {instances} does not divide the data-parallel "
                         f"size {args.data_parallel_size}")


def _check_elastic(args: argparse.Namespace, world_size: int) -> None:
    """``--higgs-replicas R``: this launch is one replica, TP x PP ranks with data-parallel size
    1 inside; each global batch is split over the R replicas (``--micro-batch-size`` x R per
    micro-batch). The sync across replicas runs dense or as each rank's own top-k all-gathered,
    the forms whose plans do not depend on who is in the quorum: ``--higgs-sync auto`` takes the
    all-gather there."""
    replicas = args.higgs_replicas
    if replicas is None:
        return
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.data_parallel_size != 1:
        raise UsageError(f"--higgs-replicas {replicas}: each replica is one torchrun of --tensor-model-parallel-size "
                         f"{tp} x --pipeline-model-parallel-size {pp} = {tp * pp} rank(s) (data-parallel size 1 "
                         f"inside); this launch has {world_size}")
    refused = [flag for flag, given in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                        ("--num-experts", args.num_experts is not None),
                                        (f"--higgs-sync {args.higgs_sync}",
                                         args.higgs_sync not in (None, "auto", "sparse", "dense"))) if given]
    if refused:
        raise UsageError(f"--higgs-replicas with {', '.join(refused)}: not built for elastic replicas (across them "
                         "the sync is dense or each rank's own top-k all-gathered, --higgs-sync sparse; inside "
                         "one there is no data-parallel group to shard over)")
    if args.use_higgs and args.higgs_sync == "auto":
        args.higgs_sync = "sparse"  # not given: the run config falls back to it from 1-bit Adam, saying why


def _check_experts(args: argparse.Namespace, world_size: int) -> None:
    """MoE: Megatron's rules for the expert layout, checked before any process group exists."""
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    ep, etp, pp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.pipeline_model_parallel_size
    if args.num_experts is None:
        given = [flag for flag, value in (("--expert-model-parallel-size", ep != 1),
                                          ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias),
                                          ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size is not None)) if value]
        if given:
            raise UsageError(f"{', '.join(given)}: only with --num-experts (a mixture-of-experts model)")
        args.expert_data_parallel_size = args.data_parallel_size
        return
    if args.num_experts % ep != 0:
        raise UsageError(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    if world_size % (etp * ep * pp) != 0:
        raise UsageError(f"world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                         f"--expert-model-parallel-size {ep} x --pipeline-model-parallel-size {pp} = {etp * ep * pp}")
    if args.tensor_model_parallel_size > 1:
        raise UsageError("--num-experts with --tensor-model-parallel-size > 1: megatron-core's MoE layer trains "
                         "only with sequence parallelism there, whose layer norm needs Transformer Engine or Apex; "
                         "this script runs the local layers (--expert-tensor-parallel-size may exceed 1)")
    if etp > 1 and not args.disable_bias_linear:
        raise UsageError(f"--expert-tensor-parallel-size {etp} needs --disable-bias-linear (megatron-core supports "
                         "biases in the experts only with expert TP 1)")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise UsageError(f"--moe-router-topk {args.moe_router_topk}: expected 1 to --num-experts {args.num_experts}")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        raise UsageError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron's rule)")
    if args.use_higgs and args.num_distributed_optimizer_instances > 1:
        raise UsageError("--use-higgs with --num-experts and --num-distributed-optimizer-instances > 1: the "
                         "compressed sync of expert gradients across optimizer instances is not built")
    args.expert_data_parallel_size = world_size // (etp * ep * pp)


def _check_model(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_attention_heads % tp != 0:
        raise UsageError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if args.hidden_size % args.num_attention_heads != 0:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}"
        )
    if args.num_layers % pp != 0:
        raise UsageError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        )


def _check_schedule(args: argparse.Namespace, world_size: int) -> None:
    """Batch sizes and the LR schedule."""
    shares = args.higgs_replicas or args.data_parallel_size  # the global batch's shares
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * shares
    per_step = args.micro_batch_size * shares
    if args.global_batch_size % per_step != 0:
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x {'--higgs-replicas' if args.higgs_replicas else 'data-parallel size'} "
            f"{shares} = {per_step}"
        )
    args.num_microbatches = args.global_batch_size // per_step
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise UsageError(
            f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}"
        )
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = args.train_iters // 10
    if args.lr_warmup_iters < 0 or args.lr_warmup_iters >= args.lr_decay_iters:
        raise UsageError(f"--lr-warmup-iters {args.lr_warmup_iters} must be at least 0 and below "
                         f"--lr-decay-iters {args.lr_decay_iters} (which defaults to --train-iters)")
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")


def _check_data(args: argparse.Namespace, world_size: int) -> None:
    if args.higgs_length_buckets is not None:
        try:
            args.length_buckets = parse_buckets(args.higgs_length_buckets, args.seq_length)
        except ValueError as error:
            raise UsageError(f"--higgs-length-buckets {error}") from None
    else:
        args.length_buckets = None
    if args.data_path is not None and not os.path.exists(args.data_path):
        raise UsageError(f"--data-path {args.data_path}: no such file or directory")
    try:
        weights = [float(w) for w in args.split.split(",")]
        assert len(weights) == 3 and min(weights) >= 0 and weights[0] > 0 and weights[1] > 0
    except (ValueError, AssertionError):
        raise UsageError(f"--split {args.split!r}: expected three weights 'train,validation,test' "
                         "with train and validation above zero")


def _check_runtime(args: argparse.Namespace, world_size: int) -> None:
    """Backend, layer implementation, logging packages: what this machine has."""
    cuda = torch.cuda.is_available()
    if args.distributed_backend == "auto":
        args.distributed_backend = "nccl" if cuda else "gloo"
    if args.distributed_backend == "nccl" and not cuda:
        raise UsageError("--distributed-backend nccl needs CUDA, and CUDA is not available here; use gloo")
    if args.transformer_impl == "transformer_engine" and not (cuda and _te_importable()):
        raise UsageError("--transformer-impl transformer_engine needs CUDA and transformer-engine installed")
    if args.transformer_impl == "auto":
        args.transformer_impl = "transformer_engine" if cuda and _te_importable() else "local"
    if args.tensorboard_dir is not None:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard-dir needs the tensorboard package: pip install 'higgs-megatron[tensorboard]'")
    if args.wandb_project is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("--wandb-project needs the wandb package: pip install 'higgs-megatron[wandb]'")


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and validate; raises UsageError (exit 2) with one message on bad input."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    return validate_args(args, launcher_world_size() if world_size is None else world_size)
