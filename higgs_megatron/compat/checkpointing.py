"""Where megatron-core's checkpoint writer differs between the supported releases.

* From 0.19 an asynchronous ``dist_checkpointing.save`` defaults to NVIDIA Resiliency
  Extension's writer (``async_strategy="nvrx"``); we write through megatron-core's own
  (``"mcore"``), which 0.16.1 always used.
* The writer's multi-bucket entry point was ``write_preloaded_data_multiproc`` (0.16.1) and is
  ``write_preloaded_data_multithread`` (0.19); ``checkpoint.async_save`` replaces it with its
  own thread, and checks first that the plan is megatron-core's.
* 0.19's writer, when a bucket fails, raises an error that names the exception's class only;
  the failure's own words (which file, why) go to its logger. ``writer_errors`` keeps them for
  our error message.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

ASYNC_WRITERS = tuple(getattr(FileSystemWriterAsync, name) for name in
                      ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
                      if hasattr(FileSystemWriterAsync, name))


# Read once, from megatron-core's own function (a test may wrap the module's name later).
_ASYNC_OPTIONS = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(serialization.save).parameters \
    else {}


def async_save_options() -> dict[str, Any]:
    """What an asynchronous ``dist_checkpointing.save`` needs to write with megatron-core's own writer."""
    return dict(_ASYNC_OPTIONS)


def is_megatron_writer(write: Callable) -> bool:
    """Whether an async request's ``async_fn`` is megatron-core's multi-bucket writer."""
    return getattr(write, "func", None) in ASYNC_WRITERS


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def writer_errors() -> Iterator[list[str]]:
    """The error lines megatron-core's writer logs inside the scope (see the module docstring)."""
    logger, kept = logging.getLogger(filesystem_async.__name__), _Kept()
    logger.addHandler(kept)
    try:
        yield kept.messages
    finally:
        logger.removeHandler(kept)
