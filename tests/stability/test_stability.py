"""Stability's parts in one process: fault specs and flags, the watchdog, the alignment log,
and what counts as a lost peer. (Faults in multi-process runs: drill_stability.py.)"""

import pytest

from higgs_megatron.stability.alignment import AlignmentLog
from higgs_megatron.stability.faults import Fault, FaultSpecError, parse_fault
from higgs_megatron.stability.progress import describe
from higgs_megatron.training.arguments import UsageError, parse_args


def test_fault_specs_parse():
    assert parse_fault("hang@1:5:30") == Fault("hang", 1, 5, 30.0)
    assert parse_fault("slow@0:2:0.5") == Fault("slow", 0, 2, 0.5)
    assert parse_fault("crash@3:10") == Fault("crash", 3, 10)
    assert str(parse_fault("nan@1:4")) == "nan@1:4"
    assert parse_fault("kill-replica@1:5") == Fault("kill-replica", 1, 5)
    assert parse_fault("stop-replica@1:5:20") == Fault("stop-replica", 1, 5, 20.0)


def test_a_replica_fault_fires_on_every_rank_of_that_replica_and_no_other():
    """TP=2 x DP=2: ranks 0, 1 are replica 0 and ranks 2, 3 replica 1 (Megatron's order)."""
    from higgs_megatron.stability.faults import FaultInjector

    faults = [parse_fault("kill-replica@1:5"), parse_fault("hang@0:3:1")]
    fired = {rank: [f.kind for f in FaultInjector(faults, rank, replica=rank // 2).pending] for rank in range(4)}
    assert fired == {0: ["hang"], 1: [], 2: ["kill-replica"], 3: ["kill-replica"]}


@pytest.mark.parametrize("spec,message", [
    ("hang@1", "expected KIND@RANK:ITER[:SECONDS]"),
    ("stall@1:2:3", "unknown kind 'stall'; expected one of hang, slow, freeze, sigterm, crash, nan, kill-replica, "
                    "stop-replica"),
    ("stop-replica@1:2", "stop-replica needs SECONDS > 0"),
    ("kill-replica@1:2:5", "kill-replica takes no SECONDS"),
    ("kill-replica@2:2", "replica 2 does not exist with data-parallel size 2"),
    ("freeze@1:2:3", "freeze takes no SECONDS"),
    ("hang@1:2", "hang needs SECONDS > 0"),
    ("crash@0:2:5", "crash takes no SECONDS"),
    ("nan@0:0", "iterations count from 1"),
    ("crash@4:2", "rank 4 does not exist in a world of 2"),
])
def test_bad_fault_specs_are_named(spec, message):
    with pytest.raises(FaultSpecError) as info:
        parse_fault(spec, world_size=2, replicas=2)
    assert f"--inject-fault {spec!r}" in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("argv,message", [
    (["--higgs-step-timeout", "5"], "--higgs-step-timeout: needs --use-higgs"),
    (["--use-higgs", "--higgs-step-timeout", "0"], "--higgs-step-timeout must be positive, got 0.0"),
    (["--inject-fault", "hang@9:1:1"], "rank 9 does not exist in a world of 2"),
    (["--inject-fault", "kill-replica@1:1", "--tensor-model-parallel-size", "2"],
     "replica 1 does not exist with data-parallel size 1"),
    (["--auto-resume"], "--auto-resume: needs --save DIR"),
    (["--exit-interval", "0"], "--exit-interval must be 1 or more, got 0"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins must be positive, got -1.0"),
    (["--exit-signal", "SIGUSR1"], "--exit-signal SIGUSR1: only with --exit-signal-handler"),
])
def test_bad_stability_flags_are_named(argv, message):
    with pytest.raises(UsageError) as info:
        parse_args(argv, world_size=2)
    assert message in info.value.message


def test_watchdog_names_the_rank_that_holds_the_others_up():
    stalled = [{"rank": 0, "iteration": 3, "phase": "grad-sync", "seconds": 6.0},
               {"rank": 1, "iteration": 3, "phase": "forward-backward", "seconds": 7.0}]
    assert describe(stalled, 5) == ("no progress for 5s or more: rank 1 (forward-backward, iteration 3, 7s); "
                                    "waiting for it: rank 0 (grad-sync, iteration 3, 6s)")


def test_the_watchdog_gives_up_on_a_rank_stuck_past_the_restart_timeout():
    """A hang no wait of ours bounds (inside Megatron's TP/PP collectives): the watchdog warns
    after the step timeout, then calls ``give_up`` naming the stuck rank, once."""
    import threading

    import torch.distributed as dist

    from higgs_megatron.stability.progress import ProgressBoard, Watchdog

    store = dist.HashStore()
    ProgressBoard(store, 0).publish(3, "forward-backward")  # stuck
    ProgressBoard(store, 1).publish(3, "grad-sync")  # waiting for rank 0
    warned, gave_up, done = [], [], threading.Event()
    watchdog = Watchdog(store, 2, 0.1, lambda message, stalled: warned.append(message), poll=0.02,
                        give_up_after=0.3, give_up=lambda message, ranks: (gave_up.append((message, ranks)), done.set()))
    watchdog.start()
    try:
        assert done.wait(10)
    finally:
        watchdog.stop()
    assert warned and warned[0].startswith("no progress for 0.1s or more: rank 0 (forward-backward, iteration 3")
    assert len(gave_up) == 1 and gave_up[0][0].startswith("no progress for 0.3s or more: rank 0 (forward-backward")
    assert gave_up[0][1] == [0, 1]  # neither advanced: the job restarts without them


def test_alignments_closer_than_ten_minutes_are_frequent():
    log = AlignmentLog()
    assert not log.record("a", 1.0)
    assert log.record("b", 1.0)
    assert AlignmentLog(too_often=0.0).record("c", 0.0) is False


def test_a_lost_peer_is_told_from_other_failures():
    from higgs_megatron.reduce.wire import peer_lost

    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27528: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    assert peer_lost(gone)
    assert not peer_lost(RuntimeError("shape mismatch in all_gather"))
