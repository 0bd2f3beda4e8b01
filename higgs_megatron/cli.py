"""``higgs-megatron``: the command-line tools that need no training job.

    higgs-megatron checkpoint inspect DIR [--version N] [--json]
    higgs-megatron checkpoint verify DIR [--version N] [--json]
    higgs-megatron checkpoint plan DIR --tensor-model-parallel-size T --pipeline-model-parallel-size P
                                       --data-parallel-size D [...] [--json]

DIR is a save directory (``--save`` of either front-end) or one ``iter_NNNNNNN`` checkpoint.
Exit status: 0 when the answer is yes (files intact; the plan loads under the asked
``--recovery-mode``), 1 when it is no, 2 for bad input (a missing directory, no rank map).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from typing import Sequence

from .checkpoint.manifest import CheckpointError, Layout
from .checkpoint.tool import format_inspect, format_plan, format_verify, inspect, plan, verify
from .checkpoint.load import RECOVERY_MODES
from .logs import get_logger, setup_logging

log = get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="higgs-megatron", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    checkpoint = commands.add_parser("checkpoint", help="inspect, verify or plan a rank-mapped checkpoint")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    for name, help in (("inspect", "the committed checkpoints: iteration, samples, layout, sizes, config, versions"),
                       ("verify", "every file's SHA-256 against the rank map, offline"),
                       ("plan", "would it load at this layout, under same-sharding and under reshard?")):
        sub = actions.add_parser(name, help=help)
        sub.add_argument("directory", metavar="DIR", help="a save directory or one iter_NNNNNNN checkpoint")
        sub.add_argument("--checkpoint-version", "--version", dest="version", type=int, default=None, metavar="ITER",
                         help="the committed checkpoint of this iteration (default: "
                              + ("all" if name == "inspect" else "the one a resume would load") + ")")
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = actions.choices["plan"]
    sub.add_argument("--tensor-model-parallel-size", type=int, required=True, metavar="T")
    sub.add_argument("--pipeline-model-parallel-size", type=int, required=True, metavar="P")
    sub.add_argument("--data-parallel-size", type=int, required=True, metavar="D")
    sub.add_argument("--context-parallel-size", type=int, default=1, metavar="C")
    sub.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="E")
    sub.add_argument("--expert-tensor-parallel-size", type=int, default=None, metavar="ET",
                     help="default: the tensor-parallel size")
    sub.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None, metavar="V",
                     help="virtual pipeline stages per rank (default: none)")
    sub.add_argument("--num-distributed-optimizer-instances", type=int, default=1, metavar="N")
    sub.add_argument("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                     help="the target's optimizer (default: as saved)")
    sub.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                     help="the target's vocabulary divisor (default: as saved)")
    sub.add_argument("--vocab-size", type=int, default=None, metavar="V",
                     help="the true vocabulary size, for a rank map that does not record it")
    sub.add_argument("--recovery-mode", choices=RECOVERY_MODES, default=None,
                     help="decides the exit status (default: 0 when either mode loads)")
    return parser


def _target(args: argparse.Namespace) -> Layout:
    """The asked layout; ``use_distributed_optimizer`` None: as saved (``tool.plan`` fills it)."""
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                 "context_parallel_size", "expert_model_parallel_size", "num_distributed_optimizer_instances"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected 1 or more")
    world = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
             * args.data_parallel_size)
    return Layout(world_size=world, tensor_model_parallel_size=args.tensor_model_parallel_size,
                  pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                  data_parallel_size=args.data_parallel_size, context_parallel_size=args.context_parallel_size,
                  expert_model_parallel_size=args.expert_model_parallel_size,
                  use_distributed_optimizer=args.use_distributed_optimizer,
                  virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                  num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
                  expert_tensor_parallel_size=(None if args.expert_tensor_parallel_size in (None, args.tensor_model_parallel_size)
                                               else args.expert_tensor_parallel_size))


def _run(args: argparse.Namespace) -> tuple[str, object, bool]:
    if args.action == "inspect":
        report = inspect(args.directory, args.version)
        return format_inspect(report), report, True
    if args.action == "verify":
        report = verify(args.directory, args.version)
        return format_verify(report), report, not report["problems"]
    result = plan(args.directory, _target(args), args.version, args.make_vocab_size_divisible_by, args.vocab_size)
    ok = {"same-sharding": result.same_sharding, "reshard": result.reshard,
          None: result.same_sharding or result.reshard}[args.recovery_mode]
    return format_plan(result), asdict(result), ok


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        text, report, ok = _run(args)
    except (CheckpointError, ValueError, OSError) as error:
        log.error(f"higgs-megatron checkpoint {args.action}: error: {error}")
        return 2
    sys.stdout.write((json.dumps(report, indent=1) if args.json else text) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    logging.captureWarnings(True)
    sys.exit(main())
