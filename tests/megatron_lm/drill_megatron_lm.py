"""Megatron-LM's own training loop under the patches, on CPU over gloo: sync equivalence,
compression, the rank map on its checkpoints, reshard, recovery.

On megatron-core 0.16.1 it needs ``MEGATRON_LM_PATH`` (a checkout of tag core_v0.16.1, its
pretrain_gpt.py unmodified). On 0.19 the wheel's ``megatron.training`` runs, through
``gpt_entry`` (or a core_v0.19.0 checkout's pretrain_gpt.py, with ``MEGATRON_LM_PATH``). Both
need Megatron-LM's training imports (``pip install -e '.[megatron-lm]'``); skipped, saying
which is missing, without them.
Megatron-LM logs, on the second iteration after a resume, the mean of the first two (its
``training_log`` does not reset its sums on the first logged iteration): the continuity
checks expect exactly that, and compare grad norms and final weights as well.
"""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from higgs_megatron_bench.ranks import REPO_ROOT, run_pretrain_script
from higgs_megatron_patches.megatron_lm.checkout import wheel_ships_training
from higgs_megatron_patches.megatron_lm.cpu import CPU_FLAGS as PATCHES_CPU_FLAGS

CHECKOUT = os.environ.get("MEGATRON_LM_PATH")
WHEEL = wheel_ships_training()  # megatron-core 0.19: Megatron-LM's training loop without a checkout
_MISSING = [name for name in ("transformers", "einops", "tiktoken", "sentencepiece", "regex", "six", "triton")
            if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.skipif(not CHECKOUT and not WHEEL,
                       reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1)"),
    pytest.mark.skipif(bool(_MISSING), reason=f"Megatron-LM's training imports missing: {', '.join(_MISSING)} "
                                              "(pip install -e '.[megatron-lm]')"),
]

LAUNCHER = REPO_ROOT / "patches" / "run_pretrain_gpt.py"
CPU_FLAGS = [word for flag in dict.fromkeys(flag for flag, _, _ in PATCHES_CPU_FLAGS) for word in flag.split()]
MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-layers", "2",
         "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
         "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "1000"]
LAYOUTS = {
    "dp2": (2, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2xdp2-distopt": (4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]),
}
_LINE = re.compile(r" iteration +(\d+)/ +\d+ \|.*")


def megatron_lm(nproc: int, *argv: str, iters: int = 6, global_batch: int = 4, expect_ok: bool = True,
                with_checkout: bool = True):
    checkout = ["--megatron-lm-path", CHECKOUT] if CHECKOUT and with_checkout else []
    proc = run_pretrain_script([*checkout, *MODEL, *CPU_FLAGS, "--train-iters", str(iters),
                                "--global-batch-size", str(global_batch), *argv], nproc=nproc, timeout=600,
                               env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, script=LAUNCHER)  # Megatron-LM asks it for TP
    if expect_ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def iterations(stdout: str) -> dict[int, dict[str, float]]:
    """Per logged iteration: every 'name: value' field of Megatron-LM's line."""
    found = {}
    for match in _LINE.finditer(stdout):
        fields = {}
        for part in match.group(0).split("|")[1:]:
            name, _, value = part.partition(":")
            try:
                fields[name.strip()] = float(value)
            except ValueError:
                continue
        found[int(match.group(1))] = fields
    return found


def column(stdout: str, name: str) -> list[float]:
    return [fields[name] for _, fields in sorted(iterations(stdout).items())]


def tensors(checkpoint_dir, out) -> dict[str, torch.Tensor]:
    """A torch_dist checkpoint's global tensors, read in this one process."""
    dcp_to_torch_save(str(checkpoint_dir), str(out))
    state = torch.load(out, weights_only=False)
    return {key: value for key, value in state.items() if isinstance(value, torch.Tensor)}


def assert_same_checkpoint(tmp_path, name: str, other: str = "b", reference: Path | None = None) -> None:
    """Runs ``reference`` (a/ by default) and ``other``/ saved the same checkpoint ``name``: every
    tensor bitwise, optimizer state included."""
    a = tensors((reference or tmp_path / "a") / name, tmp_path / "a.pt")
    b = tensors(tmp_path / other / name, tmp_path / f"{other}.pt")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


DRILL = ["--use-higgs", "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--save-interval", "1000"]
BUCKETS = {"dense": ["--higgs-link-gbps", "100"],  # the default --higgs-sync auto, told the link is fast
           "sparse": ["--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0", "--higgs-compression-ratio", "0.05"]}
# The undisturbed run that the resume, hang and rerun drills disturb: 5% with error feedback, the
# distributed optimizer, saved at 3 and 6; reruns disabled, the checks the rerun drill fires on set
STRAIGHT = [*DRILL, *BUCKETS["sparse"], "--save-interval", "3", "--higgs-step-timeout", "2",
            "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss", "--rerun-mode", "disabled"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[str, Path]:
    """``STRAIGHT`` run once for the drills that compare with it: its log and its save folder."""
    save = tmp_path_factory.mktemp("straight")
    return megatron_lm(2, *STRAIGHT, "--save", str(save)).stdout, save


def undisturbed(request, tmp_path, flags: list[str]) -> tuple[str, Path]:
    """The run with ``flags`` and nothing injected, saved: the module's for ``STRAIGHT``, else run now into a/."""
    if flags == STRAIGHT:
        return request.getfixturevalue("straight")
    return megatron_lm(2, *flags, "--save", str(tmp_path / "a")).stdout, tmp_path / "a"


@pytest.mark.skipif(not (WHEEL and CHECKOUT), reason="compares gpt_entry with a core_v0.19.0 checkout's pretrain_gpt.py: "
                                                   "megatron-core 0.19 and MEGATRON_LM_PATH")
def test_gpt_entry_trains_as_the_checkouts_pretrain_gpt():
    """Without a checkout the launcher runs ``gpt_entry``: the same losses and grad norms as the
    checkout's own pretrain_gpt.py on the wheel's training code, TP=2 (its batch broadcast)."""
    flags = ["--tensor-model-parallel-size", "2", "--use-higgs", "--higgs-compressor", "none"]
    script = megatron_lm(2, *flags).stdout
    entry = megatron_lm(2, *flags, with_checkout=False).stdout
    assert column(entry, "lm loss") == column(script, "lm loss") and len(column(script, "lm loss")) == 6
    assert column(entry, "grad norm") == column(script, "grad norm")


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.oracle) if name == "dp2" else name
                                    for name in LAYOUTS])
def test_higgs_none_equals_dense_for_10_iterations(layout):
    nproc, flags = LAYOUTS[layout]
    batch = 8 if nproc == 4 else 4
    dense = megatron_lm(nproc, *flags, iters=10, global_batch=batch).stdout
    none = megatron_lm(nproc, *flags, "--use-higgs", "--higgs-compressor", "none", iters=10,
                       global_batch=batch).stdout
    assert len(column(dense, "lm loss")) == 10
    assert column(none, "lm loss") == column(dense, "lm loss")
    assert column(none, "grad norm") == column(dense, "grad norm")
    assert column(none, "higgs MB sent") == column(none, "higgs MB dense")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_percent_trains_and_sends_a_fraction(layout):
    """(DP=2 at 5% is in every run of ``STRAIGHT``, checked by the resume drill.)"""
    nproc, flags = LAYOUTS[layout]
    sparse = megatron_lm(nproc, *flags, "--use-higgs", "--higgs-sync", "sparse", "--higgs-compression-ratio", "0.01",
                         iters=10, global_batch=8 if nproc == 4 else 4).stdout
    assert_compressed(sparse, 0.01, one_rank=layout == "tp2")


def assert_compressed(log: str, density: float, one_rank: bool = False) -> None:
    """The run's losses fell, and every step sent a fraction of dense's bytes at ``density``
    (everything with ``one_rank``: one data-parallel rank has no peer to send to)."""
    losses = column(log, "lm loss")
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    sent, dense_bytes = column(log, "higgs MB sent"), column(log, "higgs MB dense")
    if one_rank:
        assert sent == dense_bytes, (sent, dense_bytes)
    else:
        assert all(0 < s < d / 5 for s, d in zip(sent, dense_bytes)), (sent, dense_bytes)
    assert set(column(log, "higgs density")) == {density}


def test_dense_iterations_then_compression_with_frozen_adam_variance():
    """``--higgs-dense-iters 4 --higgs-freeze-adam-variance`` through Megatron-LM's optimizer
    factory: the first four steps are Megatron's own, then 1% compression starts."""
    flags = ["--use-distributed-optimizer"]
    dense = megatron_lm(2, *flags, iters=8).stdout
    # --no-higgs-dense-int8: the dense stage through Megatron's own collective (by default it goes
    # as the int8 payload at density 1, which rounds)
    staged = megatron_lm(2, *flags, "--use-higgs", "--higgs-sync", "sparse", "--higgs-compression-ratio", "0.01",
                         "--higgs-dense-iters", "4", "--higgs-freeze-adam-variance", "--no-higgs-dense-int8",
                         iters=8).stdout
    assert column(staged, "lm loss")[:5] == column(dense, "lm loss")[:5]
    assert column(staged, "lm loss")[5:] != column(dense, "lm loss")[5:]
    assert column(staged, "higgs density") == [1.0] * 4 + [0.01] * 4
    sent, dense_bytes = column(staged, "higgs MB sent"), column(staged, "higgs MB dense")
    assert sent[:4] == dense_bytes[:4] and all(s < d / 5 for s, d in zip(sent[4:], dense_bytes[4:]))


def test_without_use_higgs_the_patched_run_equals_the_unpatched_checkout():
    unpatched = megatron_lm(2, "--higgs-no-patches").stdout
    patched = megatron_lm(2).stdout
    assert column(patched, "lm loss") == column(unpatched, "lm loss") and len(column(patched, "lm loss")) == 6
    assert column(patched, "grad norm") == column(unpatched, "grad norm")
    assert "higgs" not in "".join(_LINE.findall(patched))


@pytest.mark.parametrize("saving", [pytest.param("sync", marks=pytest.mark.oracle), "async"])
def test_save_and_resume_continue_the_straight_run(tmp_path, saving, request):
    common = STRAIGHT if saving == "sync" else [*STRAIGHT, "--async-checkpoint"]
    straight_log, saved = undisturbed(request, tmp_path, common)
    resumed = megatron_lm(2, *common, "--save", str(tmp_path / "b"), "--load", str(saved),
                          "--checkpoint-version", "3").stdout
    # .metadata, metadata.json and the shard files: 0.16.1 writes two per rank and common.pt; 0.19
    # one per rank, and keeps the common state in rank 0's
    assert f"rank map and {4 if WHEEL else 7} file hashes checked (same sharding)" in resumed, resumed[-3000:]
    assert_compressed(straight_log, 0.05)
    full, tail = iterations(straight_log), iterations(resumed)
    assert sorted(tail) == [4, 5, 6]
    assert tail[4]["lm loss"] == full[4]["lm loss"] and tail[6]["lm loss"] == full[6]["lm loss"]
    assert tail[5]["lm loss"] == pytest.approx((full[4]["lm loss"] + full[5]["lm loss"]) / 2, rel=1e-6)
    assert [tail[i]["grad norm"] for i in (4, 5, 6)] == [full[i]["grad norm"] for i in (4, 5, 6)]
    assert_same_checkpoint(tmp_path, "iter_0000006", reference=saved)


@pytest.mark.parametrize("saved", ["tp2", "pp2"])
def test_same_sharding_refuses_another_layout_and_reshard_moves_to_it(tmp_path, saved, capsys):
    """tp2: a 301-token vocabulary pads to 512 rows at TP=2 and to 384 at TP=1 (the default
    divisor): the reshard keeps every real row; the checkpoint tool plans it first."""
    from higgs_megatron.cli import main as cli

    flag = "--tensor-model-parallel-size" if saved == "tp2" else "--pipeline-model-parallel-size"
    common = ["--use-higgs", "--higgs-sync", "sparse", "--use-distributed-optimizer"]
    common += ["--vocab-size", "300"] if saved == "tp2" else []
    megatron_lm(2, *common, flag, "2", "--save", str(tmp_path / "a"), "--save-interval", "3")

    refused = megatron_lm(2, *common, "--load", str(tmp_path / "a"), expect_ok=False)
    assert refused.returncode != 0
    size = "tensor" if saved == "tp2" else "pipeline"
    assert ("--recovery-mode same-sharding refuses to load it" in refused.stderr
            and f"{size}-model-parallel size: checkpoint 2, now 1" in refused.stderr
            and "data-parallel size: checkpoint 1, now 2" in refused.stderr), refused.stderr[-3000:]
    capsys.readouterr()
    assert cli(["checkpoint", "plan", str(tmp_path / "a"), "--tensor-model-parallel-size", "1",
                "--pipeline-model-parallel-size", "1", "--data-parallel-size", "2", "--recovery-mode", "reshard"]) == 0
    plan = capsys.readouterr().out
    assert "--recovery-mode reshard: loads" in plan and "--recovery-mode same-sharding: refused" in plan
    if saved == "tp2":
        assert "padded vocabulary: checkpoint 512 rows, now 384" in refused.stderr
        assert "--make-vocab-size-divisible-by 256 would keep 512" in refused.stderr
        assert "embedding.word_embeddings.weight: 512 rows in the checkpoint, 384 at the target" in plan

    # Loaded at DP=2 and saved again before any step: the same global tensors, model and optimizer.
    again = megatron_lm(2, *common, "--load", str(tmp_path / "a"), "--checkpoint-version", "3",
                        "--recovery-mode", "reshard", "--save", str(tmp_path / "b"), "--save-interval", "1000",
                        "--use-checkpoint-opt_param-scheduler", iters=3).stdout
    assert "(resharded: " in again
    a = tensors(tmp_path / "a" / "iter_0000003", tmp_path / "a.pt")
    b = tensors(tmp_path / "b" / "iter_0000003", tmp_path / "b.pt")
    compared = [key for key in a if key.startswith(("decoder.", "embedding.", "output_layer.", "optimizer.state."))]
    assert any(key.startswith("optimizer.state.exp_avg") for key in compared)
    for key in compared:
        rows = 301 if key.endswith(("word_embeddings.weight", "output_layer.weight")) else None
        assert torch.equal(a[key][:rows], b[key][:rows]), key
    if saved == "tp2":
        assert a["embedding.word_embeddings.weight"].shape[0] == 512
        assert b["embedding.word_embeddings.weight"].shape[0] == 384

    continued = megatron_lm(2, *common, "--load", str(tmp_path / "a"), "--checkpoint-version", "3",
                            "--recovery-mode", "reshard").stdout
    before, after = column(megatron_lm(2, *common, flag, "2").stdout, "lm loss"), column(continued, "lm loss")
    assert len(after) == 3 and after[-1] < before[2], (before, after)


def test_experts_on_one_pipeline_stage_only_build_their_groups_with_every_rank():
    """--moe-layer-freq [1,0] under PP=2: the first stage's chunks hold experts, the second's
    none. Under --higgs-sync auto the experts' node groups are built collectively over the
    whole world; the second stage's ranks take part (HiggsDDP._experts_elsewhere)
    rather than leaving the first stage's waiting."""
    out = megatron_lm(4, "--pipeline-model-parallel-size", "2", "--num-experts", "4", "--expert-model-parallel-size",
                      "2", "--moe-layer-freq", "[1,0]", "--moe-router-topk", "2", "--use-higgs",
                      "--higgs-compression-ratio", "0.05", iters=3, global_batch=8).stdout
    assert sorted(iterations(out)) == [1, 2, 3], out[-3000:]


# (ranks, saved layout, loaded layout, global batch): the layouts whose optimizer state is laid
# out differently from the plain DP one (virtual stages; two optimizer instances)
RESHARDS = {
    "vpp2xpp2-to-pp2": (4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                            "--num-layers-per-virtual-pipeline-stage", "1"],
                        ["--pipeline-model-parallel-size", "2", "--num-layers", "4"], 8),
    "instances2xdp4-to-dp4": (4, ["--num-distributed-optimizer-instances", "2"], [], 8),
}


@pytest.mark.parametrize("layout", RESHARDS)
def test_reshard_moves_virtual_stages_and_optimizer_instances_to_another_layout(tmp_path, layout):
    """Saved at 3 in one layout, loaded under --recovery-mode reshard in another and saved again
    before any step: every model tensor and Adam moment is the saved one."""
    nproc, saved, loaded, batch = RESHARDS[layout]
    common = ["--use-higgs", "--higgs-sync", "sparse", "--higgs-min-bucket-numel", "0", "--use-distributed-optimizer"]
    megatron_lm(nproc, *common, *saved, "--save", str(tmp_path / "a"), "--save-interval", "3", iters=3,
                global_batch=batch)
    again = megatron_lm(nproc, *common, *loaded, "--load", str(tmp_path / "a"), "--checkpoint-version", "3",
                        "--recovery-mode", "reshard", "--save", str(tmp_path / "b"), "--save-interval", "1000",
                        "--use-checkpoint-opt_param-scheduler", iters=3, global_batch=batch).stdout
    assert "(resharded: " in again, again[-3000:]
    a = tensors(tmp_path / "a" / "iter_0000003", tmp_path / "a.pt")
    b = tensors(tmp_path / "b" / "iter_0000003", tmp_path / "b.pt")
    compared = [key for key in a if key.startswith(("decoder.", "embedding.", "output_layer.", "optimizer.state."))]
    assert any(key.startswith("optimizer.state.exp_avg") for key in compared)
    for key in compared:
        assert torch.equal(a[key], b[key]), key


def test_checkpoint_interval_saves_by_wall_clock(tmp_path):
    out = megatron_lm(2, "--use-higgs", "--higgs-sync", "sparse", "--save", str(tmp_path / "c"), "--save-interval",
                      "1000", "--checkpoint-interval", "0.001", iters=3).stdout
    committed = sorted(p.parent.name for p in (tmp_path / "c").glob("iter_*/rank_map.json"))
    assert committed == ["iter_0000001", "iter_0000002", "iter_0000003"], out[-2000:]
    # Megatron-LM's final save (3 is not a multiple of --save-interval) finds iteration 3 committed
    assert out.count("iteration 3 is already saved by this run; not saving it again") == 1, out[-2000:]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offload_under_pressure_moves_state_and_changes_nothing(tmp_path, tier):
    """The memory manager on Megatron-LM's optimizer (DP=2, distributed optimizer): with a
    scripted pressure schedule the state leaves at iteration 3 and returns at 8, and the run
    is bitwise the run without it; the nvme tier's files are gone at the end."""
    flags = ["--use-higgs", "--higgs-compressor", "none", "--use-distributed-optimizer"]
    plain = megatron_lm(2, *flags, iters=10).stdout
    tier_flags = ["--higgs-offload-device", "nvme", "--higgs-offload-dir", str(tmp_path / "off")] if tier == "nvme" else []
    offloaded = megatron_lm(2, *flags, "--higgs-offload", "--higgs-offload-schedule", "0.5x2,0.95x3,0.82x2,0.5",
                            *tier_flags, iters=10).stdout
    assert column(offloaded, "lm loss") == column(plain, "lm loss") and len(column(plain, "lm loss")) == 10
    assert column(offloaded, "grad norm") == column(plain, "grad norm")
    for rank in (0, 1):
        assert f"[rank {rank}] iteration 3: optimizer_state_offloaded:" in offloaded, offloaded[-3000:]
        assert f"[rank {rank}] iteration 8: optimizer_state_reloaded:" in offloaded, offloaded[-3000:]
    assert offloaded.count("optimizer_state_offloaded") == offloaded.count("optimizer_state_reloaded") == 2
    if tier == "nvme":
        assert not list((tmp_path / "off").rglob("*.bin"))


def test_async_saves_while_state_is_offloaded_resume_bitwise(tmp_path):
    """State is away from iteration 3 on; the async saves at 3 and 6 bring it back for their
    copy and send it away again right after: the checkpoint at 3 resumes into the same 4-6."""
    common = ["--use-higgs", "--higgs-sync", "sparse", "--use-distributed-optimizer", "--save-interval", "3",
              "--async-checkpoint"]
    straight = megatron_lm(2, *common, "--save", str(tmp_path / "a"), "--higgs-offload",
                           "--higgs-offload-schedule", "0.5x2,0.95").stdout
    assert "[rank 0] iteration 3: optimizer_state_offloaded:" in straight
    resumed = megatron_lm(2, *common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "a"),
                          "--checkpoint-version", "3").stdout
    full, tail = iterations(straight), iterations(resumed)
    assert [tail[i]["grad norm"] for i in (4, 5, 6)] == [full[i]["grad norm"] for i in (4, 5, 6)]
    assert_same_checkpoint(tmp_path, "iter_0000006")


@pytest.mark.parametrize("buckets", [pytest.param(name, marks=pytest.mark.oracle) if name == "sparse" else name
                                     for name in BUCKETS])
def test_a_hang_past_the_step_timeout_is_one_alignment_and_changes_nothing(tmp_path, buckets, request):
    """hang@1:3:6 under --higgs-step-timeout 2 (DP=2, distributed optimizer): rank 0 gives the
    sync up, every rank drops the step, rebuilds its data-parallel groups and runs iteration 3
    again on the same micro-batches; Megatron-LM logs six iterations, none skipped, and the
    checkpoint at 6 is bitwise the undisturbed run's."""
    common = STRAIGHT if buckets == "sparse" else [*DRILL, *BUCKETS[buckets], "--higgs-step-timeout", "2"]
    clean, reference = undisturbed(request, tmp_path, common)
    hang = megatron_lm(2, *common, "--save", str(tmp_path / "b"), "--inject-fault", "hang@1:3:6").stdout
    alignments = re.findall(r"progress alignment at iteration (\d+): step dropped on every rank \(([^)]*)\)", hang)
    assert alignments == [("3", "rank 0: gradient sync did not complete within 2s")], hang[-3000:]
    assert sorted(iterations(hang)) == list(range(1, 7))
    assert column(hang, "lm loss") == column(clean, "lm loss")
    assert "number of skipped iterations:   1" not in hang
    assert_same_checkpoint(tmp_path, "iter_0000006", reference=reference)


# Layouts beyond DP, TP x DP and PP x DP (above): (ranks, flags, global batch)
MORE_LAYOUTS = {
    "vpp2xpp2xdp2-distopt": (4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                 "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"], 8),
    "vpp2xpp2xdp2-adam": (4, ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                              "--num-layers-per-virtual-pipeline-stage", "1"], 8),
    "instances2xdp4": (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"], 8),
    "overlap-param-gather": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], 4),
    # MoE: EP 2 x expert DP 2 over DP 4, a routing bias moved every step (tests/sync/drill_moe.py has more)
    "moe-ep2xdp4-distopt": (4, ["--use-distributed-optimizer", "--num-experts", "4", "--expert-model-parallel-size", "2",
                                "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "0.01",
                                "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
                                "--moe-router-bias-update-rate", "0.01"], 8),
}


@pytest.mark.parametrize("layout", MORE_LAYOUTS)
def test_a_layout_equals_dense_aligns_once_and_resumes_bitwise(tmp_path, layout):
    """Virtual pipeline stages, distributed-optimizer instances, the overlapped parameter
    gather and MoE with expert parallelism, each: ``--higgs-compressor none`` is Megatron's DDP (losses and
    grad norms); at 5% with error feedback, a hang@1:3 past ``--higgs-step-timeout 2`` changes
    nothing (losses, the checkpoint at 6), through one alignment; and the checkpoint at 3
    resumes into the same iterations 4-6 and the same checkpoint at 6."""
    nproc, flags, batch = MORE_LAYOUTS[layout]

    def run(*argv: str) -> str:
        return megatron_lm(nproc, *flags, "--hidden-dropout", "0", "--attention-dropout", "0", *argv,
                           global_batch=batch).stdout

    dense, none = run(), run("--use-higgs", "--higgs-compressor", "none")
    assert column(none, "lm loss") == column(dense, "lm loss") and len(column(dense, "lm loss")) == 6
    assert column(none, "grad norm") == column(dense, "grad norm")

    sparse = ["--use-higgs", *BUCKETS["sparse"], "--higgs-step-timeout", "2", "--save-interval", "3"]
    clean = run(*sparse, "--save", str(tmp_path / "a"))
    hang = run(*sparse, "--save", str(tmp_path / "b"), "--inject-fault", "hang@1:3:6")
    alignments = re.findall(r"progress alignment at iteration (\d+): step dropped on every rank", hang)
    # With the overlapped parameter gather, rank 0 waits for rank 1 in Megatron's own all-gather of
    # iteration 3's parameters, before any gradient sync: a wait the step timeout does not bound
    # (the watchdog's --higgs-restart-timeout does), so the stall is absorbed, with no alignment.
    assert alignments == ([] if "--overlap-param-gather" in flags else ["3"]), hang[-3000:]
    assert column(hang, "lm loss") == column(clean, "lm loss")
    assert column(hang, "grad norm") == column(clean, "grad norm")
    assert_same_checkpoint(tmp_path, "iter_0000006")

    resumed = run(*sparse, "--save", str(tmp_path / "c"), "--load", str(tmp_path / "a"), "--checkpoint-version", "3")
    full, tail = iterations(clean), iterations(resumed)
    assert sorted(tail) == [4, 5, 6] and [tail[i]["grad norm"] for i in (4, 5, 6)] == [full[i]["grad norm"]
                                                                                      for i in (4, 5, 6)]
    assert_same_checkpoint(tmp_path, "iter_0000006", other="c")


@pytest.mark.oracle
def test_an_iteration_megatron_lms_rerun_state_machine_runs_twice_syncs_as_once(tmp_path, request):
    """Megatron-LM's rerun state machine (``--rerun-mode validate_results``, its default) with an
    injected transient error runs the forward-backward of the iterations it picks twice on the
    same data, so HiggsDDP syncs twice before one optimizer step. Each sync starts from the
    residual the last kept step left, and the step counts once: the run (5% compressed, error
    feedback) is bitwise the one with reruns disabled, losses, grad norms and the checkpoint.
    The injection lands on the spiky-loss check, which is not fatal: after the rerun the
    iteration goes on (a fatal check, the NaN one, ends the job with Megatron-LM's exit 17)."""
    disabled, reference = request.getfixturevalue("straight")
    proc = megatron_lm(2, *STRAIGHT, "--rerun-mode", "validate_results", "--error-injection-rate", "2",
                       "--error-injection-type", "transient_error", "--save", str(tmp_path / "b"))
    reruns = (proc.stdout + proc.stderr).count("Continuing normal execution because failed validation was not fatal")
    assert reruns >= 2, (proc.stdout + proc.stderr)[-3000:]  # iterations run twice, then stepped
    assert column(proc.stdout, "lm loss") == column(disabled, "lm loss") and len(column(disabled, "lm loss")) == 6
    assert column(proc.stdout, "grad norm") == column(disabled, "grad norm")
    assert_same_checkpoint(tmp_path, "iter_0000006", reference=reference)


def test_sigterm_under_megatron_lms_exit_signal_handler_commits_the_rank_map_and_resumes_bitwise(tmp_path):
    """Megatron-LM's own --exit-signal-handler, with rank 1 sent SIGTERM in iteration 3: every
    rank exits with status 0 after saving iteration 3 through the rank map; --auto-resume then
    loads it (rank map and hashes checked) and ends bitwise where the straight run ends."""
    common = [*DRILL, *BUCKETS["sparse"]]
    megatron_lm(2, *common, "--save", str(tmp_path / "a"))
    stopped = megatron_lm(2, *common, "--save", str(tmp_path / "b"), "--exit-signal-handler",
                          "--inject-fault", "sigterm@1:3").stdout
    assert "exiting program after receiving SIGTERM" in stopped
    assert sorted(p.parent.name for p in (tmp_path / "b").glob("iter_*/rank_map.json")) == ["iter_0000003"]
    resumed = megatron_lm(2, *common, "--save", str(tmp_path / "b"), "--auto-resume").stdout
    assert "iter_0000003: rank map and" in resumed and "(same sharding)" in resumed, resumed[-3000:]
    assert sorted(iterations(resumed)) == [4, 5, 6]
    assert_same_checkpoint(tmp_path, "iter_0000006")


SYMBOLS_CHECK = """
import sys
sys.path.insert(0, {patches!r})
from megatron_lm.checkout import use_checkout, check_checkout
use_checkout(check_checkout({checkout!r}))
from megatron_lm.install import MEGATRON_LM_SYMBOLS
from higgs_megatron.compat.symbols import Symbol, symbol_problems
assert symbol_problems(MEGATRON_LM_SYMBOLS) == [], symbol_problems(MEGATRON_LM_SYMBOLS)
reshaped = Symbol("megatron.training.training:pretrain", ({other_first!r},), "as the other release has it")
print(symbol_problems([reshaped])[0])
"""


@pytest.mark.oracle
def test_what_the_patches_rebind_is_as_they_rely_on_and_a_change_is_named():
    """Megatron-LM's training code has every symbol the patches rebind, with the parameters
    they pass; a reshaped one (``pretrain``, as the other supported release has it: 0.16.1's
    ``pretrain(train_valid_test_dataset_provider, ...)``, 0.19's ``pretrain(cfg_container, ...)``)
    is named."""
    import subprocess
    import sys

    first, other_first = ("cfg_container", "train_valid_test_dataset_provider") if WHEEL else \
        ("train_valid_test_dataset_provider", "cfg_container")
    script = SYMBOLS_CHECK.format(patches=str(REPO_ROOT / "patches"), checkout=CHECKOUT, other_first=other_first)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(f"megatron.training.training:pretrain takes ({first}, ")


@pytest.mark.parametrize("overlap", [pytest.param([], id="gather-after-the-step"),
                                     pytest.param(["--overlap-param-gather"], id="overlap-param-gather")])
def test_use_higgs_alone_is_onebit_with_the_distributed_optimizer_and_keeps_replicas_equal(overlap):
    """``--use-higgs`` alone under Megatron-LM's loop: 1-bit Adam's exchange after a dense stage of
    10 (the warm-up), the distributed optimizer's parameter all-gather as int4 changes, issued by
    Megatron-LM after the step or, with ``--overlap-param-gather``, bucket by bucket in the next
    forward's pre-hooks. Megatron-LM's own hash check of the DP replicas' weights passes every 5
    iterations, and after the dense stage each step puts under a fifth of dense's wire on the link
    (0.12x here: 1.125 + 1.125 bits of moment and 4.5 of parameter change, against 32 + 32)."""
    log = megatron_lm(2, "--use-higgs", "--use-distributed-optimizer", "--overlap-grad-reduce", *overlap,
                      "--lr-warmup-iters", "10", "--higgs-min-bucket-numel", "0",
                      "--check-weight-hash-across-dp-replicas-interval", "5", iters=20).stdout
    losses = column(log, "lm loss")
    assert len(losses) == 20 and sum(losses[-3:]) < sum(losses[:3]), losses
    wire, dense = column(log, "higgs MB wire"), column(log, "higgs MB dense wire")
    assert set(column(log, "higgs density")) == {1.0}
    # after the dense stage, every step under a fifth, but for the all-gathers Megatron-LM forces
    # dense around its weight check with the pre-hooks on (two of the nine, counted a step late)
    fifths = [w < d / 5 for w, d in zip(wire[11:], dense[11:])]
    assert sum(fifths) >= len(fifths) - (2 if overlap else 0), (wire, dense)
