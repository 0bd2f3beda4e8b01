"""Run megatron-core on CPU with gloo: for tests, CI, and debugging a Megatron job on a laptop.

megatron-core assumes CUDA in a handful of places that have nothing to do with the
math: it allocates with ``device=torch.cuda.current_device()``, calls ``.cuda()``,
asserts ``param.type() == 'torch.cuda.FloatTensor'``, keeps a "CUDA" RNG tracker for
tensor-parallel dropout, synchronizes the device around pipeline p2p and checkpoint
saves, and makes side streams for communication. On a machine without CUDA,
``cpu_megatron()`` answers each of these for the CPU, inside a scope:

    with cpu_megatron():
        ...  # build GPTModel, DDP, optimizer; train; save checkpoints

What the scope does while active (and undoes on exit, in reverse order):

* a ``TorchFunctionMode`` that maps ``device='cuda'`` / ``device=<int>`` to the CPU in
  every torch call, makes ``Tensor.cuda()`` a no-op, and reports CPU tensors'
  ``Tensor.type()`` as ``torch.cuda.*Tensor`` (Megatron's optimizers check that string);
* ``torch.cuda.current_device``, ``synchronize``, ``Stream``, ``stream``,
  ``current_stream``, ``default_stream``, ``Event``, ``empty_cache`` answered for CPU;
* the "CUDA" RNG *is* the CPU generator: ``torch.cuda.{get,set}_rng_state`` and
  ``manual_seed`` act on it, and so do Megatron's ``_{get,set}_cuda_rng_state``, so
  the tensor-parallel RNG tracker forks real, distinct streams for dropout. Megatron's
  warning that the CPU RNG changed inside a GPU RNG fork is filtered: here they are one.

It refuses to activate when CUDA is available (``RuntimeError``), so a GPU job never
runs through it by accident. Torch function modes are per thread: code that Megatron
runs on a helper thread needs its own scope (``cpu_megatron()`` nests and is
reentrant on one thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .compat.rebind import Rebinds

__all__ = ["cpu_megatron", "is_active", "CpuMegatronError"]

_CPU = torch.device("cpu")


class CpuMegatronError(RuntimeError):
    """Raised when the CPU scope is asked for where it must not run (CUDA present)."""


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaCallsOnCpu(TorchFunctionMode):
    """Rewrites CUDA device requests inside torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = dict(kwargs, device=_to_cpu_device(kwargs["device"]))
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and args:
            args = (args[0],) + tuple(
                _to_cpu_device(a) if isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) else a
                for a in args[1:]
            )
        return func(*args, **kwargs)


class _Stream:
    """A CUDA stream stand-in: CPU work is already ordered, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_Event":
        event = event or _Event()
        event.record()
        return event


class _Event:
    """A CUDA event stand-in that records wall-clock time, so elapsed_time is meaningful."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def elapsed_time(self, end: "_Event") -> float:
        assert self._t is not None and end._t is not None, "event not recorded"
        return (end._t - self._t) * 1000.0

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _ForkWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def named_noop(name: str) -> Callable[..., None]:
    """A no-op, one function object per name: torch.compile keeps a table keyed by the torch
    functions it sees, and refuses one object standing for two of them."""

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    nothing.__name__ = nothing.__qualname__ = name
    return nothing


def _cuda_replacements() -> dict[str, Callable[..., Any] | type]:
    return {
        "current_device": lambda: _CPU,
        "synchronize": named_noop("synchronize"),
        "empty_cache": named_noop("empty_cache"),
        "Stream": _Stream,
        "Event": _Event,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "current_stream": lambda *a, **k: _Stream(),
        "default_stream": lambda *a, **k: _Stream(),
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": _cpu_set_rng_state,
        "manual_seed": _cpu_manual_seed,
        # torch.manual_seed itself calls this after seeding the CPU generator.
        "manual_seed_all": named_noop("manual_seed_all"),
    }


class _Scope:
    """One active patch set per process, counted per entry so nested scopes are cheap."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.rebinds = Rebinds()
        self.log_filter = _ForkWarningFilter()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self.rebinds.rebind(owner, name, value)

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                if torch.cuda.is_available():
                    raise CpuMegatronError(
                        "cpu_megatron() is for machines without CUDA; CUDA is available here, "
                        "so run megatron-core on the GPU (backend nccl) instead"
                    )
                for name, value in _cuda_replacements().items():
                    self._patch(torch.cuda, name, value)
                self._patch(torch.cuda.random, "get_rng_state", _cpu_get_rng_state)
                self._patch(torch.cuda.random, "set_rng_state", _cpu_set_rng_state)
                import megatron.core.tensor_parallel.random as mp_random

                self._patch(mp_random, "_get_cuda_rng_state", _cpu_get_rng_state)
                self._patch(mp_random, "_set_cuda_rng_state", _cpu_set_rng_state)
                logging.getLogger(mp_random.__name__).addFilter(self.log_filter)
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                import megatron.core.tensor_parallel.random as mp_random

                logging.getLogger(mp_random.__name__).removeFilter(self.log_filter)
                self.rebinds.restore()


_SCOPE = _Scope()


def is_active() -> bool:
    """True while some thread of this process is inside ``cpu_megatron()``."""
    return _SCOPE.depth > 0


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Make megatron-core run on CPU for the duration of the block (see module docstring)."""
    _SCOPE.enter()
    mode = _CudaCallsOnCpu()
    try:
        with mode:
            yield
    finally:
        _SCOPE.exit()
