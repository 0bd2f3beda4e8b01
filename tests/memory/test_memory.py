"""The memory manager's parts in one process: the policy, the tiers, the probes, the checks.
(Multi-process runs of the manager under training: tests/memory/drill_offload.py.)"""

import pytest
import torch

from higgs_megatron.memory import OffloadConfig, OffloadError, ScriptedProbe
from higgs_megatron.memory.policy import decide
from higgs_megatron.memory.tiers import FileTier, HostTier

GB = 1 << 30


def test_policy_sends_the_biggest_units_until_the_excess_is_covered():
    d = decide(int(0.95 * GB), GB, [int(0.04 * GB), int(0.08 * GB), int(0.02 * GB)], frozenset(), 0.85, 0.05)
    assert d.sent == (1, 0) and d.away == {0, 1} and "above the threshold 85%" in d.reason
    d = decide(int(0.87 * GB), GB, [int(0.04 * GB), int(0.08 * GB), int(0.02 * GB)], frozenset(), 0.85, 0.05)
    assert d.sent == (1,)  # 2% over: the biggest unit alone covers it
    d = decide(int(0.99 * GB), GB, [10, 20], frozenset({0}), 0.85, 0.05)
    assert d.sent == (1,) and d.away == {0, 1}  # everything away; nothing more to send


def test_policy_holds_inside_the_band_and_brings_back_smallest_first_below_it():
    sizes = [int(0.04 * GB), int(0.08 * GB), int(0.02 * GB)]
    away = frozenset({0, 1, 2})
    for used in (0.85, 0.80, 0.81):
        d = decide(int(used * GB), GB, sizes, away, 0.85, 0.05)
        assert d.away == away and not d.sent and not d.returned
    d = decide(int(0.70 * GB), GB, sizes, away, 0.85, 0.05)
    assert d.returned == (2, 0) and d.away == {1}  # 0.70 + 0.02 + 0.04 <= 0.80; + 0.08 would not be
    d = decide(int(0.10 * GB), GB, sizes, away, 0.85, 0.05)
    assert d.returned == (2, 0, 1) and d.away == frozenset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_tiers_bring_back_the_same_bytes_into_the_same_object(tmp_path, dtype, tier):
    store = HostTier(pin_memory=True, pin_limit_bytes=0) if tier == "cpu" else FileTier(tmp_path)
    tensor = (torch.randn(37, 5) * 1000).to(dtype)
    expected = tensor.clone()
    away = store.send("state.t0", tensor)
    assert tensor.numel() == 0 and away.nbytes == expected.numel() * expected.element_size()
    if tier == "nvme":
        assert (tmp_path / "state.t0.bin").stat().st_size == away.nbytes
    store.bring(away, tensor)
    assert tensor.dtype == dtype and torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
    assert list(tmp_path.glob("*.bin")) == []


def test_file_tier_removes_a_part_written_file(tmp_path, monkeypatch):
    import higgs_megatron.memory.tiers as tiers

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiers.os, "fsync", full)
    tensor = torch.ones(100)
    with pytest.raises(OSError, match="No space left"):
        FileTier(tmp_path).send("a", tensor)
    assert list(tmp_path.glob("*.bin")) == [] and tensor.numel() == 100


def test_file_tier_close_removes_leftovers(tmp_path):
    tier = FileTier(tmp_path / "rank0")
    tier.send("a", torch.ones(10))
    assert len(list((tmp_path / "rank0").glob("*.bin"))) == 1
    tier.close()
    assert list((tmp_path / "rank0").glob("*.bin")) == []


def test_scripted_probe_replays_its_schedule_and_repeats_the_last():
    probe = ScriptedProbe.parse("0.5x2,0.95,0.6", total_bytes=1000)
    assert [probe.read().used_bytes for _ in range(6)] == [500, 500, 950, 600, 600, 600]
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        ScriptedProbe.parse("1.5")


@pytest.mark.parametrize("kwargs, message", [
    (dict(threshold=0.0), r"--higgs-offload-threshold 0.0: expected a fraction in \(0, 1\)"),
    (dict(threshold=1.0), r"--higgs-offload-threshold 1.0"),
    (dict(hysteresis=0.9), r"--higgs-offload-hysteresis 0.9: expected a fraction in \[0, 0.85\)"),
    (dict(device="gpu"), r"--higgs-offload-device 'gpu'"),
    (dict(device="nvme"), r"--higgs-offload-device nvme: needs --higgs-offload-dir"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(OffloadError, match=message):
        OffloadConfig(**kwargs)


def test_an_unwritable_offload_directory_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OffloadError, match=f"--higgs-offload-dir {blocker}/sub: not a writable directory"):
        OffloadConfig(device="nvme", directory=str(blocker / "sub"))


@pytest.mark.parametrize("argv, message", [
    (["--higgs-offload", "--higgs-offload-threshold", "1.2"], r"--higgs-offload-threshold 1.2: expected a fraction"),
    (["--higgs-offload-threshold", "0.7"], r"--higgs-offload-threshold: only with --higgs-offload"),
    (["--higgs-offload-schedule", "0.5", "--no-higgs-pin-memory", "--higgs-block-allocator", "expandable"],
     r"^--no-higgs-pin-memory, --higgs-offload-schedule: only with --higgs-offload"),
    (["--higgs-offload", "--higgs-offload-device", "nvme"], r"needs --higgs-offload-dir"),
    (["--higgs-offload", "--higgs-offload-device", "nvme", "--higgs-offload-dir", "/proc/higgs"],
     r"--higgs-offload-dir /proc/higgs: not a writable directory"),
    (["--higgs-offload", "--higgs-offload-schedule", "0.5,2"], r"--higgs-offload-schedule '0.5,2'"),
    (["--higgs-offload", "--higgs-pin-memory-limit-gb", "-1"], r"--higgs-pin-memory-limit-gb -1.0"),
    (["--recompute-granularity", "full"], r"--recompute-granularity full needs --recompute-method"),
    (["--recompute-method", "block"], r"only with --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9"],
     r"--recompute-num-layers 9: expected 1 to 4"),
])
def test_pretrain_flags_of_the_memory_manager_are_checked_before_training(argv, message):
    from higgs_megatron.runtime.exits import UsageError
    from higgs_megatron.training.arguments import parse_args

    with pytest.raises(UsageError) as caught:
        parse_args(argv, world_size=1)
    assert __import__("re").search(message, caught.value.message), caught.value.message


def test_not_enough_room_for_the_state_is_refused_before_training(tmp_path, monkeypatch):
    import higgs_megatron.memory.manager as manager

    monkeypatch.setattr(manager, "_host_available", lambda: 100)
    with pytest.raises(OffloadError, match=r"--higgs-offload-device cpu: the optimizer state of this rank is "
                                           r"0.00 GB \(0.00 GB for this host's 1 rank\(s\)\) and the host has "
                                           r"0.00 GB available"):
        manager.MemoryManager(_MegatronShaped(), [], OffloadConfig(), ScriptedProbe([0.5])).attach()
    # 12 kB of state per rank (moments and, with no model given, the parameter as the
    # optimizer's own): room for one rank is not room for this host's four
    monkeypatch.setattr(manager, "_host_available", lambda: 20_000)
    manager.MemoryManager(_MegatronShaped(), [], OffloadConfig(), ScriptedProbe([0.5])).attach()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(OffloadError, match=r"for this host's 4 rank"):
        manager.MemoryManager(_MegatronShaped(), [], OffloadConfig(), ScriptedProbe([0.5])).attach()


class _MegatronShaped:
    """The shape of a Megatron optimizer that the manager reads: one torch Adam inside."""

    def __init__(self):
        self.param = torch.nn.Parameter(torch.zeros(1000))
        self.optimizer = torch.optim.Adam([self.param])
        self.chained_optimizers = [self]
        self.model = torch.nn.ParameterList([self.param])

    def step(self):
        self.param.grad = torch.ones_like(self.param)
        self.optimizer.step()
        return True, None, None

    def state_dict(self):
        return self.optimizer.state_dict()


def _moments(optimizer):
    return [t for t in optimizer.optimizer.state[optimizer.param].values() if t.dim() > 0]


def test_a_checkpoint_reads_resident_state_and_settle_sends_it_away_again():
    from higgs_megatron.memory import MemoryManager

    optimizer = _MegatronShaped()
    manager = MemoryManager(optimizer, [optimizer.model], OffloadConfig(), ScriptedProbe([0.5, 0.95])).attach()
    optimizer.step()
    optimizer.step()  # 95% of memory: the state goes
    assert manager.resident_bytes() == 0 and all(t.numel() == 0 for t in _moments(optimizer))
    state = optimizer.state_dict()["state"][0]
    assert state["exp_avg"].numel() == 1000, "the checkpoint sees the state"
    assert manager.resident_bytes() == 8000
    manager.settle()
    assert manager.resident_bytes() == 0 and all(t.numel() == 0 for t in _moments(optimizer))
    manager.close()
    assert all(t.numel() == 1000 for t in _moments(optimizer))


def test_a_tier_failing_part_way_gives_back_what_it_took(tmp_path):
    from higgs_megatron.memory import MemoryManager

    optimizer = _MegatronShaped()
    events = []
    manager = MemoryManager(optimizer, [optimizer.model], OffloadConfig(device="nvme", directory=str(tmp_path)),
                            ScriptedProbe([0.5, 0.95, 0.95]),
                            on_event=lambda name, message, **fields: events.append(name)).attach()
    optimizer.step()
    before = [t.clone() for t in _moments(optimizer)]
    send = manager.tier.send
    calls = []

    def full_disk(name, tensor):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return send(name, tensor)

    manager.tier.send = full_disk
    optimizer.step()  # the first moment went to disk, the second could not: both stay
    assert "optimizer_state_offload_failed" in events and "optimizer_state_offloaded" not in events
    assert manager.resident_bytes() == 8000 and manager.away == frozenset()
    after_step = [t.clone() for t in _moments(optimizer)]
    assert not torch.equal(after_step[0], before[0])  # the step ran, and its state is intact
    assert list((tmp_path / "rank0").glob("*.bin")) == []
    manager.tier.send = send
    optimizer.step()  # still 95%: now it goes
    assert manager.resident_bytes() == 0
    manager.close()
