"""How full the device is: the manager asks a probe once per optimizer step.

A probe returns the *peak* use since it was last reset: the manager reads it as a step
begins and resets it once the step has put offloaded state away again, so the decision sees
the forward/backward that just ran (when activations hold the memory), not the optimizer
step, which pages everything in. ``CudaProbe`` reads the caching allocator (peak allocated
bytes); ``HostProbe`` reads host RAM (for a CPU run, host memory *is* the
device); ``ScriptedProbe`` replays a schedule of fractions, one per read, so the policy can
be exercised step by step, deterministically, without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class MemoryReading:
    used_bytes: int
    total_bytes: int

    @property
    def fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


class MemoryProbe(Protocol):
    def read(self) -> MemoryReading:
        """Peak use since the last reset, and the capacity."""

    def reset(self) -> None:
        """Start a new peak window."""


class CudaProbe:
    """The caching allocator's peak allocated bytes against the device's total memory."""

    def __init__(self, device: int | None = None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryReading:
        # Allocated, not reserved: state sent away returns to the caching allocator but stays
        # reserved, so a reserved-based reading would never fall and state would never return.
        used = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(used_bytes=int(used), total_bytes=int(total))

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class HostProbe:
    """Host RAM in use (total minus available) against its total: the device of a CPU run."""

    def read(self) -> MemoryReading:
        import psutil

        memory = psutil.virtual_memory()
        return MemoryReading(used_bytes=int(memory.total - memory.available), total_bytes=int(memory.total))

    def reset(self) -> None:
        pass


class ScriptedProbe:
    """Replays ``fractions`` (one per read; the last repeats) of ``total_bytes``."""

    def __init__(self, fractions: Sequence[float], total_bytes: int = 1 << 30) -> None:
        if not fractions:
            raise ValueError("a scripted probe needs at least one fraction")
        self.fractions = list(fractions)
        self.total_bytes = total_bytes
        self.reads = 0

    def read(self) -> MemoryReading:
        fraction = self.fractions[min(self.reads, len(self.fractions) - 1)]
        self.reads += 1
        return MemoryReading(used_bytes=int(fraction * self.total_bytes), total_bytes=self.total_bytes)

    def reset(self) -> None:
        pass

    @classmethod
    def parse(cls, text: str, total_bytes: int = 1 << 30) -> "ScriptedProbe":
        """``"0.5x3,0.95x2,0.6"``: 0.5 for three steps, 0.95 for two, then 0.6 onwards."""
        fractions: list[float] = []
        for part in text.split(","):
            value, _, count = part.strip().partition("x")
            fraction = float(value)
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"{part!r}: a memory fraction must be in [0, 1]")
            fractions += [fraction] * (int(count) if count else 1)
        return cls(fractions, total_bytes)


def make_probe(schedule: str | None = None) -> MemoryProbe:
    """``--higgs-offload-schedule`` when given; else the CUDA allocator, or host RAM on a CPU run."""
    if schedule:
        return ScriptedProbe.parse(schedule)
    return CudaProbe() if torch.cuda.is_available() else HostProbe()
