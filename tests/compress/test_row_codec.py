"""The fused sign codec (compress/row_codec.c) against its reference, the eager torch ops of
compress.agreed: the same wire bytes, owner sums, residuals and decoded buckets, bit for bit,
on plans with small parameters between the rows, padding, several spans and a partial one."""

import pytest
import torch

from higgs_megatron.compress import row_codec
from higgs_megatron.compress.agreed import AgreedPlan, halving_sum, ordered_row_sum
from higgs_megatron.compress.compressor import ParamSlot
from higgs_megatron.compress import native
from higgs_megatron.compress.native import codec_library, compiler
from higgs_megatron_bench.codec import first_difference, one_rank_codec

CPU = torch.device("cpu")
PLANS = {
    "small parameters between the rows, 4 owners": (5003, [ParamSlot(0, 1000), ParamSlot(1000, 1010),
                                                          ParamSlot(1024, 5000), ParamSlot(5000, 5003)], 4),
    "one owner, one partial span": (300, [ParamSlot(0, 300)], 1),
    "3 owners, a bucket's padding at the end": (70000, [ParamSlot(0, 30000), ParamSlot(30000, 30020),
                                                        ParamSlot(30020, 69990)], 3),
}


# Without a compiler the codec is the reference alone (as the last test here shows it falls
# back): there is nothing fused to hold against it.
needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc, gcc or $CC) on this machine")


@pytest.fixture
def fused_library():
    assert codec_library() is not None, "a C compiler is here, and the fused codec did not build"


def cases(name: str, device: torch.device = CPU):
    """(plan, gradient, rank, the owner's residual) for each rank of plan ``name``."""
    numel, slots, world = PLANS[name]
    plan = AgreedPlan(numel, slots, 64, world, device, "sign", scored=False)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator)
    grad[7] = 0.0  # a zero is a sign too
    for rank in range(world):
        yield plan, grad.to(device), rank, (torch.randn(1, plan.layout(1.0).width, generator=generator) * 0.1).to(device)


@needs_compiler
@pytest.mark.parametrize("fmt", row_codec.FORMATS)
@pytest.mark.parametrize("name", PLANS)
def test_fused_codec_equals_the_reference_bit_for_bit(name, fmt, fused_library):
    for plan, grad, rank, owner_residual in cases(name):
        fused = one_rank_codec(plan, grad, rank, owner_residual, fmt=fmt)
        reference = one_rank_codec(plan, grad, rank, owner_residual, fused=False, fmt=fmt)
        assert first_difference(fused, reference) is None, f"rank {rank}"


@needs_compiler
def test_the_residual_is_what_the_receivers_do_not_decode(fused_library):
    """Conservation through the fused path: rows decoded + residual == the values sent, to the
    rounding of the residual's one subtraction."""
    numel, slots, world = PLANS["small parameters between the rows, 4 owners"]
    plan = AgreedPlan(numel, slots, 64, world, CPU, "sign", scored=False)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    positions, real = plan.select(torch.empty(0), 1.0)
    left = torch.zeros_like(grad)
    rows = row_codec.encode(grad, positions, real, plan.layout(1.0).span, left, plan.row_runs)
    decoded = torch.zeros_like(grad)
    row_codec.decode_add(rows, positions, real, plan.layout(1.0).span, decoded, plan.row_runs)
    in_rows = torch.ones(numel, dtype=torch.bool)
    in_rows[plan.outside_rows] = False
    assert torch.allclose((decoded + left)[in_rows], grad[in_rows], rtol=0, atol=1e-6)
    assert not torch.allclose(decoded[in_rows], grad[in_rows], rtol=0, atol=1e-2)  # signs are not the values
    assert torch.equal(decoded[~in_rows], torch.zeros(int((~in_rows).sum())))


def test_the_fixed_orders_are_sums():
    x = torch.randn(3, 5, 40, dtype=torch.float64)
    assert torch.allclose(halving_sum(x), x.sum(-1))
    assert torch.allclose(ordered_row_sum(x[0]), x[0].sum(0, keepdim=True))


def test_a_compiler_that_fails_leaves_the_reference_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a compiler that fails every build
    monkeypatch.setenv("HIGGS_CACHE_DIR", str(tmp_path))
    native.codec_library.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=native.__name__):
            assert codec_library() is None
        assert "did not build with false" in caplog.text
        plan, grad, rank, owner_residual = next(cases("one owner, one partial span"))
        assert first_difference(one_rank_codec(plan, grad, rank, owner_residual),
                                one_rank_codec(plan, grad, rank, owner_residual, fused=False)) is None
    finally:
        native.codec_library.cache_clear()
