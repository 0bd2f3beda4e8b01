"""Where offloaded optimizer tensors wait: host memory or files. Byte-exact both ways.

A tier sends a tensor away (``send``: returns a handle and frees the tensor's device
storage by pointing it at an empty one) and brings it back (``bring``: the same bytes,
on the tensor's device, in the same Python object, so the optimizer's references stay
valid).

* ``HostTier``: a host copy, pinned while the pinned total stays under ``pin_limit_bytes``
  (pinned host memory cannot be reclaimed by the OS, so it is capped; beyond the cap, and
  with ``pin_memory=False``, copies are pageable). On a CPU-only machine the device *is*
  the host, and the copy only moves the bytes.

  Stream order: both copies are ``non_blocking`` on the current stream, so with pinned
  memory neither makes the host wait. Sending queues the device-to-host copy, then frees the
  device storage: the caching allocator hands that memory only to work queued later on the
  same stream, which runs after the copy. Bringing back queues the host-to-device copy ahead
  of the optimizer step's kernels on the same stream, which therefore read the returned
  state; torch's pinned-memory allocator keeps the host buffer until its copy has run. State
  comes back when the step is launched, not earlier: bringing it back during backward would
  hold the memory while activations peak, which is what offloading is for.
* ``FileTier`` ("nvme"): the raw bytes written to ``<directory>/<name>.bin`` (through the
  page cache; the file is fsynced so the bytes are on the disk), read back with
  ``numpy.fromfile``; the file is removed once the tensor is back, and ``close()`` removes
  any left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class Away:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    host: torch.Tensor | None = None  # HostTier
    path: Path | None = None          # FileTier


def _free(tensor: torch.Tensor) -> None:
    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class HostTier:
    name = "cpu"

    def __init__(self, pin_memory: bool = True, pin_limit_bytes: int | None = None) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.pin_limit_bytes = pin_limit_bytes
        self.pinned_bytes = 0

    def send(self, name: str, tensor: torch.Tensor) -> Away:
        nbytes = tensor.numel() * tensor.element_size()
        pin = self.pin_memory and (self.pin_limit_bytes is None or self.pinned_bytes + nbytes <= self.pin_limit_bytes)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        self.pinned_bytes += nbytes if pin else 0
        away = Away(name, tensor.shape, tensor.dtype, tensor.device, nbytes, host=host)
        _free(tensor)
        return away

    def bring(self, away: Away, tensor: torch.Tensor) -> None:
        assert away.host is not None
        tensor.data = (away.host.to(away.device, non_blocking=away.host.is_pinned())
                       if away.device.type != "cpu" else away.host)
        if away.host.is_pinned():
            self.pinned_bytes -= away.nbytes
        away.host = None

    def close(self) -> None:
        pass


class FileTier:
    name = "nvme"

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def send(self, name: str, tensor: torch.Tensor) -> Away:
        path = self.directory / f"{name}.bin"
        host = tensor.detach().to("cpu").contiguous()  # the file needs the bytes: the host waits here
        raw = host.reshape(-1).view(torch.uint8)
        try:
            with open(path, "wb") as f:
                raw.numpy().tofile(f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)  # a part-written file would keep a full disk full
            raise
        away = Away(name, tensor.shape, tensor.dtype, tensor.device, tensor.numel() * tensor.element_size(),
                    path=path)
        _free(tensor)
        return away

    def bring(self, away: Away, tensor: torch.Tensor) -> None:
        assert away.path is not None
        raw = torch.from_numpy(np.fromfile(away.path, dtype=np.uint8))
        restored = raw.view(away.dtype).reshape(away.shape) if away.nbytes else torch.empty(away.shape, dtype=away.dtype)
        tensor.data = restored.to(away.device) if away.device.type != "cpu" else restored
        away.path.unlink()
        away.path = None

    def close(self) -> None:
        for leftover in self.directory.glob("*.bin"):
            leftover.unlink()
