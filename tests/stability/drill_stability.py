"""Stability: injected faults, the watchdog, progress alignment and automatic resume, in real
multi-process runs over gloo."""

import json
import re
import signal

import pytest
import torch

from higgs_megatron.checkpoint.manifest import committed_checkpoints
from higgs_megatron_bench.ranks import run_pretrain_script, run_ranks
from tests.workers.common import run_trainer, train_variants


SPARSE = ["--use-higgs", "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0", "--higgs-compression-ratio", "0.05"]


def _base(tiny_gpt_args, tmp_path, name, iters=6):
    return tiny_gpt_args + SPARSE + ["--global-batch-size", "8", "--train-iters", str(iters), "--overlap-grad-reduce",
                                     "--ddp-bucket-size", "20000", "--hidden-dropout", "0", "--attention-dropout", "0",
                                     "--log-json", str(tmp_path / f"{name}.jsonl")]


DENSE_BUCKETS = ["--use-distributed-optimizer", "--ddp-bucket-size", "20000"]


def _dense_auto(tiny_gpt_args, tmp_path, name, iters=6):
    """The defaults a new user runs with, --higgs-sync auto and no --overlap-grad-reduce, told
    the link is fast (as auto finds an accelerator's links; measured on a loaded 2-core machine
    this tiny model's latency-bound buckets may go either way): every bucket dense."""
    return tiny_gpt_args + ["--use-higgs", "--higgs-link-gbps", "100", "--global-batch-size", "8",
                            "--train-iters", str(iters),
                            "--hidden-dropout", "0", "--attention-dropout", "0",
                            "--log-json", str(tmp_path / f"{name}.jsonl")]


def test_slow_within_the_timeout_hang_past_it_and_nan(tmp_path, tiny_gpt_args):
    """slow (1 s under a 4 s timeout): at most a warning, no alignment, bitwise the clean run.
    hang (6 s past a 2 s timeout), on compressed buckets and on dense ones (auto, one host; the
    distributed optimizer's reduce-scatter): one
    alignment, all iterations run, replicas identical, and (no dropout) the redone step equals
    the clean run's. nan: the step is skipped everywhere. nan and hang in one step: one dropped
    step, one rollback, and the iteration runs again."""
    variants = {
        "clean": _base(tiny_gpt_args, tmp_path, "clean") + ["--higgs-step-timeout", "4"],
        "slow": _base(tiny_gpt_args, tmp_path, "slow") + ["--higgs-step-timeout", "4",
                                                          "--inject-fault", "slow@1:3:1"],
        "hang": _base(tiny_gpt_args, tmp_path, "hang") + ["--higgs-step-timeout", "2",
                                                          "--inject-fault", "hang@1:3:6"],
        "hang_nan": _base(tiny_gpt_args, tmp_path, "hang_nan") + ["--higgs-step-timeout", "2",
                                                                  "--inject-fault", "hang@1:3:6",
                                                                  "--inject-fault", "nan@0:3"],
        "nan": _base(tiny_gpt_args, tmp_path, "nan") + ["--inject-fault", "nan@0:4"],
        "clean_dense": _dense_auto(tiny_gpt_args, tmp_path, "clean_dense") + ["--higgs-step-timeout", "4",
                                                                              *DENSE_BUCKETS],
        "hang_dense": _dense_auto(tiny_gpt_args, tmp_path, "hang_dense") + ["--higgs-step-timeout", "2",
                                                                            *DENSE_BUCKETS,
                                                                            "--inject-fault", "hang@1:3:6"],
    }
    outs = run_ranks(train_variants, 2, args=(variants,), timeout=500)
    for name in variants:
        for key, value in outs[0]["params"][name].items():
            assert torch.equal(value, outs[1]["params"][name][key]), f"{name}: DP replicas differ at {key}"
    for out in outs:
        assert out["alignments"] == {"clean": 0, "slow": 0, "hang": 1, "hang_nan": 1, "nan": 0,
                                     "clean_dense": 0, "hang_dense": 1}
        for name, clean in (("slow", "clean"), ("hang", "clean"), ("hang_nan", "clean"), ("hang_dense", "clean_dense")):
            assert sorted(out["losses"][name]) == list(range(1, 7))
            for key, value in out["params"][name].items():
                assert torch.equal(value, out["params"][clean][key]), f"{name} differs from the {clean} run at {key}"
    events = outs[1]["events"]
    plan = [e for e in events["hang_dense"] if e["event"] == "higgs_sync_plan"]
    assert plan and {b["path"] for b in plan[0]["buckets"]} == {"dense"}, plan
    for name in ("hang", "hang_dense", "hang_nan"):
        alignment = [e for e in events[name] if e["event"] == "progress_alignment"]
        assert len(alignment) == 1 and alignment[0]["iteration"] == 3, (name, alignment)
        assert "gradient sync did not complete within 2s" in alignment[0]["cause"]
        assert alignment[0]["seconds_lost"] >= 2
        assert not [e for e in events[name] if e["event"] == "step_skipped"], name
    assert "rank 0: non-finite gradients" in [e for e in events["hang_nan"]
                                              if e["event"] == "progress_alignment"][0]["cause"]
    stalled = [e for e in events["hang"] if e["event"] == "progress_stalled"]
    assert stalled, events["hang"]
    phases = {entry["rank"]: entry["phase"] for entry in stalled[0]["stalled"]}
    assert phases[1] == "forward-backward" and phases.get(0, "grad-sync") == "grad-sync", phases
    assert not [e for e in events["slow"] if e["event"] == "progress_alignment"]
    skipped = [e for e in events["nan"] if e["event"] == "step_skipped"]
    assert [e["iteration"] for e in skipped] == [4]
    assert outs[0]["params"]["nan"].keys() == outs[0]["params"]["clean"].keys()


def test_a_hang_under_two_optimizer_instances_is_one_alignment_on_either_level(tmp_path, tiny_gpt_args):
    """--num-distributed-optimizer-instances 2 over DP=4: a 6 s hang past a 2 s timeout, with the
    cross-instance all-reduce compressed and with every bucket dense (reduce-scatter inside the
    instance, then the shard's all-reduce across): one alignment each, every group rebuilt
    (the cross-instance one included), the clean run's parameters bitwise."""
    instances = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                 "--ddp-bucket-size", "20000", "--global-batch-size", "16"]
    compressed = ["--higgs-sync", "sparse", "--higgs-compression-ratio", "0.01", "--higgs-min-bucket-numel", "0",
                  "--overlap-grad-reduce"]
    variants = {}
    for kind, flags in (("compressed", compressed), ("dense", ["--higgs-sync", "dense"])):
        base = tiny_gpt_args + ["--use-higgs", "--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout",
                                "0"] + instances + flags
        variants[f"clean_{kind}"] = base + ["--higgs-step-timeout", "4"]
        variants[f"hang_{kind}"] = base + ["--higgs-step-timeout", "2", "--inject-fault", "hang@1:3:6"]
    outs = run_ranks(train_variants, 4, args=(variants,), timeout=500)
    for out in outs:
        assert out["alignments"] == {"clean_compressed": 0, "hang_compressed": 1, "clean_dense": 0, "hang_dense": 1}
        for kind in ("compressed", "dense"):
            assert sorted(out["losses"][f"hang_{kind}"]) == list(range(1, 7))
            for key, value in out["params"][f"hang_{kind}"].items():
                assert torch.equal(value, out["params"][f"clean_{kind}"][key]), f"{kind}: differs at {key}"
                assert torch.equal(value, outs[0]["params"][f"hang_{kind}"][key]), f"{kind}: replicas differ at {key}"


@pytest.mark.parametrize("layout", [
    pytest.param(["--tensor-model-parallel-size", "2"], id="tp2xdp2"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], id="pp2xdp2-distopt"),
])
def test_a_hang_under_tp_or_pp_is_one_alignment_and_changes_nothing(tmp_path, layout, tiny_gpt_args):
    """Four ranks, DP=2 beside TP=2 or PP=2: rank 1 stalls 6 s in iteration 3. Its TP (or
    pipeline) peer waits for it in Megatron's own collectives, unbounded; the other replica's
    ranks give their gradient sync up past the 2 s timeout. One alignment on every rank, all
    iterations run, and the parameters are the clean run's, bitwise. After the rebuild no
    aborted group is reachable from the model, the optimizer or ``parallel_state``, and the
    rebuilt ones have the old ones' descriptions and timeouts."""
    variants = {name: _base(tiny_gpt_args, tmp_path, name) + layout + ["--global-batch-size", "16"] + flags
                for name, flags in (("clean", ["--higgs-step-timeout", "4"]),
                                    ("hang", ["--higgs-step-timeout", "2", "--inject-fault", "hang@1:3:6"]))}
    outs = run_ranks(train_variants, 4, args=(variants,), timeout=500)
    for out in outs:
        assert out["alignments"] == {"clean": 0, "hang": 1}
        # the rebuilt groups keep their descriptions and timeouts, and no aborted one is reachable
        assert out["groups"]["hang"] == out["groups"]["clean"] and all(live for *_, live in out["groups"]["hang"])
        for key, value in out["params"]["hang"].items():
            assert torch.equal(value, out["params"]["clean"][key]), f"differs from the clean run at {key}"
    losses = next(out["losses"] for out in outs if out["losses"]["hang"])
    assert sorted(losses["hang"]) == list(range(1, 7)) and losses["hang"] == losses["clean"]


def test_crash_restarts_and_resumes_from_the_latest_checkpoint(tmp_path, tiny_gpt_args):
    """crash@1:6 under torchrun --max-restarts 1 with async checkpoints every 2 iterations:
    the job finishes, and its final parameters equal those of a run that resumed from the
    same checkpoint without a crash."""
    save, reference = tmp_path / "ckpt", tmp_path / "reference"
    log = tmp_path / "crash.jsonl"
    base = tiny_gpt_args + SPARSE + ["--global-batch-size", "8", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    argv = base + ["--train-iters", "8", "--save", str(save), "--save-interval", "2", "--async-checkpoint",
                   "--auto-resume", "--inject-fault", "crash@1:6", "--log-json", str(log)]
    proc = run_pretrain_script(argv, nproc=2, timeout=400, extra_launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(exitcode: 43)" in proc.stderr  # the injected crash, seen by torchrun
    records = [json.loads(line) for line in log.read_text().splitlines()]
    loaded = [r for r in records if r["type"] == "event" and r["event"] == "checkpoint_loaded"]
    assert len(loaded) == 1 and 2 <= loaded[0]["iteration"] <= 5, loaded
    resumed_from = loaded[0]["iteration"]
    run_ranks(run_trainer, 2, args=(base + ["--train-iters", "8", "--load", str(save), "--checkpoint-version",
                                            str(resumed_from), "--save", str(reference)],))
    crashed = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "8", "--load", str(save)],))
    clean = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "8", "--load", str(reference)],))
    for a, b in zip(crashed, clean):
        assert a["start"] == b["start"] == 8
        assert a["final"].keys() == b["final"].keys()
        for key in a["final"]:
            for (shape_a, offset_a, piece_a), (shape_b, offset_b, piece_b) in zip(a["final"][key], b["final"][key]):
                assert torch.equal(piece_a, piece_b), key


def test_a_rank_that_never_returns_ends_in_a_restart_and_the_job_finishes(tmp_path, tiny_gpt_args):
    """freeze@1:5 (rank 1 SIGSTOPs itself for good) under torchrun --max-restarts 1: rank 0 gives
    the sync up after 2 s, waits at most 6 s for rank 1's vote, says why, kills the stopped rank
    (on its host) and exits with status 75; torchrun restarts the job, which resumes from its
    latest checkpoint and finishes with identical replicas."""
    save, log = tmp_path / "ckpt", tmp_path / "freeze.jsonl"
    argv = _dense_auto(tiny_gpt_args, tmp_path, "freeze", iters=8) + [
        "--save", str(save), "--save-interval", "2", "--auto-resume", "--higgs-step-timeout", "2",
        "--higgs-restart-timeout", "6", "--inject-fault", "freeze@1:5",
        "--check-weight-hash-across-dp-replicas-interval", "1"]
    argv[argv.index("--log-json") + 1] = str(log)
    proc = run_pretrain_script(argv, nproc=2, timeout=240, extra_launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Which failure torchrun's monitor sees first is a race: rank 0's exit 75, or the rank it killed.
    assert "(exitcode: 75)" in proc.stderr or "(exitcode: -9) local_rank: 1" in proc.stderr, proc.stderr[-4000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = [r for r in records if r["type"] == "event"]
    # Rank 0 says why on stderr (the JSONL writer is the last rank, the frozen one here).
    assert "[rank 0] rank(s) [1] did not vote on step attempt" in proc.stderr, proc.stderr[-4000:]
    assert "killed the stuck rank(s) [1] on this host" in proc.stderr  # not 30 s of torchrun's SIGTERM grace
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [e["iteration"] for e in loaded] == [4], loaded
    assert max(e["iteration"] for e in events if e["event"] == "replicas_identical") == 8


def test_a_killed_replica_restarts_the_job_which_finishes(tmp_path, tiny_gpt_args):
    """kill-replica@1:5 under TP=2 x DP=2 and torchrun --max-restarts 1: both ranks of replica
    1 (one model-parallel group, as a lost node takes it) are killed at iteration 5; the job
    restarts from its checkpoint of 4 and finishes with identical replicas."""
    save, log = tmp_path / "ckpt", tmp_path / "kill.jsonl"
    argv = _dense_auto(tiny_gpt_args, tmp_path, "kill", iters=6) + [
        "--tensor-model-parallel-size", "2", "--save", str(save), "--save-interval", "2", "--auto-resume",
        "--inject-fault", "kill-replica@1:5", "--check-weight-hash-across-dp-replicas-interval", "1"]
    argv[argv.index("--log-json") + 1] = str(log)
    proc = run_pretrain_script(argv, nproc=4, timeout=300, extra_launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    fired = sorted({int(rank) for rank in re.findall(r"\[rank (\d)\] injecting fault kill-replica@1:5",
                                                     proc.stdout + proc.stderr)})
    # Only ranks of replica 1 fire; the first to die makes torchrun stop the rest, its peer
    # in the replica too if that one has not reached the fault yet (which ranks it fires on:
    # tests/stability/test_stability.py).
    assert fired and set(fired) <= {2, 3}, proc.stderr[-4000:]
    killed = sorted({int(rank) for rank in re.findall(r"\(exitcode: -9\) local_rank: (\d)", proc.stderr)})
    assert killed and set(killed) <= {2, 3}, proc.stderr[-4000:]  # torchrun reports the first it sees
    events = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "event"]
    assert [e["iteration"] for e in events if e["event"] == "checkpoint_loaded"] == [4]
    assert max(e["iteration"] for e in events if e["event"] == "replicas_identical") == 6


def test_a_replica_stopped_for_a_while_is_one_alignment(tmp_path, tiny_gpt_args):
    """stop-replica@1:3:5 with --higgs-step-timeout 2: replica 1 stops for 5 s at iteration 3
    and is resumed; rank 0 gives its sync up after 2 s and waits for its vote (within the 12 s
    restart timeout); every rank drops the step once and the run finishes without a restart,
    replicas identical."""
    log = tmp_path / "stop.jsonl"
    argv = _dense_auto(tiny_gpt_args, tmp_path, "stop", iters=5) + [
        "--higgs-step-timeout", "2", "--higgs-restart-timeout", "12", "--inject-fault", "stop-replica@1:3:5",
        "--check-weight-hash-across-dp-replicas-interval", "1"]
    argv[argv.index("--log-json") + 1] = str(log)
    proc = run_pretrain_script(argv, nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "event"]
    assert [e["kind"] for e in events if e["event"] == "fault_injected"] == ["stop-replica"]
    assert [e["iteration"] for e in events if e["event"] == "progress_alignment"] == [3]
    assert max(e["iteration"] for e in events if e["event"] == "replicas_identical") == 5


def test_a_straggler_on_every_attempt_ends_in_a_restart_after_k_alignments(tmp_path, tiny_gpt_args):
    """Rank 1 stalls 3 s past a 2 s step timeout on every attempt of iteration 3 (two hangs
    there), under --higgs-max-alignments-in-a-row 2 and torchrun --max-restarts 1: two
    alignments in a row, then every rank says why and exits with status 75, instead of
    realigning forever. The asynchronous save of 2, still in flight (no step completed since it
    began, so no poll committed it), is committed before the ranks leave: the restarted job
    resumes from 2, not from scratch, and finishes."""
    save, log = tmp_path / "ckpt", tmp_path / "straggler.jsonl"
    argv = _dense_auto(tiny_gpt_args, tmp_path, "straggler", iters=4) + [
        "--save", str(save), "--save-interval", "2", "--async-checkpoint", "--auto-resume", "--higgs-step-timeout", "2",
        "--higgs-max-alignments-in-a-row", "2", "--inject-fault", "hang@1:3:3", "--inject-fault", "hang@1:3:3"]
    argv[argv.index("--log-json") + 1] = str(log)
    proc = run_pretrain_script(argv, nproc=2, timeout=240, extra_launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(exitcode: 75)" in proc.stderr, proc.stderr[-4000:]
    events = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "event"]
    assert [e["count"] for e in events if e["event"] == "progress_alignment"] == [1, 2]
    restart = [e["reason"] for e in events if e["event"] == "restart_needed"]
    assert len(restart) == 1 and restart[0].startswith(
        "2 progress alignments in a row at iteration 3, no step kept between them "
        "(--higgs-max-alignments-in-a-row 2; the last: rank "), restart
    assert [e["iteration"] for e in events if e["event"] == "checkpoint_loaded"] == [2]
    assert [e["iteration"] for e in events if e["event"] == "checkpoint_committed"] == [2, 4]


def test_sigterm_with_the_exit_signal_handler_saves_exits_zero_and_resumes_bitwise(tmp_path, tiny_gpt_args):
    """sigterm@1:3 with --exit-signal-handler under torchrun: every rank learns of rank 1's signal
    at the end of iteration 3, a checkpoint of iteration 3 is committed, and every rank exits
    with status 0 (torchrun's own status is 0 only then). Resumed to iteration 6, the run ends
    bitwise where an uninterrupted run ends (compressed buckets: the residuals come along)."""
    save, log = tmp_path / "ckpt", tmp_path / "sigterm.jsonl"
    base = _base(tiny_gpt_args, tmp_path, "sigterm")
    argv = base + ["--save", str(save), "--save-interval", "100", "--exit-signal-handler",
                   "--inject-fault", "sigterm@1:3"]
    argv[argv.index("--log-json") + 1] = str(log)
    proc = run_pretrain_script(argv, nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "event"]
    exits = [e for e in events if e["event"] == "exit_requested"]
    assert [(e["iteration"], e["reason"]) for e in exits] == [(3, "SIGTERM received")], exits
    assert [e["iteration"] for e in events if e["event"] == "checkpoint_committed"] == [3]
    assert (save / "latest").read_text().strip().endswith("3")
    resumed = run_ranks(run_trainer, 2, args=(base + ["--load", str(save)],))
    clean = run_ranks(run_trainer, 2, args=(base,))
    for a, b in zip(resumed, clean):
        assert a["start"] == 3 and b["start"] == 0
        assert a["final"].keys() == b["final"].keys()
        for key in a["final"]:
            for (_, _, piece_a), (_, _, piece_b) in zip(a["final"][key], b["final"][key]):
                assert torch.equal(piece_a, piece_b), key


EXIT_RECORDED = """import os, sys
from higgs_megatron.training.launch import main
code = main(sys.argv[1:])
with open(os.path.join(os.environ["EXIT_DIR"], "exit-" + os.environ["RANK"]), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


@pytest.mark.parametrize("delivery", ["sigterm-to-torchrun", "usr1-to-every-process"])
def test_a_scheduler_signal_saves_and_every_worker_exits_zero(tmp_path, tiny_gpt_args, delivery):
    """sigterm-to-torchrun: what Slurm's scancel and most schedulers do, SIGTERM to torchrun, not
    to a worker. torchrun passes it on to its workers; with --exit-signal-handler every rank
    saves at the next iteration boundary and returns 0 (recorded by the script around the
    pretrain script) inside torchrun's 30 s grace period, and torchrun reports the signal.
    usr1-to-every-process: Slurm's ``--signal=USR1@LEAD`` reaches every process of the job step,
    LEAD seconds before the time limit's SIGTERM, for saves too big for a grace period; torchrun
    ignores it (``scripts/megatron_lm_multinode.sh`` starts it so), the workers act on it under
    ``--exit-signal SIGUSR1``, and torchrun exits 0 once they have. Either way the checkpoint is
    committed, and the only one."""
    save, log = tmp_path / "ckpt", tmp_path / "signal.jsonl"
    script = tmp_path / "exit_recorded.py"
    script.write_text(EXIT_RECORDED)
    usr1 = delivery.startswith("usr1")
    argv = _base(tiny_gpt_args, tmp_path, "signal", iters=100000) + [
        "--save", str(save), "--save-interval", "100000", "--exit-signal-handler", "--log-interval", "1",
        *(["--exit-signal", "SIGUSR1"] if usr1 else [])]
    argv[argv.index("--log-json") + 1] = str(log)

    def training() -> bool:
        return log.exists() and log.read_text().count('"type": "iteration"') >= 2

    proc = run_pretrain_script(argv, nproc=2, timeout=240, script=script, env={"EXIT_DIR": str(tmp_path)},
                               signal_launcher_when=training, launcher_signal=signal.SIGUSR1 if usr1 else signal.SIGTERM,
                               signal_every_process=usr1)
    if usr1:
        assert proc.returncode == 0, proc.stderr[-4000:]
    else:
        assert proc.returncode != 0 and "SIGTERM" in proc.stderr, proc.stderr[-4000:]  # torchrun reports it
    assert [(tmp_path / f"exit-{rank}").read_text() for rank in (0, 1)] == ["0", "0"], proc.stderr[-4000:]
    events = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "event"]
    committed = [e["iteration"] for e in events if e["event"] == "checkpoint_committed"]
    assert len(committed) == 1 and committed_checkpoints(save) == committed, events
    assert (save / "latest").read_text() == f"{committed[0]}\n"
    assert [e["reason"] for e in events if e["event"] == "exit_requested"] == [
        f"{'SIGUSR1' if usr1 else 'SIGTERM'} received"]


def test_exit_interval_and_duration_end_the_run_with_a_checkpoint(tmp_path, tiny_gpt_args):
    """--exit-interval 2 leaves after iteration 2 with a checkpoint of it; --exit-duration-in-mins
    leaves at the first iteration boundary past the budget (here, the first), saving."""
    base = _base(tiny_gpt_args, tmp_path, "exits")
    outs = run_ranks(train_variants, 2, args=({
        "interval": base + ["--exit-interval", "2", "--save", str(tmp_path / "interval")],
        "duration": base + ["--exit-duration-in-mins", "1e-9", "--save", str(tmp_path / "duration")],
    },))
    for out in outs:
        assert out["exits"]["interval"] == (2, "iteration 2 (--exit-interval 2)")
        assert out["exits"]["duration"][0] == 1 and "--exit-duration-in-mins" in out["exits"]["duration"][1]
    for name, iteration in (("interval", 2), ("duration", 1)):
        assert (tmp_path / name / "latest").read_text().strip().endswith(str(iteration))
