"""The typed run config: an error names its field and flag, and both front-ends take the
same flags, defaults and rules from it; a preset is a config."""

import pytest

from higgs_megatron.field_flags import config_flags
from higgs_megatron.training.arguments import parse_args
from higgs_megatron_bench.runs import higgs_config, lean_config


def test_a_config_error_names_its_field_and_crosses_processes():
    import pickle

    from higgs_megatron.config import ConfigError, HiggsConfig

    with pytest.raises(ConfigError) as caught:
        HiggsConfig(dense_iters=-1)
    assert caught.value.field == "dense_iters"
    copy = pickle.loads(pickle.dumps(caught.value))
    assert copy.field == "dense_iters" and str(copy) == str(caught.value)


def test_both_front_ends_take_their_config_flags_and_defaults_from_the_dataclasses():
    """Each flagged field of HiggsConfig, OffloadConfig, CheckpointConfig and StabilityConfig is a
    flag of our pretrain script and of the Megatron-LM patches, with the field's default, and reads
    back into the same config; a bad value is refused naming its flag."""
    import argparse
    from dataclasses import fields

    from higgs_megatron.checkpoint.flags import CheckpointConfig, checkpoint_config_from_args
    from higgs_megatron.config import HiggsConfig, higgs_config_from_args
    from higgs_megatron.stability.flags import StabilityConfig
    from higgs_megatron.field_flags import field_flag, field_values, flag_dest
    from higgs_megatron.memory import OffloadConfig
    from higgs_megatron.memory.flags import offload_config_from_args
    from higgs_megatron.runtime.exits import UsageError
    from higgs_megatron.runtime.run_config import MEGATRON_LM, PRETRAIN, check_rules
    from higgs_megatron.training.arguments import build_parser
    from patches.megatron_lm.arguments import add_patch_args

    assert flag_dest("--no-higgs-pin-memory") == "higgs_pin_memory"
    assert field_flag(OffloadConfig, "directory") == "--higgs-offload-dir"
    megatron_like = argparse.ArgumentParser()  # Megatron-LM's parser holds --save and --load
    megatron_like.add_argument("--save")
    megatron_like.add_argument("--load")
    for parser, front_end in ((build_parser(), PRETRAIN), (add_patch_args(megatron_like), MEGATRON_LM)):
        for config_class in (HiggsConfig, OffloadConfig, CheckpointConfig, StabilityConfig):
            flagged = [f for f in fields(config_class) if "flag" in f.metadata]
            assert flagged and all(f.metadata["flag"] in parser._option_string_actions for f in flagged)
            # a schedule flag not given is None: the run derives its value (``schedule``)
            assert field_values(parser.parse_args([]), config_class) == {
                f.name: None if f.metadata["derived"] else f.default for f in flagged}
        args = parser.parse_args(["--higgs-compression-ratio", "0.05", "--no-higgs-error-feedback", "--higgs-offload",
                                  "--higgs-offload-threshold", "0.5", "--no-higgs-pin-memory"])
        assert higgs_config_from_args(args, 100, 10) == HiggsConfig(
            compression_ratio=0.05, error_feedback=False, payload="int4", dense_iters=10, density_warmup_iters=5)
        assert offload_config_from_args(args) == OffloadConfig(threshold=0.5, pin_memory=False)
        with pytest.raises(ValueError, match="--higgs-compression-ratio"):
            higgs_config_from_args(parser.parse_args(["--higgs-compression-ratio", "2"]), 100, 10)
        args = parser.parse_args(["--save", "/s", "--recovery-mode", "reshard", "--checkpoint-interval", "30",
                                  "--async-checkpoint", "--inject-fault", "hang@0:2", "--inject-fault", "nan@1:3"])
        assert checkpoint_config_from_args(args) == CheckpointConfig(recovery_mode="reshard", checkpoint_interval=30.0,
                                                                     async_checkpoint=True, save="/s")
        assert args.inject_fault == ["hang@0:2", "nan@1:3"]
        for argv, flag in ((["--save", "/s", "--checkpoint-interval", "inf"], "--checkpoint-interval inf: expected"),
                           (["--load", "/s", "--checkpoint-version", "0"], "--checkpoint-version 0: expected")):
            with pytest.raises(ValueError, match=flag):
                checkpoint_config_from_args(parser.parse_args(argv))
        with pytest.raises(UsageError) as info:  # what a flag needs of another: one table, both front-ends
            check_rules(parser.parse_args(["--use-higgs", "--auto-resume"]), front_end)
        assert info.value.message == "--auto-resume: needs --save DIR"


@pytest.mark.parametrize("preset", [lambda: lean_config(300), lambda: lean_config(300, dense_wire="bf16", sync="sharded",
                                                                                      freeze_variance=True),
                                    lambda: lean_config(300, dense_iters=0), lambda: higgs_config(0.01, 300),
                                    lambda: lean_config(300, density=1 / 3)])
def test_a_preset_is_a_config_and_its_flags_make_that_config(preset):
    """The benchmarks' schedules are HiggsConfigs (``HiggsConfig.for_run`` with fields given);
    their flags are rendered from the config (``field_flags.config_flags``) and parse back to it."""
    config = preset()
    flags = config_flags(config)
    assert parse_args(["--train-iters", "300", "--use-higgs", *flags], world_size=2).run_config.compression == config
