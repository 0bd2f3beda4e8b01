"""Elastic replicas, one process: the flags' rules on both front-ends, the replica faults'
restart accounting, the sync's waits across replicas, and the launcher's commands."""

import argparse
import sys

import pytest
import torch

from higgs_megatron.reduce.wire import StepWaits
from higgs_megatron.runtime.exits import UsageError
from higgs_megatron.stability.faults import FaultInjector, parse_fault


def test_megatron_lms_front_end_refuses_elastic_replicas_naming_the_flag():
    from higgs_megatron.runtime.run_config import MEGATRON_LM, check_rules
    from patches.megatron_lm.arguments import add_patch_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--save")
    parser.add_argument("--load")
    args = add_patch_args(parser).parse_args(["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0"])
    with pytest.raises(UsageError) as info:
        check_rules(args, MEGATRON_LM)
    assert info.value.code == 2
    assert info.value.message.startswith("--higgs-replicas: is only in our pretrain script")


def test_each_replica_counts_only_its_own_restarts(monkeypatch):
    """Under one torchrun a kill restarts every rank, so a later fault fires in the next attempt;
    each elastic replica is its own torchrun, and a kill of replica 1 restarts replica 1 alone."""
    faults = [parse_fault("kill-replica@1:6"), parse_fault("stop-replica@2:15:20")]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert FaultInjector(faults, rank=0, replica=2, restarts_alone=True).pending == [faults[1]]
    assert FaultInjector(faults, rank=0, replica=2).pending == []  # one job: it fires after the restart
    assert FaultInjector(faults, rank=0, replica=1, restarts_alone=True).pending == [faults[0]]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the killed replica, restarted: nothing left
    assert FaultInjector(faults, rank=0, replica=1, restarts_alone=True).pending == []


class _Lost:
    """A collective whose peer process is gone (gloo's words)."""

    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:934")

    def is_completed(self):
        return True


def test_across_replicas_a_lost_peer_gives_the_step_up_instead_of_ending_the_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    with pytest.raises(RuntimeError, match="Connection closed"):
        StepWaits().wait(_Lost())  # one job: only a restart helps
    waits = StepWaits(across_replicas=True)
    waits.wait(_Lost())
    assert waits.failed.startswith("rank 0: gradient sync failed: [gloo") and len(waits.abandoned) == 1
    waits.wait(_Lost())  # given up: later works are not waited for
    assert len(waits.abandoned) == 2
    fresh = StepWaits(across_replicas=True)
    fresh.launch_failed(RuntimeError("group reconfigured"))  # a launch on a group the quorum replaced
    assert fresh.failed == "rank 0: gradient sync failed: group reconfigured" and fresh.abandoned
    with pytest.raises(RuntimeError, match="group reconfigured"):
        StepWaits().launch_failed(RuntimeError("group reconfigured"))


def test_the_launcher_runs_one_torchrun_per_replica_against_one_lighthouse(tmp_path):
    sys.path.insert(0, "scripts")
    try:
        import elastic_replicas
    finally:
        sys.path.remove("scripts")
    args = argparse.Namespace(replicas=3, nproc_per_replica=2, max_restarts=4, min_replicas=2, lighthouse_port=29999,
                              join_timeout=1.0, heartbeat_timeout=2.0)
    command = elastic_replicas.replica_command(args, 1, ["--log-json", "runs/r-{replica}.jsonl"])
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=4"]
    assert command[7:] == ["--log-json", "runs/r-1.jsonl", "--higgs-replicas", "3", "--higgs-replica-id", "1",
                           "--higgs-lighthouse", "http://localhost:29999", "--higgs-min-replicas", "2"]
    assert elastic_replicas.lighthouse_command(args)[1:] == [
        "--bind", "[::]:29999", "--min_replicas", "2", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000"]


def test_a_fault_past_which_a_replica_healed_fires_at_its_first_iteration(monkeypatch):
    """A replica healed from step 0 to 181 never runs iteration 40: its stop fires at 182, once."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    faults = [parse_fault("kill-replica@1:6"), parse_fault("nan@0:40")]
    injector = FaultInjector(faults, rank=0, replica=1, restarts_alone=True)
    assert injector.before_step(182) == faults[1] and injector.before_step(183) is None
