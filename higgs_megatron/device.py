"""Device plumbing shared by the gradient path, the checkpoint writer and the offload tiers.

Stream order, for every helper here (CUDA semantics; on a CPU every operation is already
ordered and each helper reduces to a plain copy or a wall-clock reading):

* ``DeviceTimer`` records a pair of CUDA events on the *current* stream around the work it
  times, and reads them only once they have completed (``Event.query``, which never waits):
  timing a step costs the host no wait. ``seconds(wait=True)`` is for the end of a run.
* ``HostCopy`` copies device tensors into freshly allocated pinned host buffers on a side
  stream. The side stream first waits on an event recorded on the caller's stream when the
  copy was *requested* (so it reads the tensors as they were then, whatever the caller's
  stream queues afterwards); each source tensor is marked as used by the side stream
  (``record_stream``) so the caching allocator cannot hand its memory to anyone else before
  the copy has read it; ``done`` is an event recorded on the side stream after the last copy.
  Whoever is about to change a source tensor in place makes *its* stream wait on ``done``
  (``order_before``: a device-side wait, the host never blocks); whoever reads the host
  buffers waits on ``done`` from the host (``host_ready``), which only the writer thread does.
* ``to_device`` moves a batch with ``non_blocking=True``: from pinned memory that is an
  asynchronous copy on the current stream, ordered before the kernels that read it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator, Mapping

import torch


def pinned_empty(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer, page-locked where CUDA exists (a device copy into pageable memory is
    synchronous; into pinned memory it is a DMA the host need not wait for)."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())


def pin_batch(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch in page-locked host memory where CUDA exists (so that ``to_device`` copies it
    without the host waiting); as it is elsewhere."""
    if not torch.cuda.is_available():
        return dict(batch)
    return {key: value.pin_memory() for key, value in batch.items()}


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on ``device``, copied without waiting (see the module docstring)."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def collective_device() -> torch.device:
    """Where a tensor handed to a collective of the default group must live: this rank's
    CUDA device where CUDA exists (NCCL takes no host tensors; gloo takes both), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(module: torch.nn.Module) -> torch.device:
    """Where the module's parameters live (the device its inputs must be on)."""
    for param in module.parameters():
        return param.device
    return torch.device("cpu")


class DeviceTimer:
    """Sums the time of marked intervals of device work without making the host wait."""

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_started: float | None = None
        self._cuda = False
        self._seconds = 0.0

    @contextlib.contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        """Time the device work queued inside the block (an interval left by an exception is
        dropped, not read)."""
        self.start(device)
        try:
            yield
        except BaseException:
            if self._cuda:
                self._pending.pop()
            self._host_started = None
            raise
        self.stop()

    def start(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._pending.append((begin, torch.cuda.Event(enable_timing=True)))
        else:
            self._host_started = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._pending[-1][1].record()
        elif self._host_started is not None:
            self._seconds += time.perf_counter() - self._host_started
            self._host_started = None

    def seconds(self, wait: bool = False) -> float:
        """Time of the intervals completed so far, then forgotten; with ``wait``, of all of
        them (the host waits for the device). An interval not yet done counts next time."""
        still = []
        for begin, end in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                self._seconds += begin.elapsed_time(end) / 1000.0
            else:
                still.append((begin, end))
        self._pending = still
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def request_event() -> "torch.cuda.Event | None":
    """An event on the current stream marking "the tensors as they are now" for a later
    ``HostCopy``; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class HostCopy:
    """Device tensors copied into pinned host memory behind the caller's back (see the
    module docstring). Host tensors are copied too (``clone``): the caller's tensors keep
    changing after the request, and the copy must not."""

    def __init__(self, tensors: Iterable[torch.Tensor], requested: "torch.cuda.Event | None" = None,
                 device: int | torch.device | None = None) -> None:
        """``requested``: an event recorded on the stream that owns the tensors, when the copy
        was asked for (``request_event``); default: recorded now, on the current stream. A
        copy issued from another thread (the checkpoint writer) needs the owner's event."""
        tensors = list(tensors)
        self.done: torch.cuda.Event | None = None
        if not any(t.device.type == "cuda" for t in tensors):
            self.copies = [t.clone() for t in tensors]
            return
        requested = requested or request_event()
        # Host tensors are cloned by the host: it waits for the work queued before the request
        # (a pending device-to-host copy into one of them, say) so that the clone is of that state.
        if any(t.device.type != "cuda" for t in tensors):
            requested.synchronize()
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_event(requested)
        self.copies = []
        with torch.cuda.stream(self.stream):
            for tensor in tensors:
                if tensor.device.type != "cuda":
                    self.copies.append(tensor.clone())
                    continue
                host = pinned_empty(tensor.shape, tensor.dtype)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)
                self.copies.append(host)
            self.done = torch.cuda.Event(blocking=True)  # host_ready sleeps rather than spins
            self.done.record(self.stream)

    def order_before(self) -> None:
        """The current stream's later work (an optimizer step) runs after the copy: a wait on
        the device, not on the host."""
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)

    def host_ready(self) -> list[torch.Tensor]:
        """The host copies, once they hold the bytes (the host waits for the copy here)."""
        if self.done is not None:
            self.done.synchronize()
        return self.copies
