"""MemoryManager: a Megatron optimizer whose state leaves the device only under pressure.

Protocol, every optimizer step (``attach`` routes the optimizer's ``step`` here):

1. read the probe: the peak device use of the forward/backward just run;
2. ``policy.decide`` which units should be away (a unit is one parameter group of one of
   the optimizer's torch optimizers: its moments, and its fp32 main parameters when the
   optimizer keeps its own copies); log what is newly sent away or brought back, and why;
3. bring every unit that is away back to the device, run the optimizer step there, then
   send the units that should be away out again (to host memory or to files), and reset
   the probe's peak.

So state is away during forward and backward, when activations need the memory, and on
the device for the step itself, with the optimizer untouched: "paged in around the step".
Running the step on the host instead (megatron-core's ``HybridDeviceOptimizer``) saves the
two copies but needs a host optimizer and grads copied out; on a machine without a GPU
both are the same host memory, so the choice is made for generality and exactness (the
step is the optimizer's own, bitwise; see the README for what is and is not measured).

Checkpoints read the state: the runtime brings everything back as a save starts
(``bring_all``, from ``Runtime.checkpoint_phase``: a save may read Megatron's optimizer
beneath this one), ``sharded_state_dict`` and ``state_dict`` do too, and the runtime calls
``settle`` once the save has its copy, which sends it away again; ``load_state_dict`` loads into resident tensors. A tier that fails part-way through
sending a unit (a full disk) gets back what it took; the unit stays, and an event says so.
``close`` brings everything back and removes the tier's files.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..field_flags import field_flag, flag_metadata
from ..launcher import process_rank
from ..checkpoint.state import torch_optimizers
from .policy import Decision, decide
from .probe import MemoryProbe
from .tiers import Away, FileTier, HostTier

OFFLOAD_DEVICES = ("cpu", "nvme")


class OffloadError(ValueError):
    """A setting of the memory manager cannot work; the message names the flag."""


@dataclass
class OffloadConfig:
    """Where optimizer state goes and when; each field declares its ``--higgs-offload*`` flag."""

    threshold: float = field(default=0.85, metadata=flag_metadata(
        "--higgs-offload-threshold", "fraction of device memory, in (0, 1)", type=float))
    """Send state away when peak device use exceeds this fraction of device memory, in (0, 1)."""
    hysteresis: float = field(default=0.05, metadata=flag_metadata(
        "--higgs-offload-hysteresis", "state comes back only below threshold - hysteresis", type=float))
    """Bring it back only below ``threshold - hysteresis``, in [0, threshold)."""
    device: str = field(default="cpu", metadata=flag_metadata(
        "--higgs-offload-device", "cpu: host memory; nvme: files under --higgs-offload-dir", choices=OFFLOAD_DEVICES))
    """'cpu' (host memory) or 'nvme' (files under ``directory``)."""
    directory: str | None = field(default=None, metadata=flag_metadata(
        "--higgs-offload-dir", "where the nvme tier writes its files", metavar="DIR"))
    pin_memory: bool = field(default=True, metadata=flag_metadata(
        "--no-higgs-pin-memory", "pageable host copies (pinned memory is faster to a GPU but never reclaimable)",
        action="store_false"))
    """Pinned host copies (faster to and from a GPU; never reclaimable: capped by ``pin_limit_bytes``)."""
    pin_limit_bytes: int | None = None
    """Default: a quarter of host memory (the flag, ``--higgs-pin-memory-limit-gb``, is in GiB)."""

    def __post_init__(self) -> None:
        def flag(name: str) -> str:
            return field_flag(OffloadConfig, name)

        if not (0.0 < self.threshold < 1.0):
            raise OffloadError(f"{flag('threshold')} {self.threshold}: expected a fraction in (0, 1)")
        if not (0.0 <= self.hysteresis < self.threshold):
            raise OffloadError(f"{flag('hysteresis')} {self.hysteresis}: expected a fraction in "
                               f"[0, {self.threshold}) (below the threshold)")
        if self.device not in OFFLOAD_DEVICES:
            raise OffloadError(f"{flag('device')} {self.device!r}: expected one of {', '.join(OFFLOAD_DEVICES)}")
        if self.device == "nvme":
            if not self.directory:
                raise OffloadError(f"{flag('device')} nvme: needs {flag('directory')} DIR")
            check_writable(Path(self.directory))


def check_writable(directory: Path) -> None:
    """Whether the directory could be made and written, without making it (validation leaves
    nothing behind; the tier makes it at setup): a temporary file is written and removed in
    the directory, or in its nearest existing ancestor when it does not exist yet."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a directory"
    else:
        try:
            with tempfile.NamedTemporaryFile(dir=existing, prefix=".higgs-write-test-"):
                pass
        except OSError as error:
            problem = error.strerror
    if problem:
        raise OffloadError(f"--higgs-offload-dir {directory}: not a writable directory ({problem})")


@dataclass
class Unit:
    name: str
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    """Its size when resident (fixed once the state exists; away, its tensors hold nothing)."""


def _own_main_param(param: torch.Tensor, model_params: set[int]) -> bool:
    """The optimizer's own fp32 copy (not a model parameter, nor a view of one)."""
    return id(param) not in model_params and param._base is None


def optimizer_units(optimizer: Any, model_chunks: list[torch.nn.Module]) -> list[Unit]:
    """One unit per parameter group: its state tensors, and its main parameters when they are
    the optimizer's own (not the model's parameters, nor views of them)."""
    model_params = {id(p) for chunk in model_chunks for p in chunk.parameters()}
    units = []
    for index, (_, torch_optimizer) in enumerate(torch_optimizers(optimizer)):
        for group_index, group in enumerate(torch_optimizer.param_groups):
            unit = Unit(name=f"optimizer{index}.group{group_index}")
            for param in group["params"]:
                for value in torch_optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        unit.tensors.append(value)
                if _own_main_param(param, model_params):
                    unit.tensors.append(param)
            if unit.tensors:
                unit.nbytes = sum(t.numel() * t.element_size() for t in unit.tensors)
                units.append(unit)
    return units


def estimated_state_bytes(optimizer: Any, model_chunks: list[torch.nn.Module]) -> int:
    """This rank's optimizer state before it exists (Adam's moments appear at the first step):
    two fp32 moments per parameter the optimizer holds, plus its own fp32 main parameters."""
    model_params = {id(p) for chunk in model_chunks for p in chunk.parameters()}
    total = 0
    for _, torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                total += 2 * param.numel() * 4
                if _own_main_param(param, model_params):
                    total += param.numel() * param.element_size()
    return total


class MemoryManager:
    """See the module docstring. ``on_event(name, message, **fields)`` hears of every move."""

    def __init__(self, optimizer: Any, model_chunks: list[torch.nn.Module], config: OffloadConfig,
                 probe: MemoryProbe, on_event: Callable[..., None] | None = None) -> None:
        self.optimizer = optimizer
        self.model_chunks = model_chunks
        self.config = config
        self.probe = probe
        self.on_event = on_event or (lambda *args, **kwargs: None)
        self.units: list[Unit] = []
        self.away: frozenset[int] = frozenset()
        self.parked: dict[int, list[Away]] = {}
        self.steps = 0
        if config.device == "nvme":
            self.tier: HostTier | FileTier = FileTier(Path(config.directory) / f"rank{process_rank()}")
        else:
            limit = (config.pin_limit_bytes if config.pin_limit_bytes is not None
                     else _host_total() // 4 // _local_ranks())
            self.tier = HostTier(pin_memory=config.pin_memory, pin_limit_bytes=limit)
        self._attached = False

    # --- the optimizer's side ---------------------------------------------------------

    def attach(self) -> "MemoryManager":
        """Route the optimizer's ``step`` (and its state-dict methods) through the manager, on
        this optimizer object only; ``close`` undoes it."""
        self._check_room(estimated_state_bytes(self.optimizer, self.model_chunks))
        self.optimizer.step = self.step
        for name in ("state_dict", "sharded_state_dict", "load_state_dict"):
            setattr(self.optimizer, name, self._resident_then(name))
        self._attached = True
        return self

    def _call_optimizer(self, name: str, *args: Any, **kwargs: Any) -> Any:
        # Looked up on the class at call time, so that class-level patches (checkpoint scopes) apply.
        return getattr(type(self.optimizer), name)(self.optimizer, *args, **kwargs)

    def _resident_then(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.bring_all()
            return self._call_optimizer(name, *args, **kwargs)

        return call

    def step(self) -> Any:
        reading = self.probe.read()
        if not self.units:  # Adam's state appears at the first step: decisions start at the second
            result = self._call_optimizer("step")
            self.units = optimizer_units(self.optimizer, self.model_chunks)
            self.probe.reset()
            self.steps += 1
            return result
        sizes = [unit.nbytes for unit in self.units]
        decision = decide(reading.used_bytes, reading.total_bytes, sizes, self.away, self.config.threshold,
                          self.config.hysteresis)
        self.bring_all()
        result = self._call_optimizer("step")
        self.away = decision.away
        for index in sorted(self.away):
            self._send(index)
        if set(decision.sent) - self.away:  # a tier failed: report only what moved
            decision = replace(decision, sent=tuple(i for i in decision.sent if i in self.away))
        self.probe.reset()
        if decision.sent or decision.returned:
            self._report(decision, reading.fraction, sizes)
        self.steps += 1
        return result

    def _report(self, decision: Decision, fraction: float, sizes: list[int]) -> None:
        moved = decision.sent or decision.returned
        what = "offloaded" if decision.sent else "reloaded"
        where = f"to {self.tier.name}" if decision.sent else f"from {self.tier.name}"
        fields: dict[str, Any] = dict(
            units=[self.units[i].name for i in moved], bytes=sum(sizes[i] for i in moved), tier=self.tier.name,
            reason=decision.reason, used_fraction=fraction, resident_bytes=self.resident_bytes(),
            state_bytes=sum(sizes))
        if isinstance(self.tier, FileTier):
            fields["on_disk_bytes"] = sum(p.stat().st_size for p in self.tier.directory.glob("*.bin"))
        self.on_event(f"optimizer_state_{what}",
                      f" {what} {', '.join(fields['units'])} ({fields['bytes'] / 1e6:.2f} MB) {where}: "
                      f"{decision.reason}; {fields['resident_bytes'] / 1e6:.2f} of {fields['state_bytes'] / 1e6:.2f} "
                      "MB of optimizer state resident", **fields)

    def resident_bytes(self) -> int:
        """Bytes of optimizer state on the device now (what is away counts nothing)."""
        return sum(unit.nbytes for i, unit in enumerate(self.units) if i not in self.parked)

    def close(self) -> None:
        self.bring_all()
        self.away = frozenset()
        self.tier.close()
        if self._attached:
            for name in ("step", "state_dict", "sharded_state_dict", "load_state_dict"):
                self.optimizer.__dict__.pop(name, None)
            self._attached = False
        if isinstance(self.tier, FileTier):
            shutil.rmtree(self.tier.directory, ignore_errors=True)

    # --- moving -----------------------------------------------------------------------

    def _send(self, index: int) -> None:
        """All of a unit's tensors go, or none: a tier that fails part-way (a full disk) gets
        back what it took, the unit stays resident, and the error is an event, not a crash."""
        if index in self.parked:
            return
        unit = self.units[index]
        sent: list[Away] = []
        try:
            for k, tensor in enumerate(unit.tensors):
                sent.append(self.tier.send(f"{unit.name}.t{k}", tensor))
        except (OSError, RuntimeError) as error:
            for away, tensor in zip(sent, unit.tensors):
                self.tier.bring(away, tensor)
            self.away = self.away - {index}
            self.on_event("optimizer_state_offload_failed",
                          f" could not send {unit.name} to {self.tier.name} ({error}); it stays on the device",
                          units=[unit.name], tier=self.tier.name, error=str(error))
            return
        self.parked[index] = sent

    def settle(self) -> None:
        """After a checkpoint has read (or copied) the state: what should be away goes away
        again now, rather than at the end of the next step, through whose forward and backward
        it would otherwise stay on the device."""
        for index in sorted(self.away):
            self._send(index)

    def bring_all(self) -> None:
        for index in sorted(self.parked):
            for away, tensor in zip(self.parked[index], self.units[index].tensors):
                self.tier.bring(away, tensor)
        self.parked.clear()

    def _check_room(self, needed: int) -> None:
        """Before training: the host (or the disk) must hold all of this rank's optimizer state."""
        if isinstance(self.tier, FileTier):
            free = shutil.disk_usage(self.tier.directory).free
            where = f"--higgs-offload-dir {self.config.directory} has {free / 1e9:.2f} GB free"
        else:
            free = _host_available()
            where = f"the host has {free / 1e9:.2f} GB available"
        ranks = _local_ranks()  # the ranks of this host share its memory and its disk
        if needed * ranks > free:
            raise OffloadError(f"--higgs-offload-device {self.config.device}: the optimizer state of this rank is "
                               f"{needed / 1e9:.2f} GB ({needed * ranks / 1e9:.2f} GB for this host's {ranks} "
                               f"rank(s)) and {where}")


def _local_ranks() -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else Slurm's SLURM_NTASKS_PER_NODE
    (srun), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        digits = re.match(r"\d+", os.environ.get(name, ""))
        if digits:
            return max(1, int(digits.group()))
    return 1


def _host_total() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def _host_available() -> int:
    import psutil

    return int(psutil.virtual_memory().available)
