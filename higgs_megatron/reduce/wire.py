"""Wire bytes: what each collective of the gradient sync puts on one rank's link, counted at the call.

A byte figure that means something at scale is not what a rank hands a collective but what
the collective's algorithm makes it send. On a ring of P ranks (NCCL's bandwidth-bound
algorithm; gloo's too, for all but its reduce-scatter), for a buffer of B bytes handed in:

* all-reduce:      2(P-1)/P x B (a reduce-scatter then an all-gather of the sums);
* reduce-scatter:  (P-1)/P x B, B the whole input (Megatron's distributed optimizer);
* all-gather:      (P-1) x B, B one rank's input: it grows with P;
* all-to-all:      (P-1)/P x B, B the whole input (each rank keeps its own 1/P).

``Collectives`` issues the sync's collectives through ``torch.distributed`` and counts each one
as it is called, in the process group's size: the count is of the code path that ran, not
of a formula applied to a plan. On torch's fake process group (backend ``fake``: no data
moves) the same code counts what one rank of a group of any size would send.

``GLOO`` gives what gloo's own algorithms move where they are not a ring: its reduce-scatter
is an all-reduce (measured from the bytes its sockets were handed). Tests compare the count
against gloo with it; the figures this layer logs are the ring's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def ring_factor(kind: str, world: int) -> float:
    """Bytes one rank sends per byte it hands a ``kind`` collective over ``world`` ranks."""
    if world <= 1:
        return 0.0
    return {"all_reduce": 2 * (world - 1) / world, "reduce_scatter": (world - 1) / world,
            "all_gather": float(world - 1), "all_to_all": (world - 1) / world}[kind]


def gloo_factor(kind: str, world: int) -> float:
    """As ``ring_factor``, for what gloo moves: its reduce-scatter runs as an all-reduce."""
    return ring_factor("all_reduce" if kind == "reduce_scatter" else kind, world)


def wire_bytes(kind: str, handed: int, world: int) -> float:
    """Ring wire bytes per rank for one collective handed ``handed`` bytes (see the module docstring)."""
    return ring_factor(kind, world) * handed


@dataclass
class WireMeter:
    """Bytes handed to collectives and ring wire bytes per rank since the last ``take``; per
    (kind, group size) as well, for tests and reports."""

    handed: int = 0
    wire: float = 0.0
    by_kind: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, world) -> bytes handed
    calls: int = 0

    def count(self, kind: str, handed: int, world: int) -> None:
        self.calls += 1
        self.handed += handed
        self.wire += wire_bytes(kind, handed, world)
        self.by_kind[(kind, world)] = self.by_kind.get((kind, world), 0) + handed

    def take(self) -> "WireMeter":
        """What was counted so far; the meter starts again from zero."""
        taken = WireMeter(self.handed, self.wire, self.by_kind, self.calls)
        self.handed, self.wire, self.by_kind, self.calls = 0, 0.0, {}, 0
        return taken

    def wire_as(self, factor: Callable[[str, int], float]) -> float:
        """The wire bytes under another algorithm's ``factor(kind, world)`` (e.g. ``gloo_factor``)."""
        return sum(factor(kind, world) * handed for (kind, world), handed in self.by_kind.items())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Collectives:
    """The gradient sync's collectives, each counted by ``meter`` as it is issued. Same
    arguments and return values as ``torch.distributed``'s (a work with ``async_op``).
    ``issue`` is where a collective goes out, and ``rank`` is this rank's place in a group:
    a harness that runs several ranks in one process replaces those two, and every path's code
    runs unchanged."""

    def __init__(self, meter: WireMeter | None = None) -> None:
        self.meter = meter or WireMeter()

    def rank(self, group: dist.ProcessGroup) -> int:
        """This rank's index in ``group``."""
        return dist.get_rank(group)

    def issue(self, kind: str, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op,
              async_op: bool):
        """Issue one collective of ``kind`` (``KINDS``) through ``torch.distributed``."""
        if kind == "all_reduce":
            return dist.all_reduce(output, op=op, group=group, async_op=async_op)
        if kind == "reduce_scatter":
            return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        if kind == "all_gather":
            return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM,
                   async_op: bool = False):
        self.meter.count("all_reduce", _nbytes(tensor), dist.get_world_size(group))
        return self.issue("all_reduce", tensor, tensor, group, op, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                       op=dist.ReduceOp.SUM, async_op: bool = False):
        self.meter.count("reduce_scatter", _nbytes(input), dist.get_world_size(group))
        return self.issue("reduce_scatter", output, input, group, op, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False):
        self.meter.count("all_gather", _nbytes(input), dist.get_world_size(group))
        return self.issue("all_gather", output, input, group, None, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool = False):
        """Equal splits: the i-th of ``world`` equal parts of ``input`` goes to rank i."""
        self.meter.count("all_to_all", _nbytes(input), dist.get_world_size(group))
        return self.issue("all_to_all", output, input, group, None, async_op)


_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def peer_lost(error: BaseException) -> bool:
    """Whether a collective failed because a peer process is gone (gloo's socket errors)."""
    text = str(error).lower()
    return any(marker in text for marker in _PEER_LOST)


def still_pending(work: Any) -> bool:
    """After ``work.wait(timeout)`` raised: whether the collective is still under way (the wait
    ran out) rather than ended in an error. Read from the work itself, not from the error's
    words, which differ by backend and release (gloo says "timed out", NCCL "timing out") and
    share one type (a ``RuntimeError``; ``DistBackendError`` for both on NCCL)."""
    return not work.is_completed()


@dataclass
class StepWaits:
    """How the collectives of one step's sync are waited for, and what gave up on them.

    Without ``timeout``, ``work.wait()``: on NCCL that only makes the current stream wait for
    the collective's end (the host goes on); on gloo the host waits. With ``timeout``,
    ``work.wait(timeout)`` makes the host wait on either backend, at most that long. A wait
    that runs out, or a collective that fails, gives the step's sync up (``failed`` says why):
    that work is not drained (a rank that never returns would hang this one for ever) and no
    later work of the step is waited for (each goes to ``abandoned``), but the pending
    exchanges still issue every collective the other ranks will, so that each given-up one
    completes (gloo) or fails (NCCL's aborted communicator) by the time every rank has voted.
    A peer process found gone raises: only a restart helps then. Across elastic replicas
    (``across_replicas``) it gives the step up like any failure, as does a collective that
    fails to launch: the next quorum leaves that peer out, and the replicas go on."""

    timeout: float | None = None
    failed: str | None = None  # why this step's sync is not to be trusted
    abandoned: list[Any] = field(default_factory=list)  # works of this step given up on, not drained
    across_replicas: bool = False

    def wait(self, work: Any) -> None:
        """Wait for one collective of this step's sync (see the class docstring)."""
        if self.abandoned:  # this step's sync is given up: wait for nothing more
            self.abandoned.append(work)
            return
        if self.timeout is None and not self.across_replicas:
            work.wait()
            return
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as error:
            if peer_lost(error) and not self.across_replicas:
                raise
            self.failed = (f"rank {dist.get_rank()}: gradient sync did not complete within {self.timeout:g}s"
                           if self.timeout is not None and still_pending(work) else
                           f"rank {dist.get_rank()}: gradient sync failed: {str(error).splitlines()[0][:200]}")
            self.abandoned.append(work)

    def launch_failed(self, error: RuntimeError) -> None:
        """A collective of this step's sync failed to launch: expected once the sync is given
        up (NCCL refuses collectives on the communicator a timed-out wait aborted); across
        replicas it gives the sync up; else ``error`` is raised."""
        if self.abandoned:
            return
        if not self.across_replicas:
            raise error
        self.failed = f"rank {dist.get_rank()}: gradient sync failed: {str(error).splitlines()[0][:200]}"
        self.abandoned.append(_NOT_LAUNCHED)

    def launch(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``collective(*args, async_op=True, **kwargs)`` (a ``Collectives`` method): its work, to
        be waited for through ``wait`` (None: its launch failed, and was recorded). After the
        step's sync was given up it still goes out, as on every other rank, but a launch that
        fails is skipped (NCCL refuses collectives on a communicator its timed-out wait aborted)."""
        try:
            return collective(*args, async_op=True, **kwargs)
        except RuntimeError as error:
            self.launch_failed(error)
            return None

    def issue(self, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``launch``, then its work waited for."""
        work = self.launch(collective, *args, **kwargs)
        if work is not None:
            self.wait(work)


class _NotLaunched:
    """Stands in the given-up works for a collective that never launched."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_NOT_LAUNCHED = _NotLaunched()


def wait_works(holder: object, names: tuple[str, ...], waits: StepWaits | None = None) -> None:
    """Wait for each work ``holder`` keeps in the attributes ``names`` (None: already waited
    for), through ``waits`` (a plain ``work.wait()`` without), and clear it."""
    for name in names:
        work = getattr(holder, name)
        if work is not None:
            if waits is None:
                work.wait()
            else:
                waits.wait(work)
            setattr(holder, name, None)


def dense_wire_bytes(bucket_bytes: int, world: int, distributed_optimizer: bool, instances: int = 1) -> float:
    """What Megatron's own dense reduction of one bucket puts on one rank's link: an all-reduce
    over the DP group, or a reduce-scatter with the distributed optimizer; with several
    optimizer instances (``world`` ranks in each), the shard's all-reduce across them too."""
    if not distributed_optimizer:
        return wire_bytes("all_reduce", bucket_bytes, world)
    inside = wire_bytes("reduce_scatter", bucket_bytes, world)
    return inside + (wire_bytes("all_reduce", bucket_bytes // world, instances) if instances > 1 else 0.0)
