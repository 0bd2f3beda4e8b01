"""The Megatron-LM patch layer's own logic, without a Megatron-LM checkout: flag chaining,
flag checks and their mapping onto Megatron-LM's flags, the checkout version check, and
the launcher's refusals. (Runs of a real checkout: tests/megatron_lm/drill_megatron_lm.py.)"""

import argparse
import sys
import types

import pytest

from higgs_megatron.runtime.exits import ExitStatus, UsageError
from higgs_megatron_bench.ranks import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "patches"))

from megatron_lm.arguments import add_patch_args, chain_args_providers, translate_args  # noqa: E402
from megatron_lm.checkout import CheckoutError, check_checkout, checkout_version  # noqa: E402


def megatron_like_parser() -> argparse.ArgumentParser:
    """The Megatron-LM flags translate_args reads, with Megatron-LM's names and defaults."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--ckpt-format", default="torch_dist")
    parser.add_argument("--ckpt-step", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--use-persistent-ckpt-worker", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true")
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--use-megatron-fsdp", action="store_true")
    parser.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None)
    parser.add_argument("--non-persistent-save-interval", type=int, default=None)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--optimizer-cpu-offload", action="store_true")
    parser.add_argument("--log-params-norm", action="store_true")
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true")
    parser.add_argument("--ddp-param-name-patterns-for-fp32-local-accumulation", nargs="+", default=[])
    parser.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                        dest="check_for_nan_in_loss_and_grad")
    parser.add_argument("--async-strategy", default="nvrx")  # 0.19's default (a config field there)
    parser.add_argument("--inprocess-restart", action="store_true")
    parser.add_argument("--enable-ft-package", action="store_true")
    parser.add_argument("--optimizer-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none")
    parser.add_argument("--fp8-format", dest="fp8", default=None)
    parser.add_argument("--fp8-param-gather", action="store_true")
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return chain_args_providers(None)(megatron_like_parser()).parse_args(list(argv))


def test_chaining_runs_the_scripts_provider_first_and_keeps_its_flags():
    calls = []

    def modelopt_like(parser):
        calls.append(parser)
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    provider = chain_args_providers(modelopt_like)
    parser = provider(megatron_like_parser())
    args = parser.parse_args(["--export-te-mcore-model", "--use-higgs", "--higgs-compression-ratio", "0.05",
                              "--check-weight-hash-across-dp-replicas-interval", "7"])
    assert len(calls) == 1 and provider.chained is modelopt_like
    assert args.export_te_mcore_model and args.use_higgs and args.higgs_compression_ratio == 0.05
    assert args.check_weight_hash_across_dp_replicas_interval == 7  # Megatron-LM's own flag, not redefined
    assert add_patch_args(parser) is parser  # a second time adds nothing (and does not raise on duplicates)


def test_a_provider_that_returns_nothing_is_tolerated():
    args = chain_args_providers(lambda parser: None)(megatron_like_parser()).parse_args(["--use-higgs"])
    assert args.use_higgs


def test_without_use_higgs_nothing_changes_and_our_other_flags_are_refused():
    args = parse("--save", "/ckpt")
    before = vars(args).copy()
    assert translate_args(args) is None and vars(args) == before
    for flags, named in ((["--recovery-mode", "reshard"], "--recovery-mode"),
                         (["--checkpoint-version", "3", "--load", "/x"], "--checkpoint-version"),
                         (["--async-checkpoint", "--save", "/x"], "--async-checkpoint"),
                         (["--checkpoint-interval", "60", "--save", "/x"], "--checkpoint-interval"),
                         (["--higgs-compression-ratio", "0.1"], "--higgs-compression-ratio"),
                         (["--no-higgs-error-feedback"], "--no-higgs-error-feedback"),
                         (["--higgs-sync", "sparse"], "--higgs-sync"),
                         (["--higgs-offload"], "--higgs-offload"),
                         (["--higgs-step-timeout", "5"], "--higgs-step-timeout"),
                         (["--inject-fault", "hang@1:2:3"], "--inject-fault"),
                         (["--auto-resume", "--save", "/x"], "--auto-resume")):
        with pytest.raises(UsageError, match=f"{named}.*only with --use-higgs"):
            translate_args(parse(*flags))


@pytest.mark.parametrize("flags, message", [
    (["--higgs-compression-ratio", "0"], r"--higgs-compression-ratio: .*\(0, 1\]"),
    (["--higgs-compression-ratio", "1.5"], r"--higgs-compression-ratio"),
    (["--higgs-link-gbps", "10", "--higgs-sync", "sparse"], r"--higgs-link-gbps"),
    (["--save", "/x", "--ckpt-format", "torch"], r"--ckpt-format torch: .*use --ckpt-format torch_dist"),
    (["--use-torch-fsdp2"], r"--use-torch-fsdp2"),
    (["--checkpoint-version", "3"], r"--checkpoint-version: needs --load"),
    (["--checkpoint-version", "0", "--load", "/x"], r"--checkpoint-version 0: expected an iteration, 1 or more"),
    (["--ckpt-step", "0", "--load", "/x"], r"--ckpt-step 0: expected an iteration, 1 or more"),
    (["--non-persistent-save-interval", "5"], r"--non-persistent-save-interval: .*not with --use-higgs"),
    (["--optimizer", "muon"], r"--optimizer muon: .*use adam or sgd"),
    (["--optimizer", "lion"], r"--optimizer lion: .*use adam or sgd"),  # 0.19's
    (["--ddp-reduce-scatter-with-fp32-accumulation"], r"--ddp-reduce-scatter-with-fp32-accumulation: .*not with"),
    (["--ddp-param-name-patterns-for-fp32-local-accumulation", "*.weight"],
     r"--ddp-param-name-patterns-for-fp32-local-accumulation: .*not with --use-higgs"),
    (["--higgs-dense-iters", "2", "--higgs-freeze-adam-variance", "--optimizer", "sgd"],
     r"--higgs-freeze-adam-variance: needs --optimizer adam"),  # the rules table, as in our script
    (["--checkpoint-version", "3", "--load", "/x", "--ckpt-step", "4"], r"disagree"),
    (["--checkpoint-interval", "0", "--save", "/x"], r"--checkpoint-interval 0.0: expected a positive"),
    (["--checkpoint-interval", "nan", "--save", "/x"], r"--checkpoint-interval nan"),
    (["--checkpoint-interval", "30"], r"--checkpoint-interval: needs --save"),
    (["--async-checkpoint"], r"--async-checkpoint: needs --save"),
    (["--higgs-offload-threshold", "0.7"], r"--higgs-offload-threshold: only with --higgs-offload"),
    (["--higgs-offload", "--higgs-offload-threshold", "1.5"], r"--higgs-offload-threshold 1.5: expected a fraction"),
    (["--higgs-offload", "--higgs-offload-device", "nvme"], r"needs --higgs-offload-dir"),
    (["--higgs-offload", "--optimizer-cpu-offload"], r"--higgs-offload and --optimizer-cpu-offload"),
    (["--higgs-offload", "--log-params-norm"], r"--log-params-norm with --higgs-offload"),
    (["--auto-resume"], r"--auto-resume: needs --save"),
    (["--higgs-step-timeout", "0"], r"--higgs-step-timeout must be positive, got 0.0"),
    (["--higgs-restart-timeout", "60"], r"--higgs-restart-timeout: needs --higgs-step-timeout"),
    (["--higgs-step-timeout", "10", "--higgs-restart-timeout", "5"], r"--higgs-restart-timeout 5 must be longer"),
    (["--inject-fault", "hang@1"], r"--inject-fault 'hang@1': expected KIND@RANK:ITER\[:SECONDS\]"),
    (["--inject-fault", "nan@0:2"], r"--inject-fault nan: .*add --no-check-for-nan-in-loss-and-grad"),
    (["--higgs-step-timeout", "5", "--calculate-per-token-loss"], r"--higgs-step-timeout with --calculate-per-token"),
    (["--inprocess-restart"], r"--inprocess-restart: NVRx's in-process restart .*: not with --use-higgs"),
    (["--enable-ft-package"], r"--enable-ft-package: NVRx's fault tolerance"),
    (["--optimizer-cuda-graph"], r"--optimizer-cuda-graph: it replaces optimizer.step"),
    (["--cuda-graph-impl", "local"], r"--cuda-graph-impl local: CUDA graphs are not tested"),
    (["--fp8-format", "hybrid"], r"--fp8-format: FP8 training"),
    (["--fp8-param-gather"], r"--fp8-param-gather: FP8 parameter buffers"),
    (["--num-experts", "4", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     r"--num-experts with --num-distributed-optimizer-instances > 1: the compressed sync of expert gradients"),
    (["--context-parallel-size", "2"], r"--context-parallel-size 2: Megatron's context parallel needs Transformer "
                                       r"Engine's attention"),
])
def test_bad_flags_are_named_and_args_are_left_untouched(flags, message):
    args = parse("--use-higgs", *flags)
    before = vars(args).copy()
    with pytest.raises(UsageError, match=message):
        translate_args(args)
    assert vars(args) == before


def test_our_flags_map_onto_megatron_lms():
    args = parse("--use-higgs", "--higgs-compression-ratio", "0.02", "--save", "/s", "--load", "/s",
                 "--checkpoint-version", "30", "--async-checkpoint", "--use-distributed-optimizer")
    config = translate_args(args)
    assert config.compression.compression_ratio == 0.02
    assert config.checkpoint.checkpoint_version == 30 and config.checkpoint.async_checkpoint
    assert args.ckpt_step == 30
    assert args.async_save and args.use_persistent_ckpt_worker
    assert args.async_strategy == "mcore"  # megatron-core's writer, whose requests the rank map's commit follows
    assert args.dist_ckpt_optim_fully_reshardable  # so that --recovery-mode reshard can load it later
    assert args.recovery_mode == "same-sharding"
    assert not hasattr(args, "higgs_config")  # Megatron-LM pickles args into checkpoints


def test_auto_resume_loads_from_save_and_stability_flags_stay_plain_values():
    args = parse("--use-higgs", "--save", "/s", "--auto-resume", "--higgs-step-timeout", "5",
                 "--inject-fault", "nan@0:2", "--no-check-for-nan-in-loss-and-grad")
    config = translate_args(args)
    assert args.load == "/s" and config.checkpoint.load == "/s"
    assert [str(fault) for fault in config.stability.faults] == ["nan@0:2"]
    assert args.inject_fault == ["nan@0:2"] and not hasattr(args, "faults")  # weights-only loads of args


def test_megatron_lms_ckpt_step_is_validated_as_checkpoint_version():
    args = parse("--use-higgs", "--load", "/s", "--ckpt-step", "7")
    config = translate_args(args)
    assert args.checkpoint_version == 7 and args.ckpt_step == 7
    assert config.checkpoint.checkpoint_version == 7  # what the rank map's load chooses by


def test_dense_sync_keeps_megatron_lms_optimizer_format():
    args = parse("--use-higgs", "--save", "/s")
    translate_args(args)
    assert not args.dist_ckpt_optim_fully_reshardable and not args.async_save and args.ckpt_step is None


def _installed(monkeypatch, version: str) -> None:
    """The megatron-core the checkout check reads as installed (either supported release is installed in CI)."""
    import megatron_lm.checkout as checkout

    monkeypatch.setattr(checkout, "metadata", types.SimpleNamespace(version=lambda name: version))


def test_checkout_version_check(tmp_path, write_checkout, monkeypatch):
    _installed(monkeypatch, "0.16.1")
    good = write_checkout(tmp_path / "good")
    assert checkout_version(good) == "0.16.1" and check_checkout(good) == good.resolve()
    old = write_checkout(tmp_path / "old", (0, 15, 0))
    with pytest.raises(CheckoutError, match=r"version 0.15.0; with megatron-core 0.16.1 these patches are tested with "
                                            r"a checkout at core_v0.16.1. Check out core_v0.16.1, or pass "
                                            r"--higgs-allow-untested-megatron-lm"):
        check_checkout(old)
    with pytest.warns(UserWarning, match="running anyway"):
        assert check_checkout(old, allow_untested=True) == old.resolve()
    with pytest.raises(CheckoutError, match="no such directory"):
        check_checkout(tmp_path / "absent")
    with pytest.raises(CheckoutError, match="pretrain_gpt.py is missing"):
        check_checkout(tmp_path)
    with pytest.raises(CheckoutError, match=r"no Megatron-LM checkout given: .*MEGATRON_LM_PATH .*tag core_v0.16.1; "
                                            r"megatron-core 0.16.1 does not ship Megatron-LM's training code"):
        check_checkout(None)


def test_on_megatron_core_0_19_the_wheels_training_code_runs_and_a_checkout_must_match_it(tmp_path, write_checkout,
                                                                                          monkeypatch):
    _installed(monkeypatch, "0.19.2")
    assert check_checkout(None) is None  # the wheel's megatron.training, through gpt_entry
    matching = write_checkout(tmp_path / "v19", (0, 19, 0))
    assert check_checkout(matching) == matching.resolve()  # its pretrain_gpt.py on the wheel's training code
    with pytest.raises(CheckoutError, match=r"is version 0.16.1; with megatron-core 0.19.2 these patches are tested "
                                            r"with a checkout at core_v0.19.0"):
        check_checkout(write_checkout(tmp_path / "v16"))


def test_an_untested_megatron_core_is_refused_naming_the_tested_ones(tmp_path, write_checkout, monkeypatch):
    _installed(monkeypatch, "0.20.0")
    with pytest.raises(CheckoutError, match=r"the installed megatron-core is 0.20.0; the Megatron-LM patches are "
                                            r"tested with megatron-core 0.16 \(tag core_v0.16.1\) and 0.19 "
                                            r"\(tag core_v0.19.0\)"):
        check_checkout(None)
    with pytest.warns(UserWarning, match="running anyway"):
        assert check_checkout(None, allow_untested=True) is None  # 0.20 ships megatron.training


def test_a_usage_error_is_said_once_wherever_it_is_caught(caplog):
    from higgs_megatron.logs import setup_logging
    from higgs_megatron.runtime.exits import exit_status, report_usage_error

    error = UsageError("--foo: expected bar")
    assert isinstance(error, SystemExit) and error.code == ExitStatus.USAGE and str(error) == "--foo: expected bar"

    def raise_reported():
        report_usage_error(error)  # as the patches do inside Megatron-LM's parse_args
        raise error

    package = setup_logging()  # its own handlers, not propagated: caplog listens on it directly
    package.addHandler(caplog.handler)
    try:
        assert exit_status(raise_reported, prog="test") == ExitStatus.USAGE
    finally:
        package.removeHandler(caplog.handler)
    assert [record.getMessage() for record in caplog.records].count("--foo: expected bar") == 1
    with pytest.raises(RuntimeError, match="not ours"):  # anything else keeps its traceback
        exit_status(lambda: (_ for _ in ()).throw(RuntimeError("not ours")), prog="test")


@pytest.mark.skipif(not __import__("megatron_lm.checkout").checkout.wheel_ships_training(),
                    reason="gpt_entry runs on a megatron-core that ships megatron.training (0.19)")
def test_gpt_entry_names_what_only_megatron_lms_own_script_does():
    from megatron_lm.gpt_entry import script_only_flags

    args = argparse.Namespace(sft=False, fim_data=True, logits_load_dir="/logits", hybrid_context_parallel=False)
    assert script_only_flags(args) == ["--fim-data", "--logits-load-dir"]
    assert script_only_flags(argparse.Namespace(sft=False)) == []


def test_a_help_string_with_a_bare_percent_no_longer_breaks_help():
    """Megatron-LM 0.19.2's own --help raises on "(e.g. 1.10 = 10%)"; the chained provider escapes it."""
    parser = megatron_like_parser()
    parser.add_argument("--factor", type=float, help="headroom (e.g. 1.10 = 10%).")
    parser.add_argument("--ratio", type=float, default=0.5, help="share (default: %(default)s)")
    text = chain_args_providers(None)(parser).format_help()
    assert "10%)." in text and "default: 0.5" in text
