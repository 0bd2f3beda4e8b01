"""Real megatron-core GPT training on the stdlib corpus, over gloo, in every layout we claim."""

import json

import pytest

from higgs_megatron_bench.ranks import run_pretrain_script, run_ranks
from tests.workers.common import pretrain_on_rank

LAYOUTS = [
    pytest.param(2, [], id="dp2"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"], id="tp2"),
    pytest.param(2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], id="pp2"),
    pytest.param(4, ["--tensor-model-parallel-size", "2"], id="tp2xdp2"),
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"], id="pp2xdp2"),
]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distopt"])
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_loss_falls(world_size, layout, distributed_optimizer, tiny_gpt_args):
    argv = tiny_gpt_args + layout + ["--train-iters", "12", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]
    if distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    results = run_ranks(pretrain_on_rank, world_size, args=(argv,), timeout=300)
    last_stage = [r for r in results if r.losses]
    assert last_stage, "no rank reported losses"
    for result in last_stage:
        losses = [result.losses[i] for i in sorted(result.losses)]
        assert len(losses) == 12
        assert losses[-1] < 0.8 * losses[0], losses
        assert result.valid_losses, "validation ran at the end"
    # Every reporting rank sees the same DP-reduced loss.
    assert len({tuple(r.losses.values()) for r in last_stage}) == 1


def test_gradient_accumulation_matches_one_big_microbatch(tiny_gpt_args):
    """4 micro-batches of 2 per DP rank train the same samples as 1 micro-batch of 8."""
    base = tiny_gpt_args + ["--train-iters", "3", "--global-batch-size", "16"]
    accumulated = run_ranks(pretrain_on_rank, 2, args=(base + ["--micro-batch-size", "2"],))
    single = run_ranks(pretrain_on_rank, 2, args=(base + ["--micro-batch-size", "8"],))
    for it in (1, 2, 3):
        assert accumulated[0].losses[it] == pytest.approx(single[0].losses[it], rel=1e-4)


def test_script_under_torchrun_logs_json(tmp_path, tiny_gpt_args):
    log = tmp_path / "metrics.jsonl"
    proc = run_pretrain_script(tiny_gpt_args + ["--tensor-model-parallel-size", "2", "--train-iters", "6",
                                                "--log-interval", "2", "--eval-interval", "3",
                                                "--log-json", str(log)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "iteration        6/       6" in proc.stdout
    assert "TP 2 x PP 1 x DP 1" in proc.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    iterations = [r for r in records if r["type"] == "iteration"]
    assert [r["iteration"] for r in iterations] == [2, 4, 6]
    for record in iterations:
        for key in ("consumed_samples", "learning_rate", "lm_loss", "grad_norm", "tokens_per_second",
                    "elapsed_time_per_iteration_ms"):
            assert key in record, key
    assert iterations[-1]["lm_loss"] < iterations[0]["lm_loss"]
    events = {r["event"] for r in records if r["type"] == "event"}
    assert {"corpus_ready", "setup_done", "validation"} <= events


def test_own_loop_example_runs_with_three_calls():
    """The README's three-call example: HiggsDDP and wrap_optimizer in a hand-written loop."""
    from higgs_megatron_bench.ranks import REPO_ROOT

    proc = run_pretrain_script([], nproc=2, script=REPO_ROOT / "examples" / "own_loop.py")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(lines) == 3
    losses = [float(line.split("loss ")[1].split(" ")[0]) for line in lines]
    assert losses[-1] < losses[0]
    assert all("of" in line and "dense" in line for line in lines)
