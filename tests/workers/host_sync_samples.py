"""One of each host synchronisation the audit must see (tests/sync/drill_host_sync.py)."""

import contextlib

import torch


def every_kind(x: torch.Tensor) -> None:
    x.sum().item()
    bool(x.sum() > 0)
    x.tolist()
    x.cpu()
    torch.nonzero(x)
    x[x > 2]
    x.to("cpu")
    torch.unique(x)
    with contextlib.suppress(RuntimeError, AssertionError):  # no CUDA here: counted before it fails
        torch.cuda.synchronize()
    x.add(1)  # not a sync
