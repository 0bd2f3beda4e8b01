"""The wire meter on its own: the ring factors, and a meter that takes and resets its count."""

from higgs_megatron.reduce.wire import WireMeter, dense_wire_bytes, gloo_factor, ring_factor, wire_bytes


def test_ring_factors():
    assert ring_factor("all_reduce", 8) == 2 * 7 / 8
    assert ring_factor("reduce_scatter", 8) == 7 / 8
    assert ring_factor("all_gather", 8) == 7
    assert ring_factor("all_to_all", 8) == 7 / 8
    assert all(ring_factor(kind, 1) == 0 for kind in ("all_reduce", "all_gather"))
    assert gloo_factor("reduce_scatter", 4) == ring_factor("all_reduce", 4)
    # Megatron's dense reduction: all-reduce, or reduce-scatter with the distributed optimizer,
    # plus the shard's all-reduce across optimizer instances.
    assert dense_wire_bytes(800, 4, False) == wire_bytes("all_reduce", 800, 4) == 1200
    assert dense_wire_bytes(800, 4, True) == 600
    assert dense_wire_bytes(800, 4, True, instances=2) == 600 + 200


def test_meter_takes_and_resets():
    meter = WireMeter()
    meter.count("all_gather", 100, 4)
    meter.count("reduce_scatter", 400, 4)
    taken = meter.take()
    assert (taken.handed, taken.wire) == (500, 300 + 300)
    assert taken.wire_as(gloo_factor) == 300 + 600
    assert taken.calls == 2 and (meter.handed, meter.wire, meter.by_kind, meter.calls) == (0, 0.0, {}, 0)
