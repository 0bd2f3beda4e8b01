"""Per-rank shard checkpoints with a rank map, in real multi-process megatron-core runs."""

import json
import math
import os
import re
import time

import pytest
import torch

from higgs_megatron.checkpoint.manifest import MANIFEST_NAME, Manifest, committed_checkpoints, verify_files
from higgs_megatron.checkpoint.load import _intersection_volume
from higgs_megatron_bench.ranks import RankFailure, run_pretrain_script, run_ranks
from tests.workers.checkpoint import load_failing_on_rank_1, optimizer_state_both_ways, save_failing_on_rank_1_alone
from tests.workers.common import run_trainer


COMMON = ["--make-vocab-size-divisible-by", "256", "--eval-iters", "0", "--lr-decay-iters", "8", "--lr-warmup-iters", "1"]


HIGGS = ["--use-higgs", "--higgs-compression-ratio", "0.01", "--higgs-min-bucket-numel", "0", "--higgs-sync", "sparse"]
ONEBIT = ["--use-higgs", "--higgs-sync", "onebit", "--higgs-dense-iters", "2", "--higgs-min-bucket-numel", "0"]


def _global(outs, field):
    """{key: global tensor}, each assembled from every rank's pieces at their global offsets."""
    assembled = {}
    for out in outs:
        for key, pieces in out[field].items():
            for global_shape, offset, piece in pieces:
                whole = assembled.setdefault(key, torch.full(global_shape, float("nan"), dtype=piece.dtype))
                whole[tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))] = piece
    return assembled


@pytest.mark.oracle
@pytest.mark.parametrize("world_size,layout,higgs", [
    pytest.param(2, [], [], id="dp2-dense"),
    pytest.param(2, [], HIGGS, id="dp2-higgs"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"], HIGGS, id="tp2-higgs"),
    pytest.param(2, ["--use-distributed-optimizer"], [], id="dp2-distopt-dense"),
    # saved after the freeze (step 3 of 6): the frozen second moment is ordinary optimizer state
    pytest.param(2, ["--use-distributed-optimizer"], HIGGS + ["--higgs-dense-iters", "2", "--higgs-freeze-adam-variance"],
                 id="dp2-distopt-higgs-frozen-variance"),
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"], HIGGS,
                 id="pp2xdp2-higgs"),
    # saved after the freeze: Adam's first moment is the exchange's, the owners' residuals are per rank
    pytest.param(2, [], ONEBIT, id="dp2-onebit"),
    pytest.param(4, ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"], ONEBIT, id="tp2xdp2-onebit"),
    # and with the distributed optimizer: the moment each rank holds for its shares is saved per
    # rank, and the parameter all-gather's reference is read from the loaded parameters
    pytest.param(2, ["--use-distributed-optimizer"], ONEBIT, id="dp2-distopt-onebit"),
    # megatron-core's own fully_reshardable save pads the last stage's tied embedding with zeros
    # here and the resumed run differs; the owner-written state (state.owner_written_optimizer_state) does not.
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                     "--use-distributed-optimizer"], [], id="pp2xdp2-distopt-dense"),
])
def test_resume_continues_bitwise(tmp_path, world_size, layout, higgs, tiny_gpt_args):
    base = tiny_gpt_args + COMMON + layout + higgs
    straight = run_ranks(run_trainer, world_size, args=(base + ["--train-iters", "6"],))
    run_ranks(run_trainer, world_size, args=(base + ["--train-iters", "3", "--save", str(tmp_path)],))
    resumed = run_ranks(run_trainer, world_size, args=(base + ["--train-iters", "6", "--load", str(tmp_path)],))
    for a, b in zip(straight, resumed):
        assert b["start"] == 3
        if a["losses"]:  # ranks of the last pipeline stage
            assert b["losses"] == {i: a["losses"][i] for i in (4, 5, 6)}
    final_a, final_b = _global(straight, "final"), _global(resumed, "final")
    assert final_a.keys() == final_b.keys()
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


@pytest.mark.oracle
@pytest.mark.parametrize("world_size,layout", [
    pytest.param(2, [], id="dp2-dense"),
    pytest.param(2, ["--use-distributed-optimizer"] + HIGGS, id="dp2-distopt-higgs"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"] + HIGGS, id="tp2-higgs"),
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"] + HIGGS,
                 id="pp2xdp2-higgs"),
])
def test_async_save_is_a_snapshot_while_training_goes_on(tmp_path, world_size, layout, tiny_gpt_args):
    """The save at iteration 3 is written while iterations 4-6 run; resuming from it must give
    iterations 4-6 exactly as the run that went on."""
    base = tiny_gpt_args + COMMON + layout + ["--train-iters", "6"]
    straight = run_ranks(run_trainer, world_size, args=(base + ["--save", str(tmp_path), "--save-interval", "3",
                                                                "--async-checkpoint"],))
    assert (tmp_path / "latest").read_text().strip() == "6"
    assert _record_crcs(tmp_path / "iter_0000003") == {0}  # written by the writer thread
    resumed = run_ranks(run_trainer, world_size, args=(base + ["--load", str(tmp_path), "--checkpoint-version", "3"],))
    for a, b in zip(straight, resumed):
        assert b["start"] == 3
        if a["losses"]:
            assert b["losses"] == {i: a["losses"][i] for i in (4, 5, 6)}
    final_a, final_b = _global(straight, "final"), _global(resumed, "final")
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


def test_async_host_copy_in_the_background_is_done_before_the_next_update(tmp_path, tiny_gpt_args):
    """The host copy runs while the next forward and backward do; made slower than a whole
    step, the optimizer step waits for it, and the checkpoint is still iteration 3's state."""
    base = tiny_gpt_args + COMMON + ["--use-distributed-optimizer", "--train-iters", "5"] + HIGGS
    straight = run_ranks(run_trainer, 2, args=(base + ["--save", str(tmp_path), "--save-interval", "3",
                                                       "--async-checkpoint"], None, None, 1.5))
    resumed = run_ranks(run_trainer, 2, args=(base + ["--load", str(tmp_path), "--checkpoint-version", "3"],))
    assert resumed[0]["start"] == 3 and resumed[0]["losses"] == {i: straight[0]["losses"][i] for i in (4, 5)}
    final_a, final_b = _global(straight, "final"), _global(resumed, "final")
    for key in final_a:
        assert torch.equal(final_a[key], final_b[key]), key


@pytest.mark.oracle
@pytest.mark.parametrize("save_layout,load_layout,load_world", [
    pytest.param(["--tensor-model-parallel-size", "2"], [], 2, id="tp2-to-dp2"),
    pytest.param(["--pipeline-model-parallel-size", "2"], [], 2, id="pp2-to-dp2"),
    pytest.param([], [], 1, id="dp2-to-dp1"),
])
def test_reshard_restores_global_model_and_moments(tmp_path, save_layout, load_layout, load_world, tiny_gpt_args):
    base = tiny_gpt_args + COMMON + ["--use-distributed-optimizer", "--global-batch-size", "8"]
    saved = run_ranks(run_trainer, 2, args=(base + save_layout + ["--train-iters", "3", "--save", str(tmp_path)],))
    argv = base + load_layout + ["--train-iters", "8", "--load", str(tmp_path), "--recovery-mode", "reshard"]
    resumed = run_ranks(run_trainer, load_world, args=(argv,))
    before, after = _global(saved, "final"), _global(resumed, "after_load")
    model_keys = [k for k in before if not k.startswith("optimizer.")]
    moment_keys = [k for k in before if "exp_avg" in k]
    assert model_keys and moment_keys, sorted(before)[:10]
    for key in model_keys + moment_keys:
        assert not before[key].isnan().any(), f"{key}: the saved shards do not tile it"
        assert torch.equal(before[key], after[key]), key
    losses = [resumed[-1]["losses"][i] for i in sorted(resumed[-1]["losses"])]
    assert resumed[-1]["start"] == 3 and losses[-1] < losses[0] + 0.5


@pytest.mark.parametrize("layout", [pytest.param([], id="adam"),
                                    pytest.param(["--use-distributed-optimizer"], id="distopt")])
def test_onebit_reshards_its_moments_and_starts_its_residuals_from_zero(tmp_path, layout, tiny_gpt_args):
    """DP=2 to DP=4: Adam's moments (the exchange's first moment among them) move as optimizer
    state; the ranks' and owners' residuals, sized by the old layout, start from zero (with the
    distributed optimizer so does the moment each rank holds for its shares)."""
    base = tiny_gpt_args + COMMON + ONEBIT + layout + ["--global-batch-size", "16"]
    saved = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "4", "--save", str(tmp_path)],))
    argv = base + ["--train-iters", "8", "--load", str(tmp_path), "--recovery-mode", "reshard"]
    resumed = run_ranks(run_trainer, 4, args=(argv,))
    before, after = _global(saved, "final"), _global(resumed, "after_load")
    moment_keys = [k for k in before if "exp_avg" in k]
    assert moment_keys, sorted(before)[:10]
    for key in [k for k in before if not k.startswith("optimizer.")] + moment_keys:
        assert torch.equal(before[key], after[key]), key
    losses = [resumed[-1]["losses"][i] for i in sorted(resumed[-1]["losses"])]
    assert resumed[-1]["start"] == 4 and losses[-1] < losses[0] + 0.5


@pytest.mark.parametrize("save_world,save_layout,load_world,load_layout", [
    pytest.param(4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
                 2, ["--use-distributed-optimizer"], id="instances2xdp4-to-dp2"),
    pytest.param(2, ["--use-distributed-optimizer"], 4, ["--use-distributed-optimizer",
                                                          "--num-distributed-optimizer-instances", "2"],
                 id="dp2-to-instances2xdp4"),
    pytest.param(4, ["--pipeline-model-parallel-size", "2"], 2, [], id="pp2xdp2-adam-to-dp2"),
])
def test_reshard_to_and_from_optimizer_instances_and_without_the_distributed_optimizer(
        tmp_path, save_world, save_layout, load_world, load_layout, tiny_gpt_args):
    """With --use-higgs (its residuals start from zero after a reshard): the global model and
    Adam moments after the load are the saved ones, and the run goes on."""
    base = tiny_gpt_args + COMMON + HIGGS + ["--global-batch-size", "16"]
    saved = run_ranks(run_trainer, save_world, args=(base + save_layout + ["--train-iters", "3", "--save",
                                                                             str(tmp_path)],))
    argv = base + load_layout + ["--train-iters", "5", "--load", str(tmp_path), "--recovery-mode", "reshard"]
    resumed = run_ranks(run_trainer, load_world, args=(argv,))
    before, after = _global(saved, "final"), _global(resumed, "after_load")
    moment_keys = [k for k in before if "exp_avg" in k]
    assert moment_keys and any(not k.startswith("optimizer.") for k in before)
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert resumed[-1]["start"] == 3 and sorted(resumed[-1]["losses"]) == [4, 5]


@pytest.mark.oracle
@pytest.mark.parametrize("optimizer", [pytest.param([], id="adam"),
                                       pytest.param(["--use-distributed-optimizer"], id="distopt")])
def test_reshard_across_a_vocabulary_padding_change(tmp_path, optimizer, tiny_gpt_args):
    """TP=2 pads the vocabulary to 512 rows with the default divisor, TP=1 to 384: the reshard
    keeps every real row of the model and the Adam moments bitwise, and training goes on."""
    from higgs_megatron.training.corpus import ByteTokenizer

    vocab = ByteTokenizer().vocab_size
    base = tiny_gpt_args + ["--eval-iters", "0", "--lr-decay-iters", "8", "--lr-warmup-iters", "1",
                            "--global-batch-size", "8"] + optimizer
    saved = run_ranks(run_trainer, 2, args=(base + ["--tensor-model-parallel-size", "2", "--train-iters", "3",
                                                    "--save", str(tmp_path)],))
    assert Manifest.read(tmp_path / "iter_0000003").vocab == {
        "vocab_size": vocab, "make_vocab_size_divisible_by": 128, "padded_vocab_size": 512}
    with pytest.raises(RankFailure, match=r"padded vocabulary: checkpoint 512 rows, now 384 .*"
                                          r"--make-vocab-size-divisible-by 256 would keep 512"):
        run_ranks(run_trainer, 2, args=(base + ["--train-iters", "4", "--load", str(tmp_path)],))
    resumed = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "8", "--load", str(tmp_path),
                                                      "--recovery-mode", "reshard"],))
    before, after = _global(saved, "final"), _global(resumed, "after_load")
    padded = [k for k in before if k.endswith("word_embeddings.weight")]
    assert {"embedding.word_embeddings.weight", "optimizer.state.exp_avg.embedding.word_embeddings.weight",
            "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight"} <= set(padded)
    assert {tuple(before[k].shape) for k in padded} == {(512, 64)} and {tuple(after[k].shape) for k in padded} == {(384, 64)}
    assert before.keys() == after.keys()
    for key in before:  # the model, the moments (and the distributed optimizer's main parameters)
        rows = vocab if key in padded else None
        assert torch.equal(before[key][:rows], after[key][:rows]), key
    losses = [resumed[-1]["losses"][i] for i in sorted(resumed[-1]["losses"])]
    assert resumed[-1]["start"] == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("world_size,layout", [
    pytest.param(2, [], id="dp2"),
    pytest.param(4, ["--tensor-model-parallel-size", "2"], id="tp2xdp2"),
])
def test_owner_written_optimizer_state_equals_megatrons_gathered_one(world_size, layout, tiny_gpt_args):
    """Oracle: Megatron's fully_reshardable state (built by gathering every DP shard)."""
    argv = tiny_gpt_args + COMMON + layout + ["--use-distributed-optimizer", "--ddp-bucket-size", "3000"]
    outs = run_ranks(optimizer_state_both_ways, world_size, args=(argv,))
    megatron, ours = _global(outs, "megatron"), _global(outs, "ours")
    assert megatron.keys() == ours.keys() and any("exp_avg_sq" in k for k in ours)
    for key in megatron:
        assert not ours[key].isnan().any(), f"{key}: the owners' pieces do not tile it"
        assert torch.equal(megatron[key], ours[key]), key
    written = [len(out["ours"]) for out in outs]
    assert all(written), f"every DP rank writes some of the state: {written}"


@pytest.mark.oracle
def test_same_sharding_refuses_a_changed_layout_naming_each_difference(tmp_path, tiny_gpt_args):
    base = tiny_gpt_args + COMMON
    proc = run_pretrain_script(base + ["--tensor-model-parallel-size", "2", "--train-iters", "2",
                                       "--save", str(tmp_path)], nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_pretrain_script(base + ["--train-iters", "4", "--load", str(tmp_path),
                                       "--use-distributed-optimizer"], nproc=2)
    assert proc.returncode != 0
    assert "exitcode  : 3" in proc.stderr
    for line in ("tensor-model-parallel size: checkpoint 2, now 1", "data-parallel size: checkpoint 1, now 2",
                 "distributed optimizer: checkpoint off, now on"):
        assert proc.stderr.count(line) == 1, line
    assert " loaded " not in proc.stdout


@pytest.mark.parametrize("damage", ["truncated-shard", "flipped-common"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tiny_gpt_args, damage):
    """The newest checkpoint (4) damaged as a power loss or a bad copy leaves it: rank 1's
    shard truncated, or a byte of rank 0's common state flipped. ``--checkpoint-version 4``
    refuses it, naming the file; ``--auto-resume`` loads 2 with a warning naming the file and
    why, and the run finishes, its save of 4 replacing the damaged one."""
    save, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    base = tiny_gpt_args + COMMON + ["--save", str(save), "--save-interval", "2"]
    run_ranks(run_trainer, 2, args=(base + ["--train-iters", "4"],))
    newest = save / "iter_0000004"
    if damage == "truncated-shard":
        victim, writer = newest / "__1_0.distcp", 1
        victim.write_bytes(victim.read_bytes()[:100])
    else:  # megatron-core 0.19 keeps the common state in rank 0's shard files: its index then
        victim, writer = next(newest / n for n in ("common.pt", ".metadata") if (newest / n).exists()), 0
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    said = f"{victim}: SHA-256 does not match the rank map (written by rank {writer})"
    with pytest.raises(RankFailure, match=re.escape(said)):
        run_ranks(run_trainer, 2, args=(base + ["--train-iters", "6", "--load", str(save), "--checkpoint-version", "4"],))
    resumed = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "6", "--auto-resume", "--log-json", str(log)],))
    assert resumed[0]["start"] == 2
    records = [json.loads(line) for line in log.read_text().splitlines()]
    fallbacks = [r["warning"] for r in records if r.get("event") == "checkpoint_fallback"]
    assert fallbacks == [f"{newest} failed its integrity check ({said}); falling back to {save / 'iter_0000002'}"]
    assert committed_checkpoints(save) == [2, 4, 6] and (save / "latest").read_text() == "6\n"
    assert verify_files(newest, Manifest.read(newest), 0, 1) == []  # saved again, whole


def test_a_load_failing_on_one_rank_raises_the_same_error_on_every_rank(tmp_path, tiny_gpt_args):
    """Rank 1's part of a load fails: before the collectives the other rank goes into, in
    torch's read of its files (on megatron-core 0.19 each rank reads alone, before them too),
    or after the last collective (its model refuses the state, where
    the other rank would otherwise train on and hang in the first gradient reduction). Every
    rank raises the same ``CheckpointError`` naming rank 1 and its error, and none waits for
    the group's timeout (minutes) to learn it."""
    base = tiny_gpt_args + COMMON + ["--train-iters", "4"]
    run_ranks(run_trainer, 2, args=(base + ["--train-iters", "2", "--save", str(tmp_path)],))
    causes = {"early": r"rank 1: OSError: \[Errno 5\] Input/output error",
              "read": r"rank 1: OSError: \[Errno 5\] Input/output error",
              "restore": r"rank 1: RuntimeError: size mismatch for decoder"}
    for where, cause in causes.items():
        outs = run_ranks(load_failing_on_rank_1, 2, args=(base + ["--load", str(tmp_path)], where), timeout=120)
        assert outs[0]["error"] == outs[1]["error"], (where, outs)
        assert re.fullmatch(rf"checkpoint {re.escape(str(tmp_path / 'iter_0000002'))} not loaded: {cause}",
                            outs[0]["error"] or ""), (where, outs)


def test_a_save_failing_on_one_rank_alone_ends_the_run_on_every_rank(tmp_path, tiny_gpt_args):
    """Rank 1 cannot read back its files to hash them, while rank 0 goes on into megatron-core's
    finalization collectives: a failure one rank raised alone, after which the ranks'
    collectives may be out of step. Where a failed save is otherwise tolerated, this one ends
    the run: both ranks raise ``RanksOutOfStep`` naming rank 1 and its error (rank 0 as soon as
    its collective gives up on the gone rank), and nothing is committed."""
    argv = tiny_gpt_args + COMMON + ["--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2"]
    outs = run_ranks(save_failing_on_rank_1_alone, 2, args=(argv,), timeout=120)
    for out in outs:
        kind, message = out["error"]
        assert kind == "RanksOutOfStep" and re.fullmatch(
            rf"checkpoint {re.escape(str(tmp_path))}/iter_0000002\.[0-9a-f-]+\.tmp not committed: rank 1: "
            r"OSError: \[Errno 5\] Input/output error", message), out
    assert committed_checkpoints(tmp_path) == [] and not (tmp_path / "latest").exists()


def test_the_checkpoint_tool_inspects_verifies_and_plans_offline(tmp_path, tiny_gpt_args, capsys):
    from higgs_megatron.cli import main as cli

    base = tiny_gpt_args + ["--eval-iters", "0", "--tensor-model-parallel-size", "2", "--save", str(tmp_path)]
    run_ranks(run_trainer, 2, args=(base + ["--train-iters", "2", "--save-interval", "1"],))
    (tmp_path / "iter_0000009.tmp").mkdir()  # what a crash mid-save leaves
    capsys.readouterr()

    assert cli(["checkpoint", "inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["iteration"] for c in report["checkpoints"]] == [1, 2] and report["pointers"] == {"latest": "2"}
    assert report["uncommitted"] == ["iter_0000009.tmp"]
    newest = report["checkpoints"][-1]
    assert newest["layout"]["tensor_model_parallel_size"] == 2 and newest["consumed_samples"] == 8
    assert [r["bytes"] > 0 for r in newest["ranks"]] == [True, True] and newest["vocab"]["padded_vocab_size"] == 512

    assert cli(["checkpoint", "verify", str(tmp_path)]) == 0
    files = sum(len(r.files) for r in Manifest.read(tmp_path / "iter_0000002").ranks)
    assert f"all {files} files match the rank map" in capsys.readouterr().out
    shard = tmp_path / "iter_0000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (tmp_path / "iter_0000002" / "__0_0.distcp").unlink()
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "__0_0.distcp: missing (written by rank 0)" in out
    assert "__1_0.distcp: SHA-256 does not match the rank map (written by rank 1)" in out
    assert cli(["checkpoint", "verify", str(tmp_path), "--version", "1"]) == 0

    target = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--data-parallel-size", "2"]
    assert cli(["checkpoint", "plan", str(tmp_path), *target, "--recovery-mode", "same-sharding"]) == 1
    out = capsys.readouterr().out
    assert "tensor-model-parallel size: checkpoint 2, now 1" in out and "data-parallel size: checkpoint 1, now 2" in out
    assert "--recovery-mode same-sharding: refused" in out and "--recovery-mode reshard: loads" in out
    assert "embedding.word_embeddings.weight: 512 rows in the checkpoint, 384 at the target" in out
    assert "padded vocabulary: checkpoint 512 rows, now 384" in out and "resets: RNG states" in out
    assert "--make-vocab-size-divisible-by 256 would keep 512" in out
    assert cli(["checkpoint", "plan", str(tmp_path), *target, "--make-vocab-size-divisible-by", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["reshaped"] == [] and plan["reshard"] and not plan["same_sharding"]
    same_layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--data-parallel-size", "1"]
    assert cli(["checkpoint", "plan", str(tmp_path), *same_layout, "--make-vocab-size-divisible-by", "64"]) == 0
    out = capsys.readouterr().out  # a divisor change alone: same-sharding refuses, reshard reshapes and resets
    assert "same-sharding: refused" in out and "reshard: loads" in out and "resets: RNG" in out
    assert cli(["checkpoint", "plan", str(tmp_path), *same_layout, "--vocab-size", "300"]) == 1
    assert "another tokenizer" in capsys.readouterr().out
    assert cli(["checkpoint", "plan", str(tmp_path), *target[:4], "--data-parallel-size", "0"]) == 2
    assert cli(["checkpoint", "inspect", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("mode", [pytest.param([], id="sync"), pytest.param(["--async-checkpoint"], id="async")])
def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, mode, tiny_gpt_args):
    """sync: rank 1 dies after writing and hashing its files, before the commit; async: rank 1
    dies while its writer thread writes, the loop already a step further. The directory left,
    named by the job's save id, is the same job's: its next save removes it."""
    base = tiny_gpt_args + COMMON + mode + ["--save", str(tmp_path), "--save-interval", "2"]
    with pytest.raises(RankFailure):  # rank 1 dies; rank 0 fails or is killed with it
        run_ranks(run_trainer, 2, args=(base + ["--train-iters", "6"], 4), timeout=120)
    assert (tmp_path / "latest").read_text().strip() == "2"
    assert len(list(tmp_path.glob("iter_0000004.*.tmp"))) == 1 and not (tmp_path / "iter_0000004").exists()
    resumed = run_ranks(run_trainer, 2, args=(base + ["--train-iters", "4", "--load", str(tmp_path)],))
    assert resumed[0]["start"] == 2
    assert not list(tmp_path.glob("iter_*.tmp")), "the next save removes the leftover"
    assert (tmp_path / "latest").read_text().strip() == "4"


@pytest.mark.parametrize("mode,step", [pytest.param([], "replace_dir", id="sync-before-rename"),
                                       pytest.param(["--async-checkpoint"], "write_latest", id="async-before-latest")])
def test_rank_0_killed_inside_the_commit_loses_nothing_committed(tmp_path, mode, step, tiny_gpt_args):
    """Rank 0 killed inside the commit of iteration 4: with the rank map written but the
    directory still ``.tmp`` (never loaded), or renamed but ``latest`` still at 2 (loaded
    only if ``latest`` names it: a pointer moved back by hand is honoured). The next start
    loads 2, a whole checkpoint, saves 4 and 6 again (the leftover removed, the renamed 4
    replaced), and every checkpoint left verifies against its rank map."""
    base = tiny_gpt_args + COMMON + mode + ["--save", str(tmp_path), "--save-interval", "2", "--train-iters", "6"]
    with pytest.raises(RankFailure):
        run_ranks(run_trainer, 2, args=(base, None, None, None, None, None, (step, 4)), timeout=120)
    assert (tmp_path / "latest").read_text() == "2\n"
    if step == "replace_dir":
        leftover = list(tmp_path.glob("iter_0000004.*.tmp"))
        assert len(leftover) == 1 and (leftover[0] / MANIFEST_NAME).exists() and committed_checkpoints(tmp_path) == [2]
    else:
        assert committed_checkpoints(tmp_path) == [2, 4]
    resumed = run_ranks(run_trainer, 2, args=(base + ["--load", str(tmp_path)],))
    assert resumed[0]["start"] == 2
    assert not list(tmp_path.glob("iter_*.tmp")) and not list(tmp_path.glob("iter_*.replaced"))
    assert committed_checkpoints(tmp_path) == [2, 4, 6] and (tmp_path / "latest").read_text() == "6\n"
    for iteration in (2, 4, 6):
        directory = tmp_path / f"iter_{iteration:07d}"
        assert verify_files(directory, Manifest.read(directory), 0, 1) == [], directory


def test_two_jobs_saving_into_one_directory_leave_each_others_files_alone(tmp_path, tiny_gpt_args):
    """Job A has begun its save of iteration 2 (its ``.tmp`` made) and is held there while job
    B, started in the same directory, saves iteration 1 and ends: B's save leaves A's save in
    progress alone (a live launch's) and certifies only the files its own writer wrote. A then
    commits 2 and 4; every checkpoint holds exactly the files its rank map lists, each verifying,
    and carries its own job's save id."""
    import threading

    flag = tmp_path / "go"
    save = tmp_path / "ckpt"
    common = tiny_gpt_args + COMMON + ["--save", str(save)]
    job_a: dict = {}

    def run_job_a() -> None:
        try:
            job_a["out"] = run_ranks(run_trainer, 2, args=(common + ["--save-interval", "2", "--train-iters", "4"],
                                                           None, None, None, None, (2, str(flag))), timeout=300)
        except RankFailure as failure:
            job_a["error"] = str(failure)

    thread = threading.Thread(target=run_job_a)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not list(save.glob("iter_0000002.*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.1)
        in_progress = list(save.glob("iter_0000002.*.tmp"))
        assert len(in_progress) == 1, "job A never began its save"
        run_ranks(run_trainer, 2, args=(common + ["--save-interval", "1", "--train-iters", "1"],))
        assert in_progress[0].is_dir(), "job B removed job A's save in progress"
    finally:
        flag.touch()
        thread.join()
    assert "out" in job_a, job_a.get("error", "job A did not finish")[-4000:]
    assert committed_checkpoints(save) == [1, 2, 4] and (save / "latest").read_text() == "4\n"
    launches = {}
    for iteration in (1, 2, 4):
        directory = save / f"iter_{iteration:07d}"
        manifest = Manifest.read(directory)
        on_disk = {p for p in os.listdir(directory) if p != MANIFEST_NAME}
        assert on_disk == {f.path for r in manifest.ranks for f in r.files}, directory
        assert verify_files(directory, manifest, 0, 1) == [], directory
        launches[iteration] = manifest.save_id.split("-")[0]
    assert launches[2] == launches[4] != launches[1], launches
    assert in_progress[0].name.split(".")[1].startswith(launches[2])


def test_checkpoint_interval_saves_by_wall_clock(tmp_path, tiny_gpt_args):
    """An interval shorter than a step: every iteration is due, decided together (a rank whose
    clock disagreed would hang the save's collectives)."""
    argv = tiny_gpt_args + COMMON + ["--train-iters", "3", "--save", str(tmp_path), "--checkpoint-interval", "1e-6",
                                     "--async-checkpoint"]
    run_ranks(run_trainer, 2, args=(argv,))
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert (tmp_path / "latest").read_text().strip() == "3"


def test_rank_map_describes_every_rank(tmp_path, tiny_gpt_args):
    run_ranks(run_trainer, 4, args=(tiny_gpt_args + COMMON + ["--tensor-model-parallel-size", "2", "--train-iters", "1",
                                                              "--save", str(tmp_path), "--keep-last", "1"] + HIGGS,))
    manifest = Manifest.read(tmp_path / "iter_0000001")
    raw = json.loads((tmp_path / "iter_0000001" / MANIFEST_NAME).read_text())
    assert raw["schema_version"] == 1 and manifest.layout.tensor_model_parallel_size == 2
    assert manifest.layout.data_parallel_size == 2 and manifest.higgs["compression_ratio"] == 0.01
    assert [r.rank for r in manifest.ranks] == [0, 1, 2, 3]
    assert {(r.coords["tp"], r.coords["dp"]) for r in manifest.ranks} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for record in manifest.ranks:
        assert record.files and all(len(f.sha256) == 64 for f in record.files)
        assert any(f.path.startswith(f"__{record.rank}_") for f in record.files)
    on_disk = {p for p in os.listdir(tmp_path / "iter_0000001") if p != MANIFEST_NAME}
    assert on_disk == {f.path for r in manifest.ranks for f in r.files}
    # every saved tensor is tiled exactly once by the main-replica shards: same global shape,
    # volumes adding up to the tensor's, no two shards overlapping
    by_key = {}
    for record in manifest.ranks:
        for shard in record.shards:
            by_key.setdefault(shard.key, []).append(shard)
    assert "embedding.word_embeddings.weight" in by_key and len(by_key) > 10
    for key, pieces in by_key.items():
        assert all(p.global_shape == pieces[0].global_shape for p in pieces), key
        assert sum(math.prod(p.local_shape) for p in pieces) == math.prod(pieces[0].global_shape), key
        assert all(_intersection_volume(a, b) == 0 for i, a in enumerate(pieces) for b in pieces[i + 1:]), key
    assert _record_crcs(tmp_path / "iter_0000001") == {0}  # written by megatron-core's forked writers


def _record_crcs(directory) -> set[int]:
    """The CRC-32 fields of every zip record header in the shard files (``torch.save`` writes
    one zip per tensor; a save inside ``crc32_skipped`` leaves them 0)."""
    crcs = set()
    for path in directory.glob("*.distcp"):
        data = path.read_bytes()
        start = data.find(b"PK\x03\x04")
        while start >= 0:
            crcs.add(int.from_bytes(data[start + 14:start + 18], "little"))
            start = data.find(b"PK\x03\x04", start + 4)
    return crcs


@pytest.mark.oracle
@pytest.mark.parametrize("mode", [pytest.param([], id="sync"), pytest.param(["--async-checkpoint"], id="async")])
def test_a_failed_save_commits_nothing_training_goes_on_and_a_second_in_a_row_ends_the_run(tmp_path, mode,
                                                                                          tiny_gpt_args):
    """Rank 1 cannot write from iteration 4 on. The save of 4 commits nothing on any rank and
    every rank trains on (one ``checkpoint_failed`` event); the save of 6, the second failure
    in a row, ends the run on every rank; ``latest`` stays at 2."""
    log = tmp_path / "log.jsonl"
    base = tiny_gpt_args + COMMON + mode + ["--save", str(tmp_path), "--save-interval", "2", "--train-iters", "6",
                                            "--log-json", str(log)]
    # The rank writes several files (__1_0, __1_1, ...); which one fails first varies.
    with pytest.raises(RankFailure, match=r"iter_0000006\.[0-9a-f-]+\.tmp not committed: .*Permission denied: .*__1_\d+.distcp"):
        run_ranks(run_trainer, 2, args=(base, None, (1, 4)), timeout=200)
    assert (tmp_path / "latest").read_text().strip() == "2"
    assert not (tmp_path / "iter_0000004").exists() and not (tmp_path / "iter_0000006").exists()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    failed = [r for r in records if r["type"] == "event" and r["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and re.search(r"iter_0000004\.[0-9a-f-]+\.tmp not committed", failed[0]["error"]), failed
    assert [r["iteration"] for r in records if r["type"] == "iteration"] == [6]  # trained past the failed save


@pytest.mark.parametrize("mode", [pytest.param([], id="sync"), pytest.param(["--async-checkpoint"], id="async")])
def test_rank_0_failing_to_begin_or_commit_reaches_every_rank_and_training_goes_on(tmp_path, mode, tiny_gpt_args):
    """Rank 0 cannot make the save's directory at 2 (begin) and cannot finish the commit at 6
    (the disk full as it writes the rank map): each time every rank raises the same error,
    naming rank 0, through one broadcast (no rank is left waiting in a barrier); nothing is
    committed and training goes on, and 4 and 8 commit. Each rank map carries its own save id."""
    log = tmp_path / "log.jsonl"
    base = tiny_gpt_args + COMMON + mode + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                                            "--train-iters", "8", "--log-json", str(log)]
    run_ranks(run_trainer, 2, args=(base, None, None, None, {"begin": 2, "commit": 6}), timeout=200)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    failed = [r["error"] for r in records if r["type"] == "event" and r["event"] == "checkpoint_failed"]
    assert len(failed) == 2, failed
    assert re.fullmatch(r"checkpoint of iteration 2 not begun: rank 0: PermissionError: \[Errno 13\] Permission denied",
                        failed[0]), failed
    assert re.fullmatch(r"checkpoint \S+/iter_0000006\.[0-9a-f]{8}-[0-9a-f]{4}\.tmp not committed: rank 0: OSError: "
                        r"\[Errno 28\] No space left on device", failed[1]), failed
    assert committed_checkpoints(tmp_path / "ckpt") == [4, 8] and (tmp_path / "ckpt" / "latest").read_text() == "8\n"
    ids = [Manifest.read(tmp_path / "ckpt" / f"iter_000000{i}").save_id for i in (4, 8)]
    assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}", i) for i in ids) and ids[0] != ids[1], ids


def test_save_schedule_saves_by_iteration_and_by_wall_clock():
    """The one rule both front-ends save by: iterations 3 and 6 by --save-interval 3, and 5 by
    --checkpoint-interval 0.2 once 0.2 s have passed since the save at 3; without either, never."""
    from higgs_megatron.checkpoint.interval import SaveSchedule
    from tests.workers.checkpoint import save_schedule_decisions

    assert run_ranks(save_schedule_decisions, 1, timeout=120)[0] == [False, False, True, False, True, True]
    never = SaveSchedule(None, None)
    assert not any(never.due(iteration) for iteration in range(1, 10))
