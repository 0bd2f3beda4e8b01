"""Finding host synchronisations in code that must not make them, on any machine.

On a GPU, reading a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``), asking for an output whose size depends on the data (``torch.nonzero``,
boolean-mask indexing, ``torch.unique``) or ``torch.cuda.synchronize()`` makes the host wait
for every kernel queued before it. Inside a backward hook that empties the launch queue and
the overlap of communication with backward is gone. On a CPU the same calls cost nothing,
so a CPU run cannot feel them; it can count them:

    with HostSyncAudit(package="higgs_megatron") as audit:
        ...  # the code under audit
    audit.calls  # {"higgs_megatron/ddp.py:288 start_grad_sync: Tensor.__bool__": 4, ...}

The audit is a ``TorchFunctionMode``: it sees every torch call made inside the block on this
thread, and charges one to the first frame outside torch's own files, counted only when that
frame lies in ``package`` (a call that megatron-core or the caller makes is theirs).
``pause()`` stops counting for a stretch inside the block.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = __file__

# Tensor-to-Python conversions and copies to the host.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
# Calls whose output size depends on the data.
_DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
                   torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
                   torch.unique_consecutive, torch.Tensor.unique_consecutive}


def _name(func: Any) -> str:
    owner = "Tensor." if getattr(func, "__objclass__", None) is torch._C.TensorBase else "torch."
    return owner + getattr(func, "__name__", repr(func))


def _is_bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _is_host_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in _READS or func in _DATA_DEPENDENT:
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
        return _is_bool_index(args[1])
    if func is torch.Tensor.to:  # a copy to the host, by device argument
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(str(t).startswith("cpu") for t in targets if isinstance(t, (str, torch.device)))
    if func is torch.where and len(args) == 1 and not kwargs:
        return True
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    return False


class HostSyncAudit(TorchFunctionMode):
    """Counts host synchronisations made by ``package``'s code (see the module docstring)."""

    def __init__(self, package: str = "higgs_megatron") -> None:
        super().__init__()
        self.package = package
        self.calls: Counter[str] = Counter()
        self._paused = 0
        self._saved_synchronize = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused and _is_host_sync(func, args, kwargs):
            self._charge(_name(func))
        return func(*args, **kwargs)

    def _charge(self, what: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                     or frame.f_code.co_filename == _THIS_FILE):
            frame = frame.f_back
        if frame is None:
            return
        path = frame.f_code.co_filename.replace(os.sep, "/")
        marker = f"/{self.package}/"
        if marker not in path:
            return
        site = self.package + "/" + path.rsplit(marker, 1)[1]
        self.calls[f"{site}:{frame.f_lineno} {frame.f_code.co_name}: {what}"] += 1

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self) -> "HostSyncAudit":
        # torch.cuda.synchronize is no torch function: wrap it for the duration.
        self._saved_synchronize = torch.cuda.synchronize

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            if not self._paused:
                self._charge("torch.cuda.synchronize")
            return self._saved_synchronize(*args, **kwargs)

        torch.cuda.synchronize = synchronize
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize = self._saved_synchronize
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def report(self) -> str:
        return "\n".join(f"{count:5d}  {site}" for site, count in self.calls.most_common())
