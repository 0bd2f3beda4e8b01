"""The cost model behind ``--higgs-sync auto``: pure arithmetic, checked against the crossover
formula of the design (sparse all-gather wins while n < 2b / (d (4 + b)))."""

import math

import pytest

from higgs_megatron.cost_model import BucketShape, CodecCost, CollectiveCost, LinkCosts, cheapest, predict


def test_fit_recovers_latency_and_slope_and_clamps():
    cost = CollectiveCost.fit((1000, 11000), (0.002, 0.012))
    assert cost.latency_s == pytest.approx(0.001)
    assert cost.seconds_per_byte == pytest.approx(1e-6)
    assert cost.gbps == pytest.approx(8e-3)
    noisy = CollectiveCost.fit((1000, 11000), (0.005, 0.004))  # the large one came out faster
    assert noisy.seconds_per_byte == 0 and noisy.latency_s == 0.005 and math.isinf(noisy.gbps)


def test_assumed_rings_move_what_a_ring_moves():
    costs = LinkCosts.assumed(8.0, dp_size=4, ranks_per_node=4, distributed_optimizer=False,
                              compress_seconds_per_element=0.0)
    second_per_byte = 1e-9  # 8 Gbit/s
    assert costs.dense.seconds(1e6) == pytest.approx(2 * 3 / 4 * 1e6 * second_per_byte)
    assert costs.gather.seconds(1e6) == pytest.approx(3 * 1e6 * second_per_byte)
    assert not costs.has_hierarchy
    distopt = LinkCosts.assumed(8.0, 4, 4, True, 0.0)
    assert distopt.dense.seconds(1e6) == pytest.approx(3 / 4 * 1e6 * second_per_byte)


def _shape(n_elements: int, density: float, value_bytes: int = 4) -> BucketShape:
    return BucketShape(bucket_bytes=n_elements * value_bytes, numel=n_elements,
                       flat_payload_bytes=math.ceil(density * n_elements) * (4 + value_bytes))


@pytest.mark.parametrize("value_bytes", [4, 2])
@pytest.mark.parametrize("density", [0.01, 0.05])
def test_free_compression_follows_the_design_crossover(density, value_bytes):
    crossover = 2 * value_bytes / (density * (4 + value_bytes))  # 100 ranks at 1% in fp32
    for ranks in (2, int(crossover * 0.8), int(crossover * 1.25)):
        costs = LinkCosts.assumed(10.0, ranks, ranks, False, compress_seconds_per_element=0.0)
        path = cheapest(predict(costs, _shape(1_000_000, density, value_bytes)))
        assert path == ("sparse" if ranks < crossover else "dense"), (ranks, crossover)


def test_compression_time_keeps_fast_links_dense_and_slow_links_sparse():
    shape = _shape(1_000_000, 0.01)
    per_element = 5e-9  # 5 ms for a million elements
    fast = LinkCosts.assumed(100.0, 2, 2, False, per_element)
    slow = LinkCosts.assumed(1.0, 2, 2, False, per_element)
    assert cheapest(predict(fast, shape)) == "dense"
    assert cheapest(predict(slow, shape)) == "sparse"
    assert cheapest(predict(slow, shape), allowed=("dense",)) == "dense"


def test_hierarchical_wins_when_nodes_are_fast_inside_and_slow_between():
    n, density, per_node = 1_000_000, 0.01, 4
    piece = n // per_node
    shape = BucketShape(bucket_bytes=4 * n, numel=n, flat_payload_bytes=math.ceil(density * n) * 8,
                        slice_numel=piece, slice_payload_bytes=math.ceil(density * piece) * 8, ranks_per_node=per_node)
    costs = LinkCosts.assumed(1.0, dp_size=16, ranks_per_node=per_node, distributed_optimizer=False,
                              compress_seconds_per_element=5e-9, node_gbps=400.0)
    predicted = predict(costs, shape)
    assert set(predicted) == {"dense", "sparse", "hierarchical"}
    assert cheapest(predicted) == "hierarchical"
    # The same nodes with slow links inside too: the node's dense steps no longer pay.
    uniform = LinkCosts.assumed(1.0, 16, per_node, False, 5e-9)
    assert cheapest(predict(uniform, shape)) == "sparse"


def test_decoding_is_priced_per_payload_decoded():
    """On the all-gather every rank decodes every rank's payload: with a CPU's costs (a quarter
    of the coordinates in int4 decodes at about what it compresses), two ranks on a 1 Gbit/s
    link are already cheaper dense, which pricing compression alone would not see. The
    sharded form decodes the same two buckets' worth whatever the group's size."""
    n = 1_000_000
    shape = BucketShape(bucket_bytes=4 * n, numel=n, flat_payload_bytes=n // 16, shards=2)
    cpu = dict(compress_seconds_per_element=16e-9, decode_seconds_per_element=20e-9)
    assert cheapest(predict(LinkCosts.assumed(1.0, 2, 2, False, 16e-9), shape)) == "sparse"
    decoded = predict(LinkCosts.assumed(1.0, 2, 2, False, **cpu), shape)
    assert cheapest(decoded) == "dense"
    assert decoded["sparse"] == pytest.approx(n * (16e-9 + 2 * 20e-9) + n / 16 * 8e-9)

    def sharded(world: int) -> float:
        costs = LinkCosts.assumed(1e6, world, world, False, **cpu)  # a link that costs nothing: the codec alone
        return predict(costs, BucketShape(bucket_bytes=4 * n, numel=n, shard_row_bytes=n // 16 // world,
                                          shards=world, gather_row_bytes=n // 16 // world))["sharded"]
    assert sharded(64) < sharded(8) == pytest.approx(n * (16e-9 + 2 * 20e-9 + 16e-9 / 8), rel=1e-3)


def test_a_dense_int8_step_is_priced_with_its_own_codec():
    n = 1_000_000
    int8 = CodecCost(compress_seconds_per_element=2e-9, decode_seconds_per_element=1e-9)
    costs = LinkCosts.assumed(1.0, 2, 2, False, 16e-9, decode_seconds_per_element=20e-9, dense_int8=int8)
    shape = BucketShape(bucket_bytes=4 * n, numel=n, flat_payload_bytes=n, shards=2, dense_int8=True)
    assert predict(costs, shape)["sparse"] == pytest.approx(n * (2e-9 + 2 * 1e-9) + n * 8e-9)
    assert cheapest(predict(costs, shape)) == "sparse"  # a quarter of the bytes, cheaply coded
