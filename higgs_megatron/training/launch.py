"""Launching the pretrain script: the process environment around ``Trainer``, and ``main``.

``main`` is what ``examples/pretrain_gpt.py`` and the ``higgs-pretrain-gpt`` command run: parse
and validate the flags, set up threads and process groups (``training_environment``), train,
and turn the ways a run can end into the exit statuses both front-ends give
(``runtime.exits``): 2 for bad input, 3 for a checkpoint that cannot be loaded or saved, 75
for a lost peer, so that ``torchrun --max-restarts`` restarts the job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from typing import Iterator, Sequence

import torch

from ..cpu import cpu_megatron
from ..logs import get_logger
from ..memory.flags import apply_block_allocator
from ..runtime.exits import UsageError, exit_status
from ..stability.regroup import prepare_backend
from .arguments import parse_args
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
                      getattr(args, "num_distributed_optimizer_instances", 1),
                      getattr(args, "expert_model_parallel_size", 1), getattr(args, "expert_tensor_parallel_size", None))
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
    """Entry point: parse, validate, train; the exit status is ``runtime.exits``'s (bad input
    2, a checkpoint error 3, a lost peer 75). Without a launcher (no ``RANK`` in the
    environment) the job is one process."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    return exit_status(lambda: pretrain(argv), prog="pretrain_gpt.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
