"""Optimizer-state offload attached to a run, the same under both front-ends: the memory
manager on the wrapped optimizer, and what it says it will do (``--higgs-offload``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..memory import MemoryManager, OffloadConfig, make_probe

Say = Callable[[str, str, dict], None]  # (event name, message, fields): the front-end's log


def attach_offload(optimizer: Any, model_chunks: list, config: OffloadConfig, schedule: str | None,
                   on_event: Callable[..., None], say: Say) -> MemoryManager:
    """Attach the memory manager (``memory.manager``) to ``optimizer``; ``on_event`` hears each
    move, ``say`` the start-up lines (one warns where offloading frees nothing)."""
    probe = make_probe(schedule)
    if not torch.cuda.is_available() and config.device == "cpu":
        say("offload_frees_nothing", " --higgs-offload-device cpu on a CPU run: the device is host memory, so "
            "offloaded state moves without freeing anything (and the host probe reads the whole machine's use); "
            "useful to test the policy, not to save memory", {})
    manager = MemoryManager(optimizer, model_chunks, config, probe, on_event=on_event).attach()
    say("offload_ready", f" optimizer state leaves the device above {config.threshold:.0%} of its memory, returns "
        f"below {config.threshold - config.hysteresis:.0%} (tier {config.device}; probe {type(probe).__name__})",
        dict(threshold=config.threshold, hysteresis=config.hysteresis, tier=config.device,
             probe=type(probe).__name__))
    return manager
