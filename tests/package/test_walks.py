"""How a walk counts the files control enters (``higgs_megatron_bench.walks``)."""

from higgs_megatron_bench.walks import Walk


def test_a_walk_counts_entries_not_returns():
    walk = Walk(["a.py", "b.py", "c.py", "b.py"])
    assert walk.files == ["a.py", "b.py", "c.py"] and walk.reentered == ["b.py"]
