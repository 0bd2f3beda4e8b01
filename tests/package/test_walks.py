"""How a walk counts the files control enters (``higgs_megatron_bench.walks``): a tracer run
over small modules written for the test, ours in one folder, a stand-in for Megatron's in another."""

import importlib.util
import sys

import pytest

from higgs_megatron_bench.walks import Tracer, Walk


def test_a_walk_counts_entries_within_a_leg():
    walk = Walk([["a.py", "b.py", "c.py", "b.py"], ["b.py", "d.py"]])
    assert walk.files == ["a.py", "b.py", "c.py", "d.py"] and walk.reentered == ["b.py"]
    assert walk.describe() == "a.py -> b.py -> c.py -> b.py | b.py -> d.py"


MODULES = {
    "ours/hook.py": "from ours import work\n"
                    "def start(callback=None):\n    return work.launch(callback)\n"
                    "def finish():\n    return work.decode()\n"
                    "def back():\n    return 1\n",
    "ours/work.py": "from ours import wire\n"
                    "def launch(callback=None):\n    wire.send()\n    return callback() if callback else None\n"
                    "def decode():\n    return wire.send() + wire.send()\n",
    "ours/wire.py": "def send():\n    return 1\n",
    "outside/megatron_like.py": "from ours import hook\n"
                                "def step():\n    hook.start()\n    return hook.finish()\n"
                                "def with_callback():\n    return hook.start(callback=hook.back)\n"
                                "def twice():\n    return hook.start(callback=lambda: hook.start())\n",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    for name, text in MODULES.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("ours", "ours.hook", "ours.work", "ours.wire", "outside", "outside.megatron_like"):
        sys.modules.pop(name, None)
    loaded = importlib.import_module("outside.megatron_like")
    yield tmp_path, loaded
    for name in ("ours", "ours.hook", "ours.work", "ours.wire", "outside", "outside.megatron_like"):
        sys.modules.pop(name, None)


def _trace(tmp_path, fn):
    tracer = Tracer(ours=(tmp_path / "ours",), leg_callers=(tmp_path / "outside",))
    tracer.run(fn)
    return tracer.walk


def test_calls_from_outside_begin_legs_and_a_helper_called_in_a_row_counts_once(modules):
    tmp_path, megatron_like = modules
    walk = _trace(tmp_path, megatron_like.step)
    assert walk.legs == [["ours/hook.py", "ours/work.py", "ours/wire.py"],
                         ["ours/hook.py", "ours/work.py", "ours/wire.py"]]
    assert walk.reentered == [] and len(walk.files) == 3


def test_a_callback_back_up_is_an_entry_twice(modules):
    tmp_path, megatron_like = modules
    walk = _trace(tmp_path, megatron_like.with_callback)
    assert walk.legs == [["ours/hook.py", "ours/work.py", "ours/wire.py", "ours/hook.py"]]
    assert walk.reentered == ["ours/hook.py"]


def test_outside_code_calling_ours_again_begins_a_leg_not_a_reentry(modules):
    """Megatron's calls are its protocol, not our climb back: a lambda of Megatron's calling
    the hook again begins a second leg."""
    tmp_path, megatron_like = modules
    walk = _trace(tmp_path, megatron_like.twice)
    assert walk.legs == [["ours/hook.py", "ours/work.py", "ours/wire.py"], ["ours/hook.py", "ours/work.py", "ours/wire.py"]]
    assert walk.reentered == []
