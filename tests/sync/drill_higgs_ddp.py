"""HiggsDDP against Megatron's own DDP, in real multi-process megatron-core runs over gloo."""

import pytest
import torch

from higgs_megatron_bench.runs import higgs_flags, lean_flags, summarize
from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import train_variants, train_variants_on_the_compressed_form

# (world size, layout flags); every layout has DP=2 and two micro-batches per step (accumulation).
LAYOUTS = [
    pytest.param(2, ["--global-batch-size", "16"], id="dp2"),
    pytest.param(4, ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"], id="tp2xdp2"),
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"], id="pp2xdp2"),
]
DISTOPT = pytest.mark.parametrize("distopt", [[], ["--use-distributed-optimizer"]], ids=["adam", "distopt"])


def _base(tiny_gpt_args, layout, distopt, iters):
    return (tiny_gpt_args + layout + distopt
            + ["--train-iters", str(iters), "--overlap-grad-reduce", "--ddp-bucket-size", "20000"])


def _assert_equals_megatron(rank_out: dict) -> None:
    """Variants 'none' bitwise and 'topk-1.0' to 1e-6 equal to 'megatron' on this rank."""
    reference = rank_out["params"]["megatron"]
    for name, value in rank_out["params"]["none"].items():
        assert torch.equal(value, reference[name]), f"compressor none differs from Megatron DDP at {name}"
    for name, value in rank_out["params"]["topk-1.0"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-6, atol=1e-6 * reference[name].abs().max().item(),
                                   msg=lambda m: f"top-k at density 1.0 differs at {name}: {m}")
    assert rank_out["losses"]["megatron"] == rank_out["losses"]["none"]


@pytest.mark.oracle
@DISTOPT
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_equals_megatron_ddp_when_dense(world_size, layout, distopt, tiny_gpt_args):
    base = _base(tiny_gpt_args, layout, distopt, iters=5)
    variants = {
        "megatron": base,
        "none": base + ["--use-higgs", "--higgs-compressor", "none"],
        "topk-1.0": base + ["--use-higgs", "--higgs-compression-ratio", "1.0", "--higgs-sync", "sparse",
                            "--higgs-min-bucket-numel", "0", "--higgs-payload", "wide"],
    }
    for rank_out in run_ranks(train_variants_on_the_compressed_form, world_size, args=(variants,), timeout=400):
        assert rank_out["forced"] > 0, "no bucket took the compressed form"
        _assert_equals_megatron(rank_out)


# The schedule written out (not --use-higgs's derived one): 1% from the first step, int32 positions, fp32 values
SPARSE = ["--use-higgs", "--higgs-compression-ratio", "0.01", "--higgs-min-bucket-numel", "0", "--higgs-sync", "sparse",
          "--higgs-min-param-numel", "256", "--higgs-payload", "wide", "--higgs-dense-iters", "0",
          "--higgs-density-warmup-iters", "0"]


@pytest.mark.oracle
@DISTOPT
@pytest.mark.parametrize("min_param_numel", ["0", "256"], ids=["all-selected", "small-params-whole"])
@pytest.mark.parametrize("world_size,layout", LAYOUTS)
def test_sparse_sync_invariants(world_size, layout, min_param_numel, distopt, tiny_gpt_args):
    argv = _base(tiny_gpt_args, layout, distopt, iters=20) + SPARSE + ["--higgs-min-param-numel", min_param_numel]
    _check_sparse_sync_invariants(argv, world_size, max_byte_ratio=1 / 40)


@pytest.mark.oracle
# Bytes per selected coordinate against the dense fp32 gradient's 4: 8 for wide, 4 for bf16, 3 for
# int8, 2.5 for int4 (16-bit offsets at 1%); at 25% a bitmap (1/8 a coordinate) and int4 (1/2 a
# selected one): 0.25 bytes a coordinate, 1/16 of fp32's.
@pytest.mark.parametrize("payload,max_byte_ratio", [
    (["bf16"], 0.011), (["int8"], 0.0085), (["int4"], 0.0075),
    # under TP, the position embedding (the same on both TP ranks) goes whole, and the bitmap,
    # counted here over the other coordinates, still spans its 4,096: 0.070 in its bucket
    pytest.param(["int4", "--higgs-compression-ratio", "0.25"], 0.071, id="int4-bitmap")])
@pytest.mark.parametrize("world_size,layout,distopt", [
    (2, ["--global-batch-size", "16"], ["--use-distributed-optimizer"]),
    (4, ["--tensor-model-parallel-size", "2", "--global-batch-size", "16"], []),
], ids=["dp2-distopt", "tp2xdp2"])
def test_sparse_sync_invariants_under_each_payload_format(world_size, layout, distopt, payload, max_byte_ratio,
                                                          tiny_gpt_args):
    argv = _base(tiny_gpt_args, layout, distopt, iters=20) + SPARSE + ["--higgs-payload", *payload]
    _check_sparse_sync_invariants(argv, world_size, max_byte_ratio)


def _check_sparse_sync_invariants(argv: list[str], world_size: int, max_byte_ratio: float) -> None:
    from tests.workers.common import sparse_sync_invariants

    outs = run_ranks(sparse_sync_invariants, world_size, args=(argv,), timeout=400)
    # All DP replicas hold bitwise-identical parameters.
    by_model_shard = {}
    for out in outs:
        by_model_shard.setdefault((out["coords"]["tp"], out["coords"]["pp"]), []).append(out["params"])
    for shard, replicas in by_model_shard.items():
        assert len(replicas) == 2
        for name, value in replicas[0].items():
            assert torch.equal(value, replicas[1][name]), f"DP replicas differ at {name} (tp, pp) = {shard}"
    for out in outs:
        # Error feedback conserves: what was sent plus what remains is the accumulated gradient.
        assert out["conservation"] and all(out["conservation"])
        # Compressed buckets hand at most this share of the dense bytes to the collective.
        assert max(out["byte_ratios"]) <= max_byte_ratio, out["byte_ratios"]
        # Compression happens once per bucket per step, not per micro-batch.
        assert out["compressions_per_step"] == out["buckets"]
        # Overlap: in steady state every group but the last launches before backward ends.
        steps = []
        for event in out["trace"]:
            if event[0] == "step":
                steps.append([])
            else:
                steps[-1].append(event[0])
        if out["coords"]["pp"] > 0:
            continue  # Megatron's 1F1B schedule syncs later stages in the pipeline bubble, by design
        assert out["groups"] > 2
        for events in steps[2:]:
            last_backward = max(i for i, e in enumerate(events) if e == "backward_end")
            starts = [i for i, e in enumerate(events) if e == "start"]
            assert len(starts) == out["groups"]
            assert sum(i < last_backward for i in starts) >= out["groups"] - 1, events


@pytest.mark.oracle
def test_nonfinite_gradient_on_one_rank_skips_everywhere(tiny_gpt_args):
    from tests.workers.higgs_ddp import nan_on_one_rank

    argv = tiny_gpt_args + ["--train-iters", "5", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
                            "--use-distributed-optimizer"] + SPARSE
    outs = run_ranks(nan_on_one_rank, 2, args=(argv, 1, 3), timeout=300)
    for out in outs:
        assert [h["ok"] for h in out["history"]] == [True, True, False, True, True]
        skipped = out["history"][2]
        assert skipped["params_unchanged"] and skipped["residuals_unchanged"]
        assert not out["history"][3]["params_unchanged"], "training continues after the skip"
        assert out["skipped"] == 1
    assert all(h["loss"] == h["loss"] for h in outs[-1]["history"] if h["ok"])  # finite after the skip


# The last two: the lean schedules' pieces (int8 payload and a bf16 dense stage; int4 values
# and a bitmap at 25% with an int8 dense stage), a refresh window at the 5th step, just after
# the split.
LEAN = ["--higgs-dense-iters", "2", "--higgs-freeze-adam-variance", "--higgs-variance-refresh-iters", "1"]


@pytest.mark.oracle
@pytest.mark.parametrize("world_size,layout,lean", [
    *[pytest.param(*layout.values, [], id=layout.id) for layout in LAYOUTS[:2]],
    pytest.param(2, ["--global-batch-size", "16", "--use-distributed-optimizer"], [], id="dp2-distopt"),
    pytest.param(2, ["--global-batch-size", "16", "--use-distributed-optimizer"],
                 ["--higgs-payload", "int8", "--higgs-dense-bf16", *LEAN], id="dp2-distopt-lean"),
    pytest.param(2, ["--global-batch-size", "16", "--use-distributed-optimizer"],
                 ["--higgs-payload", "int4", "--higgs-compression-ratio", "0.25", "--higgs-dense-int8", *LEAN],
                 id="dp2-distopt-lean-int4")])
def test_error_feedback_state_survives_state_dict(world_size, layout, lean, tiny_gpt_args):
    from tests.workers.higgs_ddp import resume_continuity

    argv = _base(tiny_gpt_args, layout, [], iters=8) + SPARSE + lean
    for out in run_ranks(resume_continuity, world_size, args=(argv, 4), timeout=400):
        assert out["resumed"] == out["straight"]
        assert out["params_equal"]


STAGED = SPARSE + ["--higgs-dense-iters", "3", "--higgs-freeze-adam-variance"]


@DISTOPT
def test_dense_stage_is_megatron_ddp_then_compression_and_frozen_variance_start(distopt, tiny_gpt_args):
    """``--higgs-dense-iters 3``: the first three steps are Megatron DDP's, bitwise; from the
    fourth the sync compresses and Adam's second moment stays as it was after step 3."""
    from tests.workers.higgs_ddp import staged_sync

    base = _base(tiny_gpt_args, ["--global-batch-size", "16"], distopt, iters=6)
    outs = run_ranks(staged_sync, 2, args=({"megatron": base, "staged": base + STAGED},), timeout=400)
    for out in outs:
        megatron, staged = out["losses"]["megatron"], out["losses"]["staged"]
        assert [staged[i] for i in range(1, 5)] == [megatron[i] for i in range(1, 5)], (staged, megatron)
        assert staged[6] != megatron[6]
        assert out["bytes_sent"][:3] == out["dense_bytes"][:3]
        assert all(sent <= dense / 10 for sent, dense in zip(out["bytes_sent"][3:], out["dense_bytes"][3:])), out
        variance = out["variance_after"]  # after steps 1..6
        assert variance[1] != variance[2] == variance[3] == variance[4] == variance[5]
    for name, value in outs[0]["params"]["staged"].items():
        assert torch.equal(value, outs[1]["params"]["staged"][name]), f"DP replicas differ at {name}"


@DISTOPT
@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_dense_steps_in_bf16_or_int8_and_a_variance_refresh_window(wire, distopt, tiny_gpt_args):
    """``--higgs-dense-bf16``: the dense stage (steps 1-3) hands the collectives half of fp32's
    bytes; ``--higgs-dense-int8``: every coordinate as int8 and a scale per 2,048, a quarter.
    Either trains like Megatron's DDP to its precision (not bitwise: the rounding is real).
    ``--higgs-variance-refresh-iters 1``: step 7 (at twice the dense stage) is dense again and
    moves Adam's second moment, which stays frozen around it. Every DP replica stays bitwise
    equal."""
    from tests.workers.higgs_ddp import staged_sync

    base = _base(tiny_gpt_args, ["--global-batch-size", "16"], distopt, iters=8)
    variants = {"megatron": base, "staged": base + STAGED + [f"--higgs-dense-{wire}", "--higgs-payload", wire,
                                                           "--higgs-variance-refresh-iters", "1"]}
    outs = run_ranks(staged_sync, 2, args=(variants,), timeout=400)
    for out in outs:
        megatron, staged = out["losses"]["megatron"], out["losses"]["staged"]
        assert staged[1] == megatron[1]  # before any update
        assert staged[3] != megatron[3] and abs(staged[3] - megatron[3]) <= 1e-2 * megatron[3], (staged, megatron)
        sent, dense = out["bytes_sent"], out["dense_bytes"]
        dense_steps = [0, 1, 2, 6]
        if wire == "bf16":
            assert all(2 * sent[i] == dense[i] for i in dense_steps), out
        else:  # one byte a coordinate; each bucket's 4-byte scales (one per 2,048) and padding
            assert all(dense[i] / 4 < sent[i] <= dense[i] / 4 * 1.01 for i in dense_steps), (sent, dense)
        assert all(sent[i] <= dense[i] / 20 for i in range(8) if i not in dense_steps), out
        variance = out["variance_after"]  # after steps 1..8
        assert variance[3] == variance[4] == variance[5] != variance[6] == variance[7], variance
        # As it freezes, a second moment still 0 is set to its tensor's mean: int8 rounds some
        # small coordinates to 0 in every dense step, bf16 none.
        assert (variance[2] == variance[3]) == (wire == "bf16"), variance
    for name, value in outs[0]["params"]["staged"].items():
        assert torch.equal(value, outs[1]["params"]["staged"][name]), f"DP replicas differ at {name}"


def lean_forms(train_iters: int) -> dict[str, list[str]]:
    """The lean schedule on each compressed form (all-gathered, agreed blocks, sharded), its
    small buckets compressed too."""
    return {sync: lean_flags(train_iters, sync=sync) + ["--higgs-min-bucket-numel", "0"]
            for sync in ("sparse", "agreed", "sharded")}


def test_the_benchmarks_schedules_converge_near_dense_on_the_corpus(tiny_gpt_args, tmp_path):
    """The short version of ``scripts/bench_convergence.py``: 300 iterations on the default
    corpus, DP=2. Measured here: dense 2.493, 1% top-k with error feedback 2.562 (1.027x;
    2.545 before the frozen update was capped), without error feedback 2.600 (1.043x); the
    same 1% with error feedback but without the dense stage, frozen variance and density
    warm-up, 2.967 (1.19x). The lean schedule scaled to 300 iterations (25%, int4, an int8
    dense stage as long as the warm-up, Adam as it is), all-gathered: 1.016x of dense's loss
    with 0.089x of its wire bytes per rank over the run, counted at the collectives. The
    agreed and sharded forms (measured here at 300: 1.030x with 0.074x, 1.015x with 0.091x)
    are drilled at DP=4 below."""
    base = tiny_gpt_args + ["--train-iters", "300", "--global-batch-size", "8", "--eval-iters", "10",
                            "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--log-interval", "10"]
    # The benchmark's own schedules at 300 iterations (1%: dense 75, frozen, ramp 100; lean: dense 30, ramp 15)
    staged = higgs_flags(0.01, 300) + ["--higgs-min-bucket-numel", "0"]
    variants = {"dense": base, "feedback": base + staged, "no feedback": base + staged + ["--no-higgs-error-feedback"],
                "lean": base + lean_forms(300)["sparse"]}
    variants = {name: flags + ["--log-json", str(tmp_path / f"{name}.jsonl")] for name, flags in variants.items()}
    losses = {name: loss[300] for name, loss in run_ranks(train_variants, 2, args=(variants,),
                                                          timeout=900)[0]["valid_losses"].items()}
    assert losses["feedback"] <= 1.035 * losses["dense"], losses
    assert losses["no feedback"] >= 1.01 * losses["feedback"], losses
    assert losses["lean"] <= 1.03 * losses["dense"], losses
    wire = summarize(tmp_path / "lean.jsonl")["wire over the run vs dense"]
    assert wire <= 0.1, wire


def test_wire_bytes_of_the_lean_schedule_on_each_form_at_dp4(tiny_gpt_args, tmp_path):
    """The lean schedule at DP=4 on each form, 100 iterations (the schedule scaled to them: the
    same share of dense, ramp and compressed steps as at 300): wire bytes per rank over the
    run, counted at the collectives at that DP size, against Megatron's dense reduction at the
    same size. The all-gather's grow with the DP size (three payloads a step at 4 ranks, its
    dense int8 steps capped by the never-more-than-dense rule; 0.089x at DP=2 above), the
    agreed and sharded forms' do not (0.074x and 0.091x at DP=2). Losses are held loosely
    here, within 10% of dense's: the tight figures take 300 iterations (at DP=4 this drill
    measured 1.014x sparse, 1.065x agreed, 1.026x sharded at 300, and 1.014x, 1.077x, 1.044x at
    100; the agreed form's gap is docs/compression.md's)."""
    iters = 100
    base = tiny_gpt_args + ["--train-iters", str(iters), "--global-batch-size", "16", "--eval-iters", "10",
                            "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--log-interval", "10"]
    variants = {"dense": base, **{name: base + flags for name, flags in lean_forms(iters).items()}}
    variants = {name: flags + ["--log-json", str(tmp_path / f"{name}.jsonl")] for name, flags in variants.items()}
    losses = {name: loss[iters] for name, loss in run_ranks(train_variants, 4, args=(variants,),
                                                            timeout=900)[0]["valid_losses"].items()}
    wire = {name: summarize(tmp_path / f"{name}.jsonl")["wire over the run vs dense"] for name in variants}
    print(f"DP=4, {iters} iterations: wire over the run vs dense {wire}; validation losses {losses}")
    assert wire["agreed"] <= 0.08 and wire["sharded"] <= 0.10, wire
    assert wire["sparse"] >= 2 * wire["agreed"] and wire["sparse"] >= 1.5 * wire["sharded"], wire
    assert all(losses[name] <= 1.10 * losses["dense"] for name in lean_forms(iters)), losses


ONEBIT = ["--use-higgs", "--higgs-sync", "onebit", "--higgs-dense-iters", "45", "--higgs-min-bucket-numel", "0"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_holds_dense_loss_at_a_fraction_of_its_wire(world_size, tiny_gpt_args, tmp_path):
    """1-bit Adam's exchange, 300 iterations, 4 samples a rank: an int8 dense stage of 45 (15%),
    then signs, the second moment thawed for 11 iterations at 90 and 180 (derived); with the
    distributed optimizer too (the parameter all-gather as int4 changes).
    Wire bytes per rank over the run, counted at every collective of the DP group (the
    parameter all-gather included), against Megatron's dense run at the same size and layout;
    the tiny model's small parameters (sent whole, in fp32) are 1.4% of its wire a compressed
    step, where the default model's are 0.3%."""
    base = tiny_gpt_args + ["--train-iters", "300", "--global-batch-size", str(4 * world_size), "--eval-iters", "10",
                            "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--log-interval", "10"]
    distopt = ["--use-distributed-optimizer"]
    variants = {"dense": base, "onebit": base + ONEBIT, "dense-distopt": base + distopt,
                "onebit-distopt": base + distopt + ONEBIT}
    variants = {name: flags + ["--log-json", str(tmp_path / f"{name}.jsonl")] for name, flags in variants.items()}
    losses = {name: loss[300] for name, loss in run_ranks(train_variants, world_size, args=(variants,),
                                                          timeout=1200)[0]["valid_losses"].items()}
    measured = {}
    for layout in ("", "-distopt"):
        runs = {name: summarize(tmp_path / f"{name}{layout}.jsonl")["wire bytes over the run"]
                for name in ("dense", "onebit")}
        measured[layout] = (losses[f"onebit{layout}"] / losses[f"dense{layout}"], runs["onebit"] / runs["dense"])
        print(f"DP={world_size}{layout}, 300 iterations: onebit {measured[layout][0]:.4f}x of dense's loss with "
              f"{measured[layout][1]:.4f}x of its wire")
    # a short run: the dense stage (45) and the refresh windows (11 at 90 and 180) are a quarter of it
    for layout, bound in (("", 0.105), ("-distopt", 0.15)):
        assert measured[layout][0] <= 1.02 and measured[layout][1] <= bound, (layout, measured)


@pytest.mark.oracle
def test_two_optimizer_instances_dense_equals_megatron_and_compressed_keeps_replicas_equal(tiny_gpt_args):
    """Megatron's hierarchical DP (--num-distributed-optimizer-instances 2 over DP=4): reduce-
    scatter inside each instance of two ranks, all-reduce of the shard across the instances.
    Compressor none equals Megatron's DDP with the same instances bitwise, density 1.0 to 1e-6;
    at 1% (compressed across the instances only) all four DP replicas stay bitwise equal."""
    base = (tiny_gpt_args + ["--global-batch-size", "16", "--use-distributed-optimizer",
                             "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
                             "--ddp-bucket-size", "20000"])
    variants = {
        "megatron": base + ["--train-iters", "5"],
        "none": base + ["--train-iters", "5", "--use-higgs", "--higgs-compressor", "none"],
        "topk-1.0": base + ["--train-iters", "5", "--use-higgs", "--higgs-compression-ratio", "1.0",
                            "--higgs-min-bucket-numel", "0", "--higgs-payload", "wide"],
        "topk-0.01": base + ["--train-iters", "20"] + SPARSE,
        "megatron-20": base + ["--train-iters", "20"],
    }
    outs = run_ranks(train_variants, 4, args=(variants,), timeout=400)
    for rank_out in outs:
        _assert_equals_megatron(rank_out)
    replicas = [out["params"]["topk-0.01"] for out in outs]
    for name, value in replicas[0].items():
        assert all(torch.equal(value, other[name]) for other in replicas[1:]), f"DP replicas differ at {name}"
    losses = outs[-1]["losses"]["topk-0.01"]
    assert losses[20] < losses[1] and losses[20] != outs[-1]["losses"]["megatron-20"][20]  # it compressed


def test_one_rank_per_optimizer_instance_under_auto(tiny_gpt_args, tmp_path):
    """DP=2 as two instances of one rank: the instance's collectives move nothing, and 'auto',
    told a slow link, compresses across the instances (replicas equal; the bytes handed to
    collectives at most 1/20 of dense's)."""
    import json

    base = tiny_gpt_args + ["--global-batch-size", "8", "--use-distributed-optimizer", "--train-iters", "8",
                            "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce"]
    variants = {"megatron": base, "none": base + ["--use-higgs", "--higgs-compressor", "none"],
                "auto-slow": base + ["--use-higgs", "--higgs-compression-ratio", "0.01", "--higgs-link-gbps", "0.1",
                                     "--higgs-min-bucket-numel", "0", "--log-interval", "8",
                                     "--log-json", str(tmp_path / "auto.jsonl")]}
    outs = run_ranks(train_variants, 2, args=(variants,), timeout=400)
    for name, value in outs[0]["params"]["none"].items():
        assert torch.equal(value, outs[0]["params"]["megatron"][name]), name
    for name, value in outs[0]["params"]["auto-slow"].items():
        assert torch.equal(value, outs[1]["params"]["auto-slow"][name]), f"DP replicas differ at {name}"
    last = [r for r in map(json.loads, open(tmp_path / "auto.jsonl")) if r["type"] == "iteration"][-1]
    assert last["bytes_sent"] <= last["dense_bytes"] / 20, last
