"""The payload formats of --higgs-payload, one process: round trips, block edges, sizes, and
the rounding carried into the error-feedback residual."""

import pytest
import torch

from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, ResidualBuffer, compress_with_feedback
from higgs_megatron.compress.payload import BLOCK, SparseGrad
from higgs_megatron.compress.selection import SampledTopK, TopK
from higgs_megatron.config import HiggsConfig
from higgs_megatron.sync_plan import path_at, plan_bucket

FORMATS = ["wide", "bf16", "int8"]
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
    generator = torch.Generator().manual_seed(0)
    sparse = plan.payload.round(SparseGrad(torch.randn(33, generator=generator), plan.always_positions,
                                           torch.tensor(edges), torch.randn(13, generator=generator) * 100), layout)
    buffer = plan.payload.pack(sparse, layout)
    assert buffer.numel() == plan.payload_bytes(density, torch.float32)
    always, positions, values = plan.payload.unpack(buffer, layout, torch.float32)
    assert positions.tolist() == edges
    assert torch.equal(values, sparse.values) and torch.equal(always, sparse.always)


def test_the_formats_sizes():
    """Bytes per peer, from the format's definition (not from the code under test)."""
    plan = _plan("wide")
    k, units, blocks = plan.k_selected(0.01), 2, 6
    assert blocks == -(-plan.numel // BLOCK)
    sizes = {name: _plan(name).payload_bytes(0.01, torch.float32) for name in FORMATS}
    assert sizes["wide"] == 4 * k + 4 * 33 + 4 * k
    assert sizes["bf16"] == -(-(4 * blocks + 2 * 33 + 2 * k + 2 * k) // 4) * 4
    assert sizes["int8"] == -(-(4 * blocks + 4 * units + 2 * 33 + 2 * k + k) // 4) * 4
    assert sizes["bf16"] < 0.52 * sizes["wide"] and sizes["int8"] < 0.4 * sizes["wide"]
    assert _plan("wide").payload_bytes(0.01, torch.bfloat16) == -(-(4 * k + 2 * 33 + 2 * k) // 4) * 4


@pytest.mark.parametrize("payload", FORMATS)
@pytest.mark.parametrize("selector", [TopK(), SampledTopK(seed=0)], ids=["topk", "sampled-topk"])
def test_rounding_goes_into_the_residual(payload, selector):
    """sent (as decoded) + residual == accumulated, bitwise; the values sent are what the
    format can carry; the residual at a sent position is exactly its rounding error."""
    plan = _plan(payload)
    generator = torch.Generator().manual_seed(1)
    residual = ResidualBuffer(plan.numel, torch.float32, CPU)
    residual.load(torch.randn(plan.numel, generator=generator) * 0.01)
    grad = torch.randn(plan.numel, generator=generator) * torch.rand(plan.numel, generator=generator) ** 4
    accumulated = grad + residual.current
    sparse = compress_with_feedback(grad, plan, 0.01, selector, residual, key="b")
    layout = plan.layout(0.01)
    always, positions, values = plan.payload.unpack(plan.payload.pack(sparse, layout), layout, torch.float32)
    sent = torch.zeros(plan.numel)
    sent[plan.always_positions] = always
    sent.index_add_(0, positions, values)
    assert torch.equal(sent + residual.current, accumulated)
    at_sent = residual.current[positions]
    if payload == "wide":
        assert torch.equal(at_sent, torch.zeros_like(at_sent))
        return
    assert torch.equal(values, values.to(torch.bfloat16).float()) or payload == "int8"
    assert torch.equal(always, always.to(torch.bfloat16).float())
    assert bool((at_sent != 0).any()), "a lower-precision format rounds some value"
    assert torch.equal(at_sent, accumulated[positions] - values)
    if payload == "int8":  # at most half a step of the parameter's scale off, 127 steps to its largest
        for i, unit in enumerate(plan.units):
            mine = (positions >= unit.start) & (positions < unit.end)
            scale = accumulated[positions[mine]].abs().max() / 127
            assert sparse.scales[i] == scale
            assert bool((at_sent[mine].abs() <= 0.5 * scale * (1 + 1e-6)).all())
            assert sparse.codes[mine].abs().max() == 127


def test_a_payload_not_smaller_than_dense_goes_dense_under_every_sync_mode():
    """The ramp's early densities: int32 positions plus fp32 values pass the dense gradient's
    size at density 1/2; 16-bit offsets plus bf16 values only at density 1."""
    slots = [ParamSlot(0, 40_000)]
    for sync in ("sparse", "auto"):
        config = HiggsConfig(sync=sync, min_bucket_numel=0, link_gbps=1.0 if sync == "auto" else None)
        wide = plan_bucket("b", 40_000, torch.float32, slots, config, None, CPU)
        assert path_at(wide, 0.51, None) == "dense" and path_at(wide, 0.49, None) == "sparse"
        bf16 = plan_bucket("b", 40_000, torch.float32, slots, HiggsConfig(
            sync=sync, min_bucket_numel=0, payload="bf16", link_gbps=1.0 if sync == "auto" else None), None, CPU)
        assert path_at(bf16, 1.0, None) == "dense" and path_at(bf16, 0.99, None) == "sparse"
    # Dense steps in bf16 cost half: int8's 3 bytes a pair pass them above density 2/3.
    int8 = plan_bucket("b", 40_000, torch.float32, slots, HiggsConfig(sync="sparse", min_bucket_numel=0, payload="int8",
                                                                      dense_bf16=True), None, CPU)
    assert path_at(int8, 0.67, None) == "dense" and path_at(int8, 0.66, None) == "sparse"


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
