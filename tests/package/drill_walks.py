"""The save and the load walk down through our files, each entered once (docs/architecture.md).

Measured, not read off the code: ``higgs_megatron_bench.walks`` follows a save and a load of our
pretrain script on two gloo ranks and lists the files of ours control enters, in order.
"""

import pytest

from higgs_megatron_bench.walks import WALK_ARGV, measure_walks


MAX_FILES = {"save": 6, "load": 6}


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    return measure_walks(WALK_ARGV, str(tmp_path_factory.mktemp("walks")))


@pytest.mark.parametrize("name", sorted(MAX_FILES))
def test_a_save_and_a_load_enter_each_file_once(walks, name):
    walk = walks[name]
    assert walk.entries[0] == "higgs_megatron/training/loop.py"
    assert not walk.reentered, walk.describe()
    assert len(walk.files) <= MAX_FILES[name], walk.describe()


def test_the_gradient_walk_goes_from_the_hook_to_the_optimizer(walks):
    walk = walks["gradient"]
    assert walk.files[1] == "higgs_megatron/ddp.py" and "higgs_megatron/optimizer.py" in walk.files, walk.describe()
