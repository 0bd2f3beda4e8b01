"""Optimizer state that leaves the device only while device memory runs short.

``probe`` reads memory use (the CUDA caching allocator, host RAM, or a scripted schedule);
``policy`` decides, from a reading, which state units should be away (threshold and
hysteresis, pure arithmetic); ``tiers`` moves tensors to pinned/pageable host memory or to
files ("nvme") and back, byte for byte; ``manager`` attaches all three to a Megatron
optimizer's ``step``.
"""

from .manager import MemoryManager, OffloadConfig, OffloadError
from .probe import CudaProbe, HostProbe, MemoryReading, ScriptedProbe, make_probe

__all__ = ["MemoryManager", "OffloadConfig", "OffloadError", "CudaProbe", "HostProbe", "MemoryReading",
           "ScriptedProbe", "make_probe"]
