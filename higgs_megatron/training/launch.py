"""Launching the pretrain script: the process environment around ``Trainer``, and ``main``.

``main`` is what ``examples/pretrain_gpt.py`` and the ``higgs-pretrain-gpt`` command run: parse
and validate the flags, set up threads and process groups (``training_environment``), train,
and turn the ways a run can end into exit statuses a launcher can act on: 2 for bad input, 3 for
a checkpoint that cannot be loaded or saved, 75 (``RESTART_EXIT_CODE``) for a lost peer, so
that ``torchrun --max-restarts`` restarts the job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ..checkpoint.manifest import CheckpointError
from ..cpu import cpu_megatron
from ..logs import get_logger, setup_logging
from ..memory.flags import apply_block_allocator
from ..stability.regroup import RESTART_EXIT_CODE, peer_lost, prepare_backend
from .arguments import UsageError, parse_args, report_usage_error
from .corpus import DataPathError, find_text_files
from .loop import Trainer, TrainResult
from .parallel import destroy_parallel, init_parallel, local_world_size

log = get_logger(__name__)


def _default_threads() -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size()))


def check_data_path(args: argparse.Namespace) -> None:
    """A user's data path must name non-empty text; checked before any process group exists."""
    if args.data_path is not None:
        try:
            find_text_files(args.data_path, args.data_cache_path)
        except DataPathError as error:
            raise UsageError(str(error)) from None


@contextlib.contextmanager
def training_environment(args: argparse.Namespace) -> Iterator[None]:
    """Threads, the CPU scope when running on gloo without CUDA, and the process groups."""
    # Megatron's TP overlap assumes one device work queue; Megatron-LM's launch scripts set it too.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not torch.cuda.is_available():
        torch.set_num_threads(args.num_threads or _default_threads())
    apply_block_allocator(getattr(args, "higgs_block_allocator", "off"))  # before the first allocation
    scope = cpu_megatron() if not torch.cuda.is_available() else contextlib.nullcontext()
    if getattr(args, "higgs_step_timeout", None) is not None:
        prepare_backend(args.distributed_backend)
    with scope:
        init_parallel(args.distributed_backend, args.tensor_model_parallel_size,
                      args.pipeline_model_parallel_size, args.distributed_timeout_minutes,
                      getattr(args, "num_distributed_optimizer_instances", 1))
        try:
            yield
        finally:
            destroy_parallel()


def run(args: argparse.Namespace, **trainer_kwargs) -> TrainResult:
    """Train with already-validated args inside the training environment."""
    with training_environment(args):
        trainer = Trainer(args, **trainer_kwargs)
        try:
            return trainer.train()
        finally:
            trainer.close()


def pretrain(argv: Sequence[str] | None = None, **trainer_kwargs) -> TrainResult:
    """Parse and validate ``argv`` for this launch, then train; raises UsageError on bad input."""
    args = parse_args(argv)
    check_data_path(args)
    return run(args, **trainer_kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse, validate, train. Bad input: one message, exit status 2. Without a
    launcher (no ``RANK`` in the environment) the job is one process."""
    setup_logging()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    try:
        pretrain(argv)
    except UsageError as error:
        report_usage_error(error)
        return error.code
    except CheckpointError as error:
        if dist_rank_or_launcher() == 0:
            log.error(f"checkpoint error: {error}")
        return EXIT_CHECKPOINT
    except RuntimeError as error:
        if not peer_lost(error):
            raise
        log.error(f"[rank {dist_rank_or_launcher()}] a peer rank is gone ({str(error).splitlines()[0][:200]}); "
                  f"exiting with status {EXIT_PEER_LOST} so that torchrun --max-restarts restarts the job "
                  "(with --auto-resume it resumes from the latest committed checkpoint)")
        return EXIT_PEER_LOST
    return 0


EXIT_CHECKPOINT = 3
EXIT_PEER_LOST = RESTART_EXIT_CODE


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dist_rank_or_launcher() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
