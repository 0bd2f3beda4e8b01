"""Megatron-LM's training code on CPU with gloo: what it assumes beyond megatron-core.

``higgs_megatron.cpu.cpu_megatron()`` already answers megatron-core's CUDA assumptions
(device placement, ``Tensor.type()`` strings, streams, events, the "CUDA" RNG).
Megatron-LM's ``megatron.training`` adds a few of its own, answered here inside
``megatron_lm_on_cpu()`` and undone on exit:

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``: ``pretrain()`` is
  given a version that passes it.
* ``megatron.legacy.fused_kernels.load`` (0.16.1's checkout; gone from 0.18 on) builds CUDA
  kernels with nvcc: on CPU there is nothing to build, so it does nothing.
* ``_initialize_distributed`` builds the model-parallel groups only when
  ``torch.cuda.device_count() > 0``: it is told of one device, and ``set_device`` does nothing.
* the random streams: on a GPU, dropout draws from the CUDA generator and the data loader's
  seed from the CPU one; on CPU they are one generator, so building the data iterators
  (after a checkpoint's RNG state has been restored) would shift dropout's stream and a
  resumed run would not continue the saved one. Building them is fenced off
  (``torch.random.fork_rng``), as the CUDA generator is fenced off from it on a GPU.
* the persistent checkpoint worker (``--async-save``) is a spawned process that divides by
  ``torch.cuda.device_count()``: it is started through ``persistent_worker_on_cpu``.
* memory reports ask the caching allocator (``memory_allocated``, ``memory_stats``,
  ``mem_get_info``, ``get_device_properties``...): answered as an empty device, so the
  "memory (MB)" lines read 0 rather than crash.

Needed flags stay flags (the launcher does not add them silently): ``--distributed-backend
gloo --transformer-impl local --no-gradient-accumulation-fusion`` and the ``--no-*-fusion``
flags that select torch.compile'd or CUDA-only fusions; ``cpu_flag_problems`` names the
missing ones before anything starts.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from higgs_megatron.compat.rebind import rebound
from higgs_megatron.cpu import named_noop, cpu_megatron

# (flag, how argparse stores it, the value CPU needs); a flag whose dest changed between
# releases is listed once per dest, and only the dest the release parses is checked
CPU_FLAGS = (
    ("--distributed-backend gloo", "distributed_backend", "gloo"),
    ("--transformer-impl local", "transformer_impl", "local"),
    ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", False),
    ("--no-masked-softmax-fusion", "masked_softmax_fusion", False),
    ("--no-bias-gelu-fusion", "bias_gelu_fusion", False),
    ("--no-bias-dropout-fusion", "bias_dropout_fusion", False),
    ("--no-persist-layer-norm", "persist_layer_norm", False),  # 0.16.1
    ("--no-persist-layer-norm", "no_persist_layer_norm", True),  # from 0.18
    ("--no-rope-fusion", "apply_rope_fusion", False),
)


def cpu_flag_problems(args: Any) -> list[str]:
    """The flags a CPU run of pretrain_gpt.py lacks (empty when it has them all)."""
    return list(dict.fromkeys(flag for flag, name, value in CPU_FLAGS
                              if hasattr(args, name) and getattr(args, name) != value))


_DEVICE = SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0,
                          gcnArchName="", uuid="cpu")


def _zero(name: str) -> Any:
    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    zero.__name__ = zero.__qualname__ = name
    return zero


_MEMORY_REPORTS = {
    "device_count": lambda: 1,
    "set_device": named_noop("set_device"),
    "memory_allocated": _zero("memory_allocated"),
    "max_memory_allocated": _zero("max_memory_allocated"),
    "memory_reserved": _zero("memory_reserved"),
    "max_memory_reserved": _zero("max_memory_reserved"),
    "memory_stats": lambda *a, **k: {},
    "mem_get_info": lambda *a, **k: (0, 0),
    "reset_peak_memory_stats": named_noop("reset_peak_memory_stats"),
    "reset_max_memory_allocated": named_noop("reset_max_memory_allocated"),
    "get_device_properties": lambda *a, **k: _DEVICE,
    "get_device_name": lambda *a, **k: _DEVICE.name,
    "get_device_capability": lambda *a, **k: (0, 0),
}


def persistent_worker_on_cpu(*args: Any, **kwargs: Any) -> Any:
    """The persistent checkpoint worker's loop, in the process Megatron spawns for it. The
    worker picks its device as ``rank % torch.cuda.device_count()``, which divides by zero
    without CUDA, and synchronizes the device after its host copy. And that host copy, the
    snapshot the trainer waits for, is ``tensor.to("cpu")``: on CPU no copy at all, so the
    worker would write parameters the trainer is already updating; here it clones.
    (Spawn pickles the loop by name: this module-level function is what the child imports.)"""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = named_noop("set_device")
    torch.cuda.synchronize = named_noop("synchronize")
    FileSystemWriterAsync.preload_tensors = staticmethod(_preload_copies(FileSystemWriterAsync.preload_tensors))
    return PersistentAsyncCaller.async_loop(*args, **kwargs)  # unpatched in this fresh process


def _preload_copies(preload: Any) -> Any:
    def preload_copies(write_buckets: Any, non_blocking: bool = True) -> Any:
        return [(name, key, (data, [(item, tensor.clone()) for item, tensor in tensors]))
                for name, key, (data, tensors) in preload(write_buckets, False)]

    return preload_copies


def _fenced_from_rng(function: Any) -> Any:
    @functools.wraps(function)
    def fenced(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return function(*args, **kwargs)

    return fenced


@contextlib.contextmanager
def megatron_lm_on_cpu() -> Iterator[None]:
    """Run Megatron-LM's ``pretrain()`` on CPU for the duration of the block."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
    import megatron.training.training as training

    bindings = [(torch.cuda, name, value) for name, value in _MEMORY_REPORTS.items()]
    try:
        import megatron.legacy.fused_kernels as fused_kernels
    except ImportError:  # from 0.18 on nothing builds kernels at start
        pass
    else:
        bindings.append((fused_kernels, "load", named_noop("load")))
    bindings += [
        (PersistentAsyncCaller, "async_loop", staticmethod(persistent_worker_on_cpu)),
        (training, "build_train_valid_test_data_iterators",
         _fenced_from_rng(training.build_train_valid_test_data_iterators)),
        (training, "initialize_megatron", functools.partial(training.initialize_megatron, allow_no_cuda=True)),
    ]
    with cpu_megatron(), rebound(*bindings):
        yield
