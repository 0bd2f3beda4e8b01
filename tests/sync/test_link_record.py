"""The recorded link costs (reduce/link_record.py): a run decides by the timings recorded for
its setting while its own are within the margin of them, and re-records, naming what moved,
when one is not; a record it cannot read leaves the measured timings standing."""

import json
import logging

from higgs_megatron.reduce import link_record
from higgs_megatron.reduce.link_record import MARGIN, decide, record_path, settled

NAMES = ["dense@16384", "dense@4194304", "compress", "decode"]
SETTING = {"hosts": ["a", "b"], "world": 2, "device": "cpu"}


def test_a_record_stands_while_every_timing_is_within_the_margin():
    recorded = [1e-4, 2e-3, 3e-8, 0.0]
    assert settled([1.5e-4, 1.1e-3, 5e-8, 0.0], recorded) == (recorded, [])
    measured = [1e-4, 2e-3 * MARGIN * 1.01, 3e-8, 0.0]
    assert settled(measured, recorded) == (measured, [1])
    assert settled([1e-4, 2e-3, 3e-8, 1e-9], recorded) == ([1e-4, 2e-3, 3e-8, 1e-9], [3])  # a zero matches a zero only
    assert settled([1.0, 2.0], None) == ([1.0, 2.0], [])
    assert settled([1.0, 2.0], [1.0]) == ([1.0, 2.0], [])  # another probe's record: not this one's
    assert settled([9e-4, 2e-3, 3e-8, 0.0], recorded, checked=[False, True, True, True]) == (recorded, [])


def test_the_same_setting_decides_by_the_record_until_a_timing_moves(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HIGGS_CACHE_DIR", str(tmp_path))
    first = [1e-4, 2e-3, 3e-8, 4e-8]
    assert decide(first, NAMES, SETTING) == first
    assert json.loads(record_path(SETTING).read_text())["timings"] == first
    assert decide([1.4e-4, 1.6e-3, 2e-8, 5e-8], NAMES, SETTING) == first  # another load, the same choice
    assert decide([1e-4, 2e-3, 3e-8, 4e-8], NAMES, dict(SETTING, world=4)) == [1e-4, 2e-3, 3e-8, 4e-8]
    with caplog.at_level(logging.WARNING, logger=link_record.__name__):
        slower = [1e-4, 9e-3, 3e-8, 4e-8]
        assert decide(slower, NAMES, SETTING) == slower
    assert "dense@4194304 0.002 -> 0.009" in caplog.text
    assert json.loads(record_path(SETTING).read_text())["timings"] == slower


def test_an_unreadable_record_leaves_the_measured_timings(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HIGGS_CACHE_DIR", str(tmp_path))
    path = record_path(SETTING)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=link_record.__name__):
        assert decide([1.0, 2.0, 3.0, 4.0], NAMES, SETTING) == [1.0, 2.0, 3.0, 4.0]
    assert "could not be read" in caplog.text
