"""The payload formats of --higgs-payload, one process: round trips, block edges, sizes, and
the rounding carried into the error-feedback residual."""

import pytest
import torch

from higgs_megatron.compress.compressor import (
    BucketPlan, ParamSlot, ResidualBuffer, SampledTopK, TopK, compress_with_feedback)
from higgs_megatron.compress.payload import BLOCK, SparseGrad
from higgs_megatron.config import HiggsConfig
from higgs_megatron.grad_paths import path_at
from higgs_megatron.sync_plan import plan_bucket

FORMATS = ["wide", "bf16", "int8", "int4"]
BLOCKED = ["bf16", "int8", "int4"]
LEVELS = {"int8": 127, "int4": 7}
CPU = torch.device("cpu")


def _plan(payload: str, numel: int = 5 * BLOCK + 17) -> BucketPlan:
    # a small always-sent parameter (odd size: the sections after it must stay aligned), then two units
    return BucketPlan(numel, [ParamSlot(0, 33), ParamSlot(33, 2 * BLOCK + 5), ParamSlot(2 * BLOCK + 5, numel)],
                      min_param_numel=1000, device=CPU, payload=payload)


@pytest.mark.parametrize("payload", FORMATS)
def test_round_trip_at_the_block_edges(payload):
    """Positions on both sides of every block boundary, with empty blocks between them: a
    format that takes an offset's block from the wrong start, or wraps an offset above 2**15,
    decodes a different position."""
    plan = _plan(payload)
    edges = [33, 34, BLOCK - 1, BLOCK, 2 * BLOCK + 4,  # first unit: ends at 2 * BLOCK + 5
             2 * BLOCK + 5, 2 * BLOCK + 6, 3 * BLOCK - 2, 3 * BLOCK - 1,  # second; block 3 empty
             4 * BLOCK, 4 * BLOCK + 1, 5 * BLOCK, plan.numel - 1]
    density = 5 / plan.units[0].numel
    layout = plan.layout(density)
    assert layout.k == 13 and plan.k_unit(plan.units[1], density) == 8
    assert layout.encoding == ("int32" if payload == "wide" else "offsets")
    generator = torch.Generator().manual_seed(0)
    sparse = plan.payload.round(SparseGrad(torch.randn(33, generator=generator), plan.always_positions,
                                           torch.tensor(edges), torch.randn(13, generator=generator) * 100), layout)
    buffer = plan.payload.pack(sparse, layout)
    assert buffer.numel() == plan.payload_bytes(density, torch.float32)
    always, positions, values = plan.payload.unpack(buffer, layout, torch.float32)
    assert positions.tolist() == edges
    assert torch.equal(values, sparse.values) and torch.equal(always, sparse.always)


@pytest.mark.parametrize("payload", BLOCKED)
def test_bitmap_round_trip_with_padding_repeats_and_an_odd_length(payload):
    """A bitmap above density 1/16: the bucket's first and last coordinate (its length not a
    multiple of 8), and padding slots that repeat a position with value 0: the decoded payload
    adds up to the same gradient, its positions come in order, and the slots' order going in
    does not change a byte."""
    plan = _plan(payload, numel=3 * BLOCK + 3)
    density = 0.2
    layout = plan.layout(density)
    assert layout.encoding == "bitmap"
    generator = torch.Generator().manual_seed(4)
    k = layout.k
    positions, _ = torch.sort(torch.randperm(plan.numel - 33, generator=generator)[:k] + 33)
    positions[-1] = plan.numel - 1
    values = torch.randn(k, generator=generator)
    positions[10:14] = positions[9]  # four padding slots repeating slot 9's position
    values[10:14] = 0
    sparse = plan.payload.round(SparseGrad(torch.randn(33, generator=generator), plan.always_positions,
                                           positions, values), layout)
    buffer = plan.payload.pack(sparse, layout)
    assert buffer.numel() == plan.payload_bytes(density, torch.float32)
    always, decoded, decoded_values = plan.payload.unpack(buffer, layout, torch.float32)
    expected, got = torch.zeros(plan.numel), torch.zeros(plan.numel)
    expected.index_add_(0, sparse.positions, sparse.values)
    got.index_add_(0, decoded, decoded_values)
    assert torch.equal(got, expected) and torch.equal(always, sparse.always)
    unique = torch.unique(positions)
    assert torch.equal(decoded[:unique.numel()], unique)
    assert bool((decoded_values[unique.numel():] == 0).all())
    # the encoder takes the slots in any order (the selector's, unsorted): the same bytes
    shuffle = torch.randperm(k, generator=generator)
    shuffled = SparseGrad(sparse.always, sparse.always_positions, sparse.positions[shuffle], sparse.values[shuffle],
                          codes=None if sparse.codes is None else sparse.codes[shuffle], scales=sparse.scales)
    assert torch.equal(plan.payload.pack(shuffled, layout), buffer)


@pytest.mark.parametrize("payload", BLOCKED)
def test_every_coordinate_goes_in_order_without_positions(payload):
    plan = _plan(payload, numel=2 * BLOCK + 1005)
    layout = plan.layout(1.0)
    assert layout.encoding == "implicit" and layout.k == plan.numel and layout.n_always == 0
    acc = torch.randn(plan.numel, generator=torch.Generator().manual_seed(5))
    residual = ResidualBuffer(plan.numel, torch.float32, CPU)
    sparse = compress_with_feedback(acc.clone(), plan, 1.0, TopK(), residual)
    assert sparse.positions is None
    buffer = plan.payload.pack(sparse, layout)
    value_bytes = {"bf16": 2 * plan.numel, "int8": plan.numel, "int4": -(-plan.numel // 2)}[payload]
    scales = 4 * -(-plan.numel // 2048) if payload in LEVELS else 0
    assert buffer.numel() == plan.payload_bytes(1.0, torch.float32) == -(-(value_bytes + scales) // 4) * 4
    always, positions, values = plan.payload.unpack(buffer, layout, torch.float32)
    assert positions is None and always.numel() == 0
    assert torch.equal(values + residual.current, acc)


def test_the_formats_sizes():
    """Bytes per peer, from the format's definition (not from the code under test): offsets at
    1%, a bitmap at 10%."""
    plan = _plan("wide")
    k, blocks, spans = plan.k_selected(0.01), 6, -(-plan.numel // 32768)  # 256 slots at 1%: 25,600 -> 32Ki
    assert blocks == -(-plan.numel // BLOCK)
    sizes = {name: _plan(name).payload_bytes(0.01, torch.float32) for name in FORMATS}
    assert sizes["wide"] == 4 * k + 4 * 33 + 4 * k
    assert sizes["bf16"] == -(-(4 * blocks + 2 * 33 + 2 * k + 2 * k) // 4) * 4
    assert sizes["int8"] == -(-(4 * blocks + 4 * spans + 2 * 33 + 2 * k + k) // 4) * 4
    assert sizes["bf16"] < 0.52 * sizes["wide"] and sizes["int8"] < 0.4 * sizes["wide"]
    assert _plan("wide").payload_bytes(0.01, torch.bfloat16) == -(-(4 * k + 2 * 33 + 2 * k) // 4) * 4
    k, bitmap, spans = plan.k_selected(0.1), -(-plan.numel // 8), -(-plan.numel // 4096)
    assert _plan("bf16").payload_bytes(0.1, torch.float32) == -(-(bitmap + 2 * 33 + 2 * k) // 4) * 4
    assert _plan("int8").payload_bytes(0.1, torch.float32) == -(-(4 * spans + bitmap + 2 * 33 + k) // 4) * 4
    assert _plan("int4").payload_bytes(0.1, torch.float32) == -(-(4 * spans + bitmap + 2 * 33 + -(-k // 2)) // 4) * 4
    assert bitmap < 4 * blocks + 2 * k


@pytest.mark.parametrize("payload", FORMATS)
@pytest.mark.parametrize("density", [0.01, 0.2, 1.0], ids=["offsets", "bitmap", "implicit"])
@pytest.mark.parametrize("selector", [TopK(), SampledTopK(seed=0)], ids=["topk", "sampled-topk"])
def test_rounding_goes_into_the_residual(payload, density, selector):
    """sent (as decoded) + residual == accumulated, bitwise; the values sent are what the
    format can carry; the residual at a sent position is exactly its rounding error."""
    plan = _plan(payload)
    generator = torch.Generator().manual_seed(1)
    residual = ResidualBuffer(plan.numel, torch.float32, CPU)
    residual.load(torch.randn(plan.numel, generator=generator) * 0.01)
    grad = torch.randn(plan.numel, generator=generator) * torch.rand(plan.numel, generator=generator) ** 4
    accumulated = grad + residual.current
    sparse = compress_with_feedback(grad, plan, density, selector, residual, key="b")
    layout = plan.layout(density)
    always, positions, values = plan.payload.unpack(plan.payload.pack(sparse, layout), layout, torch.float32)
    sent = torch.zeros(plan.numel)
    if positions is None:
        positions = torch.arange(plan.numel)
    else:
        sent[plan.always_positions] = always
    sent.index_add_(0, positions, values)
    assert torch.equal(sent + residual.current, accumulated)
    at_sent = residual.current[positions]
    if payload == "wide":
        assert torch.equal(at_sent, torch.zeros_like(at_sent))
        return
    assert torch.equal(values, values.to(torch.bfloat16).float()) or payload in LEVELS
    assert torch.equal(always, always.to(torch.bfloat16).float())
    assert bool((at_sent != 0).any()), "a lower-precision format rounds some value"
    assert torch.equal(at_sent, accumulated[positions] - sent[positions])
    if payload in LEVELS:  # at most half a step of its span's scale off, 127 (or 7) steps to the span's largest
        span = layout.span
        assert span >= 2048 and span * density >= 256 and (span == 2048 or span * density < 512)
        for start in range(0, plan.numel, span):
            mine = (positions >= start) & (positions < start + span) & (sent[positions] != 0)
            if not bool(mine.any()):
                continue
            scale = sparse.scales[start // span]
            assert scale == accumulated[positions[mine]].abs().max() / LEVELS[payload]
            assert bool((at_sent[mine].abs() <= 0.5 * scale * (1 + 1e-6)).all())


def test_a_payload_not_smaller_than_dense_goes_dense_under_every_sync_mode():
    """The ramp's early densities: int32 positions plus fp32 values pass the dense gradient's
    size at density 1/2; a bitmap plus bf16 values stays under fp32 at every density, but not
    under a bf16 dense step."""
    slots = [ParamSlot(0, 40_000)]
    for sync in ("sparse", "auto"):
        config = HiggsConfig(sync=sync, min_bucket_numel=0, link_gbps=1.0 if sync == "auto" else None)
        wide = plan_bucket("b", 40_000, torch.float32, slots, config, None, CPU, world=2)
        assert path_at(wide, 0.51, None) == "dense" and path_at(wide, 0.49, None) == "sparse"
        bf16 = plan_bucket("b", 40_000, torch.float32, slots, HiggsConfig(
            sync=sync, min_bucket_numel=0, payload="bf16", link_gbps=1.0 if sync == "auto" else None), None, CPU, world=2)
        assert path_at(bf16, 0.99, None) == "sparse"
        bf16_dense = plan_bucket("b", 40_000, torch.float32, slots, HiggsConfig(
            sync=sync, min_bucket_numel=0, payload="bf16", dense_bf16=True,
            link_gbps=1.0 if sync == "auto" else None), None, CPU, world=2)
        assert path_at(bf16_dense, 0.94, None) == "dense" and path_at(bf16_dense, 0.93, None) == "sparse"
    # int8 never passes a bf16 dense step: at density 1 it sends every coordinate, one byte each.
    int8 = plan_bucket("b", 40_000, torch.float32, slots, HiggsConfig(sync="sparse", min_bucket_numel=0, payload="int8",
                                                                      dense_bf16=True), None, CPU, world=2)
    assert path_at(int8, 1.0, None) == "sparse" and int8.plan.layout(1.0).encoding == "implicit"
    assert path_at(int8, 0.99, None) == "sparse" and int8.plan.layout(0.99).encoding == "bitmap"


def test_a_dense_step_rounded_to_bf16_keeps_the_rounding_in_the_residual():
    residual = ResidualBuffer(1000, torch.float32, CPU)
    residual.load(torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 0.01)
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    accumulated = grad + residual.current
    residual.accumulate(grad)
    wire = grad.to(torch.bfloat16)
    residual.stage_rounded(grad, wire)
    assert torch.equal(wire.float() + residual.current, accumulated)
    assert bool((residual.current != 0).any()) and residual.current.abs().max() <= accumulated.abs().max() * 2 ** -8
