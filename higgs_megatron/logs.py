"""Logging for the package: one logger tree under ``higgs_megatron``, and a rank helper in
Megatron's style (``megatron.core.utils.log_single_rank``).

The lines keep the format users and scripts parse: the message alone, no prefix. Warnings and
below go to standard output (where Megatron-LM prints its own log lines), errors to standard
error. ``setup_logging`` installs those handlers on the package's logger once, and only where
nobody configured it: the entry points and the pretrain loop call it; a program that embeds
``HiggsDDP`` keeps its own logging configuration.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

logger = logging.getLogger("higgs_megatron")


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    """Handlers for the package's logger (see the module docstring); idempotent."""
    if not logger.handlers:
        out = logging.StreamHandler(sys.stdout)
        out.addFilter(_Below(logging.ERROR))
        err = logging.StreamHandler(sys.stderr)
        err.setLevel(logging.ERROR)
        for handler in (out, err):
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(level)  # only where these handlers are ours: a user's own level stays
    return logger


def get_logger(name: str) -> logging.Logger:
    """The logger of a module of this package (``__name__``), under the package's logger; a
    name outside the package (a script's) is put under it, so its lines reach the handlers."""
    package = logger.name
    return logging.getLogger(name if name == package or name.startswith(package + ".") else f"{package}.{name}")


def log_single_rank(log: logging.Logger, level: int, message: str, rank: int = 0) -> None:
    """Log on global rank ``rank`` only (on every process before the process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == rank:
        log.log(level, message)
