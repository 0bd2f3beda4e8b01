"""The three walks of docs/architecture.md go down through our files, none entered twice.

Measured, not read off the code: ``higgs_megatron_bench.walks`` follows one gradient, one save
and one load of our pretrain script on two gloo ranks and lists the files of ours control
enters, in order, leg by leg (a leg: one call from Megatron or the loop).
"""

import pytest

from higgs_megatron_bench.walks import WALK_ARGV, measure_walks

MAX_FILES = {"gradient": 8, "save": 8, "load": 6}


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    return measure_walks(WALK_ARGV, str(tmp_path_factory.mktemp("walks")))


@pytest.mark.parametrize("name", sorted(MAX_FILES))
def test_each_walk_enters_each_file_once_within_a_leg(walks, name):
    walk = walks[name]
    assert not walk.reentered, walk.describe()
    assert len(walk.files) <= MAX_FILES[name], walk.describe()


def test_a_save_and_a_load_start_at_the_loop(walks):
    assert walks["save"].entries[0] == walks["load"].entries[0] == "higgs_megatron/training/loop.py"


def test_the_gradient_walk_goes_from_the_hook_through_the_sync_to_the_step(walks):
    """Megatron's hook enters the bucket group, the launch reaches a collective, the finish
    decodes, and the optimizer's step decides: the walk is the whole gradient, not a part."""
    legs = walks["gradient"].legs
    assert legs[0][0] == "higgs_megatron/ddp.py" and "higgs_megatron/reduce/wire.py" in legs[0], legs
    assert "higgs_megatron/compress/payload.py" in [name for leg in legs[1:-1] for name in leg], legs
    assert legs[-1][0] == "higgs_megatron/optimizer.py" and legs[-1][-1] == "higgs_megatron/stability/alignment.py"
