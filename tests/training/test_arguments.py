"""Bad input: one clear message naming the flag, exit status 2, before any process group."""

import pytest

from higgs_megatron.runtime.exits import UsageError
from higgs_megatron.training.arguments import parse_args


def test_defaults_fill_derived_fields():
    args = parse_args(["--micro-batch-size", "2", "--global-batch-size", "16",
                       "--tensor-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2 and args.num_microbatches == 4
    assert args.distributed_backend == "gloo" and args.transformer_impl == "local"
    assert args.max_position_embeddings == args.seq_length
    assert args.lr_decay_iters == args.train_iters and args.lr_warmup_iters == args.train_iters // 10


def test_a_moe_layout_derives_the_expert_data_parallel_size():
    args = parse_args(["--num-experts", "4", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2",
                       "--disable-bias-linear"], world_size=8)
    assert (args.data_parallel_size, args.expert_data_parallel_size) == (8, 2)
    assert parse_args([], world_size=4).expert_data_parallel_size == 4  # no experts: the DP size


@pytest.mark.parametrize("argv,world_size,message", [
    (["--tensor-model-parallel-size", "3"], 4,
     "world size 4 is not divisible by --tensor-model-parallel-size 3 x --pipeline-model-parallel-size 1"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     "world size 2 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 = 4"),
    (["--num-attention-heads", "3", "--hidden-size", "96", "--tensor-model-parallel-size", "2"], 2,
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 2,
     "--global-batch-size 6 is not divisible by --micro-batch-size 4 x data-parallel size 2 = 8"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--data-path", "/nonexistent/corpus"], 1, "--data-path /nonexistent/corpus: no such file or directory"),
    (["--distributed-backend", "mpi"], 1, "argument --distributed-backend: invalid choice: 'mpi'"),
    (["--distributed-backend", "nccl"], 1, "--distributed-backend nccl needs CUDA"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size must be positive, got 0"),
    (["--seq-length", "256", "--max-position-embeddings", "128"], 1,
     "--seq-length 256 exceeds --max-position-embeddings 128"),
    (["--split", "100,0,0"], 1, "--split '100,0,0': expected three weights"),
    (["--async-checkpoint"], 1, "--async-checkpoint: needs --save DIR"),
    (["--optimizer", "sgd", "--use-distributed-optimizer"], 1,
     "--optimizer sgd: megatron-core's --use-distributed-optimizer supports adam only"),
    (["--checkpoint-interval", "60"], 1, "--checkpoint-interval: needs --save DIR"),
    (["--save", "/tmp/x", "--checkpoint-interval", "0"], 1, "--checkpoint-interval 0.0: expected a positive number of seconds"),
    (["--higgs-length-buckets", "32,256"], 1, "--higgs-length-buckets '32,256': every length must be in [1, --seq-length 128]"),
    (["--higgs-length-buckets", "64,32"], 1, "--higgs-length-buckets '64,32': lengths must be strictly increasing"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size: only with --num-experts"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], 2,
     "world size 2 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2,
     "--num-experts with --tensor-model-parallel-size > 1: megatron-core's MoE layer trains only with sequence"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"], 2,
     "--expert-tensor-parallel-size 2 needs --disable-bias-linear"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5: expected 1 to --num-experts 4"),
    (["--num-experts", "4", "--moe-router-enable-expert-bias"], 1,
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--num-experts", "4", "--use-higgs", "--use-distributed-optimizer", "--num-distributed-optimizer-instances",
      "2"], 2, "--use-higgs with --num-experts and --num-distributed-optimizer-instances > 1"),
    # elastic replicas: one torchrun per replica, what they cannot do refused before any group exists
    (["--higgs-replicas", "2", "--higgs-replica-id", "0", "--higgs-lighthouse", "http://h:1"], 1,
     "--higgs-replicas: needs --use-higgs"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "2", "--higgs-lighthouse", "http://h:1"], 1,
     "--higgs-replica-id: expected 0 to 1 with --higgs-replicas 2, got 2"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0"], 1,
     "--higgs-replicas needs the torchft Lighthouse's address"),
    (["--use-higgs", "--higgs-replica-id", "0"], 1, "--higgs-replica-id: only with --higgs-replicas"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0", "--higgs-lighthouse", "http://h:1"], 2,
     "--higgs-replicas 2: each replica is one torchrun of --tensor-model-parallel-size 1 x "
     "--pipeline-model-parallel-size 1 = 1 rank(s) (data-parallel size 1 inside); this launch has 2"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0", "--higgs-lighthouse", "http://h:1",
      "--use-distributed-optimizer", "--higgs-sync", "sharded"], 1,
     "--higgs-replicas with --use-distributed-optimizer, --higgs-sync sharded: not built for elastic replicas"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0", "--higgs-lighthouse", "http://h:1",
      "--inject-fault", "kill-replica@2:3"], 1, "replica 2 does not exist with data-parallel size 2"),
    (["--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0", "--higgs-lighthouse", "http://h:1",
      "--higgs-min-replicas", "3"], 1, "--higgs-min-replicas: expected 1 to --higgs-replicas 2, got 3"),
])
def test_bad_input_is_named(argv, world_size, message):
    with pytest.raises(UsageError) as info:
        parse_args(argv, world_size=world_size)
    assert message in info.value.message
    assert info.value.code == 2


@pytest.mark.parametrize("argv,message", [
    (["--use-higgs", "--higgs-compression-ratio", "1.5"], "--higgs-compression-ratio: compression_ratio must be in (0, 1], got 1.5"),
    (["--use-higgs", "--higgs-compression-ratio", "0"], "--higgs-compression-ratio: compression_ratio must be in (0, 1], got 0.0"),
    (["--use-higgs", "--higgs-compressor", "powersgd"], "argument --higgs-compressor: invalid choice: 'powersgd'"),
    (["--use-higgs", "--higgs-density-warmup-iters", "-1"], "--higgs-density-warmup-iters: density_warmup_iters must be 0 or more"),
    (["--use-higgs", "--higgs-dense-iters", "-1"], "--higgs-dense-iters: dense_iters must be 0 or more"),
    (["--use-higgs", "--higgs-dense-iters", "0", "--higgs-freeze-adam-variance"],
     "--higgs-freeze-adam-variance: freeze_adam_variance needs dense_iters > 0"),
    (["--use-higgs", "--higgs-dense-iters", "5", "--higgs-freeze-adam-variance", "--optimizer", "sgd"],
     "--higgs-freeze-adam-variance: needs --optimizer adam (it freezes Adam's second moment)"),
    (["--use-higgs", "--higgs-payload", "wide", "--higgs-dense-int8"], "--higgs-dense-int8: dense_int8 sends dense steps as a payload with every "
     "coordinate, which the blocked payloads have: it needs payload bf16, int8 or int4 (got 'wide') and not dense_bf16"),
    (["--use-higgs", "--higgs-sum-density-factor", "0.5"],
     "--higgs-sum-density-factor: sum_density_factor must be a finite number, 1 or more, got 0.5"),
    (["--use-higgs", "--higgs-link-gbps", "0"], "--higgs-link-gbps: link_gbps must be a positive number of Gbit/s, got 0.0"),
    (["--use-higgs", "--higgs-link-gbps", "nan"], "--higgs-link-gbps: link_gbps must be a positive number of Gbit/s, got nan"),
    (["--use-higgs", "--higgs-node-link-gbps", "100"], "--higgs-node-link-gbps: node_link_gbps needs link_gbps"),
    (["--use-higgs", "--higgs-sync", "sparse", "--higgs-link-gbps", "1"], "--higgs-link-gbps: link_gbps is what sync='auto' plans with; sync is 'sparse'"),
    (["--check-weight-hash-across-dp-replicas-interval", "0"], "--check-weight-hash-across-dp-replicas-interval must be positive"),
    (["--higgs-compression-ratio", "0.05", "--no-higgs-error-feedback"],
     "--higgs-compression-ratio, --no-higgs-error-feedback: only with --use-higgs"),
    (["--higgs-dense-iters", "5", "--higgs-freeze-adam-variance"],
     "--higgs-dense-iters, --higgs-freeze-adam-variance: only with --use-higgs"),
])
def test_bad_higgs_flags_are_named(argv, message):
    with pytest.raises(UsageError) as info:
        parse_args(argv, world_size=2)
    assert message in info.value.message


def test_flags_that_need_no_compressed_sync_are_accepted_without_use_higgs():
    args = parse_args(["--check-weight-hash-across-dp-replicas-interval", "5", "--higgs-compressor", "topk"],
                      world_size=2)  # a flag at its default is not "given"
    assert args.run_config.compression is None and args.check_weight_hash_across_dp_replicas_interval == 5


def test_wandb_project_without_wandb_is_named(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UsageError) as info:
        parse_args(["--wandb-project", "higgs"], world_size=1)
    assert "--wandb-project needs the wandb package" in info.value.message


def test_tensorboard_dir_without_tensorboard_is_named(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails as if not installed
    with pytest.raises(UsageError) as info:
        parse_args(["--tensorboard-dir", str(tmp_path)], world_size=1)
    assert "--tensorboard-dir needs the tensorboard package" in info.value.message


def test_flags_given_reads_the_parser_not_a_list():
    """What counts as given: a value unlike the parser's own for no flags."""
    import argparse

    from higgs_megatron.given_flags import flags_given

    parser = argparse.ArgumentParser()
    parser.add_argument("--ratio", type=float, default="0.5")  # converted default: 0.5, not "0.5"
    parser.add_argument("--no-x", dest="x", action="store_false")
    parser.add_argument("--limit", type=float, default=float("nan"))
    assert flags_given(parser.parse_args([]), parser) == []
    assert flags_given(parser.parse_args(["--ratio", "0.5"]), parser) == []  # a default, as if not given
    assert flags_given(parser.parse_args(["--no-x", "--ratio", "0.7", "--limit", "1"]), parser) == [
        "--ratio", "--no-x", "--limit"]
    assert flags_given(parser.parse_args(["--no-x"]), parser, skip=("x",)) == []


def test_use_higgs_alone_derives_its_schedule_from_the_run():
    """``--use-higgs`` alone: 1-bit Adam's exchange after a dense int8 stage as long as the
    learning-rate warm-up (with the distributed optimizer, the parameters' changes in int4).
    Where the run rules it out, or a top-k setting is given: a quarter of the coordinates in
    int4, the same dense stage, a ramp over a twentieth of the run; a schedule flag given
    overrides its value alone (an explicit 0 included)."""
    def config(*flags):
        return parse_args(["--train-iters", "300", "--use-higgs", *flags], world_size=2).run_config.compression

    alone = config()
    assert (alone.sync, alone.compression_ratio, alone.payload, alone.dense_iters, alone.density_warmup_iters,
            alone.dense_int8, alone.param_payload) == ("onebit", 1.0, "sign", 30, 0, True, "int4")
    assert config("--use-distributed-optimizer").sync == "onebit"
    for ruling_out in (["--optimizer", "sgd"], ["--higgs-compression-ratio", "0.25"], ["--higgs-payload", "int4"],
                       ["--lr-warmup-iters", "0"], ["--higgs-offload"], ["--no-higgs-error-feedback"],
                       ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]):
        topk = config(*ruling_out)
        assert topk.sync == "auto" and topk.param_payload == "dense", ruling_out
    replicas = parse_args(["--train-iters", "300", "--use-higgs", "--higgs-replicas", "2", "--higgs-replica-id", "0",
                           "--higgs-lighthouse", "http://h:1"], world_size=1).run_config.compression
    assert replicas.sync == "sparse"  # across a changing quorum: each rank's own top-k
    topk = config("--higgs-sync", "auto")
    assert (topk.compression_ratio, topk.payload, topk.dense_iters, topk.density_warmup_iters,
            topk.dense_int8) == (0.25, "int4", 30, 15, True)
    assert config("--lr-warmup-iters", "50").dense_iters == 50
    overridden = config("--higgs-dense-iters", "0", "--higgs-compression-ratio", "0.1")
    assert (overridden.dense_iters, overridden.compression_ratio, overridden.payload) == (0, 0.1, "int4")
    assert not config("--no-higgs-dense-int8").dense_int8
    assert not config("--higgs-dense-bf16").dense_int8 and config("--higgs-dense-bf16").dense_bf16
    assert not config("--higgs-payload", "wide").dense_int8
    assert not config("--higgs-compressor", "none").dense_int8


def test_a_megatron_lm_runs_length_counts_as_its_scheduler_does():
    import argparse

    from patches.megatron_lm.arguments import run_length

    def length(**given):
        base = dict(train_iters=None, train_samples=None, global_batch_size=8, lr_decay_iters=None,
                    lr_decay_samples=None, lr_warmup_fraction=None, lr_warmup_iters=0, lr_warmup_samples=0)
        return run_length(argparse.Namespace(**{**base, **given}))

    assert length(train_iters=1000, lr_warmup_iters=100) == (1000, 100)
    assert length(train_iters=1000, lr_warmup_fraction=0.05) == (1000, 50)
    assert length(train_iters=1000, lr_decay_iters=800, lr_warmup_fraction=0.1) == (1000, 80)
    assert length(train_samples=8000, lr_warmup_samples=800) == (1000, 100)


def test_a_loop_of_ones_own_gets_the_same_derived_schedule():
    """``HiggsConfig.for_run``: the schedule ``--use-higgs`` derives, for the Python API."""
    from higgs_megatron.config import HiggsConfig

    from_flags = parse_args(["--train-iters", "300", "--use-higgs", "--higgs-sync", "sparse"], world_size=2).run_config.compression
    assert HiggsConfig.for_run(300, 30, sync="sparse") == from_flags
    assert HiggsConfig.for_run(300, 30, payload="wide").dense_int8 is False


def test_a_megatron_lm_run_without_its_global_batch_yet_counts_one_micro_batch_per_replica():
    """Our flags are checked before Megatron-LM fills --global-batch-size: its default then, a
    micro-batch per data-parallel rank, is what samples are counted in."""
    import argparse

    from patches.megatron_lm.arguments import run_length

    args = argparse.Namespace(train_iters=None, train_samples=16000, global_batch_size=None, micro_batch_size=4,
                              world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              context_parallel_size=1, lr_decay_iters=None, lr_decay_samples=None,
                              lr_warmup_fraction=None, lr_warmup_iters=0, lr_warmup_samples=1600)
    assert run_length(args) == (1000, 100)


def test_use_higgs_says_why_it_takes_the_top_k_forms(caplog):
    """The fallback from 1-bit Adam is one log line naming the reason, never silent."""
    import logging

    with caplog.at_level(logging.INFO):
        parse_args(["--train-iters", "300", "--use-higgs", "--optimizer", "sgd"], world_size=2)
        parse_args(["--train-iters", "300", "--use-higgs"], world_size=2)
    said = [record.getMessage() for record in caplog.records if "instead of 1-bit Adam" in record.getMessage()]
    assert len(said) == 1 and "--optimizer adam" in said[0], said
