"""auto decides the same way twice: on two gloo ranks, the real ``measure_link_costs`` with the
probe's timings set, three times over one cache (reduce/link_record.py): the second decides by
the first's record (its large timings 1.5x, its small ones 5x: within the margin, or not
compared), the third (6x) by its own, recorded again; every rank decides alike."""

import pytest

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.link_record import probe_three_times

pytestmark = pytest.mark.drill


def test_a_record_stands_within_the_margin_and_moves_past_it(tmp_path):
    outs = run_ranks(probe_three_times, 2, args=(str(tmp_path / "cache"),))
    assert outs[0] == outs[1], "the ranks decided by different costs"
    first, within, past = outs[0]
    assert within == first
    assert past != first
    assert past["dense"]["seconds_per_byte"] > 5 * first["dense"]["seconds_per_byte"]
    assert len(list((tmp_path / "cache" / "links").glob("*.json"))) == 1
