"""The virtual data-parallel group refuses the layouts it does not stand for."""

from __future__ import annotations

import pytest

from higgs_megatron.training.arguments import UsageError, parse_args

from tests.workers.virtual import load_virtual_dp


@pytest.mark.parametrize("flags,named", [(["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
                                          "--num-distributed-optimizer-instances"),
                                         (["--higgs-sync", "auto"], "--higgs-sync auto"),
                                         (["--tensor-model-parallel-size", "2"], "--tensor"),
                                         (["--save", "/nonexistent"], "--save")])
def test_the_virtual_group_refuses_what_it_does_not_stand_for(flags, named, tiny_gpt_args, monkeypatch):
    """E.g. several optimizer instances: a second level of data parallelism the virtual group
    does not have. Refused before any training, naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # as the fake group of 4 ranks sets it
    module = load_virtual_dp()
    args = parse_args(tiny_gpt_args + ["--train-iters", "2", "--use-higgs", "--higgs-sync", "sharded", *flags])
    with pytest.raises(UsageError) as error:
        module.check_supported(args)
    assert named in error.value.message
