"""The memory manager under real training (2 gloo ranks): a scripted pressure schedule sends
the optimizer state away and brings it back at the expected steps, and the parameters come
out bitwise equal to a run without the manager; the file ("nvme") tier writes real files and
removes them."""

import json

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import train_variants

LAYOUTS = {
    "dp2": [],
    "dp2-distopt": ["--use-distributed-optimizer"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2-distopt": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
}
# One read per step: quiet, pressure for three steps, inside the band for two, quiet again.
SCHEDULE = "0.5x2,0.95x3,0.82x2,0.5"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_moves_out_and_back_on_schedule_and_training_is_bitwise_unchanged(tmp_path, tiny_gpt_args, layout):
    base = tiny_gpt_args + LAYOUTS[layout] + ["--train-iters", "10", "--global-batch-size", "8"]
    offload = ["--higgs-offload", "--higgs-offload-schedule", SCHEDULE]
    variants = {
        "plain": base,
        "cpu": base + offload + ["--log-json", str(tmp_path / "cpu.jsonl")],
        "nvme": base + offload + ["--higgs-offload-device", "nvme", "--higgs-offload-dir", str(tmp_path / "nvme"),
                                  "--log-json", str(tmp_path / "nvme.jsonl")],
    }
    results = run_ranks(train_variants, 2, args=(variants,), timeout=400)
    for out in results:
        for name in ("cpu", "nvme"):
            assert out["params"][name].keys() == out["params"]["plain"].keys()
            for key, value in out["params"]["plain"].items():
                assert value.equal(out["params"][name][key]), (name, key)
        assert out["losses"]["cpu"] == out["losses"]["plain"] == out["losses"]["nvme"]
    for name in ("cpu", "nvme"):
        events = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        moves = [e for e in events if e["type"] == "event" and e["event"].startswith("optimizer_state_")]
        assert [(e["event"], e["iteration"]) for e in moves] == [
            ("optimizer_state_offloaded", 3), ("optimizer_state_reloaded", 8)], moves
        out, back = moves
        assert out["resident_bytes"] == 0 and out["bytes"] == out["state_bytes"] > 0 and out["tier"] == name
        assert back["resident_bytes"] == back["state_bytes"] and "above the threshold 85%" in out["reason"]
        if name == "nvme":
            assert out["on_disk_bytes"] == out["bytes"]  # this rank's state, in files, while away
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*.bin"))


def test_recompute_flags_reach_the_model_and_change_no_result(tiny_gpt_args):
    base = tiny_gpt_args + ["--train-iters", "3", "--global-batch-size", "8"]
    variants = {"plain": base,
                "full": base + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
                "selective": base + ["--recompute-granularity", "selective"]}
    for out in run_ranks(train_variants, 2, args=(variants,), timeout=300):
        for name in ("full", "selective"):
            assert out["losses"][name] == out["losses"]["plain"]
            for key, value in out["params"]["plain"].items():
                assert value.equal(out["params"][name][key]), (name, key)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_async_checkpoints_of_offloaded_state_resume_bitwise(tmp_path, tiny_gpt_args, tier):
    """State away at every save (the schedule reads 100%): the async save still snapshots it,
    and resuming (manager on) continues the run without the manager exactly."""
    from tests.checkpoint.drill_checkpoint import COMMON, _global
    from tests.workers.common import run_trainer

    # --use-higgs: the save reads Megatron's optimizer beneath the wrapper the manager is on
    base = tiny_gpt_args + COMMON + ["--use-distributed-optimizer", "--train-iters", "6", "--use-higgs",
                                     "--higgs-sync", "sparse"]
    offload = ["--higgs-offload", "--higgs-offload-schedule", "1.0"]
    if tier == "nvme":
        offload += ["--higgs-offload-device", "nvme", "--higgs-offload-dir", str(tmp_path / "nvme")]
    plain = run_ranks(run_trainer, 2, args=(base,))
    saving = run_ranks(run_trainer, 2, args=(base + offload + ["--save", str(tmp_path / "ckpt"),
                                                               "--save-interval", "3", "--async-checkpoint"],))
    # each save brought the state back for its copy and sent it away again before returning
    assert [r["resident_after_saves"] for r in saving] == [[0, 0], [0, 0]]
    resumed = run_ranks(run_trainer, 2, args=(base + offload + ["--load", str(tmp_path / "ckpt"),
                                                                "--checkpoint-version", "3"],))
    for a, b in zip(plain, resumed):
        assert b["start"] == 3 and b["losses"] == {i: a["losses"][i] for i in (4, 5, 6)}
    final_a, final_b = _global(plain, "final"), _global(resumed, "final")
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key
