"""The sharded sync (``--higgs-sync sharded``): its tensor code run for P ranks in one process
(the multi-process runs against Megatron's DDP: ``test_owner_forms.py``)."""

import pytest
import torch

from higgs_megatron.compress.compressor import ParamSlot, TopK
from higgs_megatron.compress.payload import DENSE_INT8
from higgs_megatron.compress.sharded import ShardedPlan

CPU = torch.device("cpu")
# A weight across three of four shards, a bias (sent whole), a small gap, a second weight.
SLOTS = [ParamSlot(0, 1000), ParamSlot(1000, 1010), ParamSlot(1024, 5000), ParamSlot(5000, 5003)]


def _exchange(plan: ShardedPlan, accs: list[torch.Tensor], density: float, payload=None, gather: bool = True,
              sum_density: float | None = None):
    """The protocol of ``reduce.sharded_reduce`` for every rank of a group in one process, the
    collectives written out: (what each rank applies, what each rank keeps as residual). The
    owners send back ``sum_density`` of their sums (default ``density``)."""
    sum_density = density if sum_density is None else sum_density
    world, selector = plan.world, TopK()
    accs = [acc.clone() for acc in accs]
    always = torch.stack([plan.take_always(acc) for acc in accs]).sum(0)  # their all-reduce
    lefts = [torch.empty_like(acc) for acc in accs]
    rows = [plan.compress_rows(acc, density, selector, rank, payload=payload, left=left)
            for rank, (acc, left) in enumerate(zip(accs, lefts))]
    received = [torch.stack([rows[peer][rank] for peer in range(world)]) for rank in range(world)]  # all-to-all
    sums, owner_rows = [], []
    for rank in range(world):
        lo, hi = plan.bounds[rank]
        total = plan.sum_shard(rank, accs[rank].narrow(0, lo, hi - lo), received[rank], density, payload)
        if gather:
            owner_rows.append(plan.compress_sum(rank, total, sum_density, selector, payload=payload))
            lefts[rank].narrow(0, lo, hi - lo).copy_(total)
        sums.append(total)
    applied = []
    for rank in range(world):
        target = torch.empty_like(accs[rank])
        if gather:  # the all-gather of the owners' rows
            plan.add_gathered(target, torch.stack(owner_rows), sum_density, payload)
        else:  # each rank holds its own shard's sum
            target.zero_()
            lo, hi = plan.bounds[rank]
            target.narrow(0, lo, hi - lo).copy_(sums[rank])
        applied.append(target.index_copy_(0, plan.always_positions, always))
    return applied, lefts


def _accs(world: int, numel: int = 5003) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(world)
    accs = [torch.randn(numel, generator=generator) for _ in range(world)]
    gap = torch.ones(numel, dtype=torch.bool)
    for slot in SLOTS:
        gap[slot.start:slot.end] = False
    for acc in accs:  # Megatron's buckets hold zeros between parameters
        acc[gap] = 0
    return accs


def test_shards_are_megatrons_and_rows_are_as_wide_as_the_widest_shard():
    plan = ShardedPlan(5003, SLOTS, 64, 4, CPU, "int4")
    assert plan.shard == 1251 and plan.bounds == [(0, 1251), (1251, 2502), (2502, 3753), (3753, 5003)]
    assert [len(p) for p in plan.pieces] == [2, 1, 1, 1] and plan.always_positions.tolist() == [
        *range(1000, 1010), 5000, 5001, 5002]  # the small ones by an all-reduce of their own, not in a row
    assert plan.layout(0.25).n_always == 0
    # One layout for every row: the widest shard's count of slots, the others padded
    assert plan.layout(0.25).k == max(plan.shard_k(shard, 0.25) for shard in range(4)) > plan.shard_k(3, 0.25)
    rows = plan.compress_rows(_accs(4)[0], 0.25, TopK(), rank=1)
    assert rows.shape == (4, plan.row_bytes(0.25, torch.float32))
    assert not rows[1].any()  # this rank's own shard is never sent
    # At 1,024 ranks every piece is small (5 coordinates), but a piece of a large parameter is
    # still selected, ceil(0.25 x 5) = 2 of 5: only the small parameters (the bias, the last
    # one) are sent whole.
    many = ShardedPlan(5003, SLOTS, 64, 1024, CPU, "int4")
    assert many.always_positions.numel() == 13 and 0.39 < many.k_selected(0.25) / (5003 - 13) <= 0.4


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "distopt"])
def test_density_one_wide_is_the_exact_sum(world, gather):
    plan = ShardedPlan(5003, SLOTS, 64, world, CPU, "wide")
    accs = _accs(world)
    applied, lefts = _exchange(plan, accs, 1.0, gather=gather)
    total = torch.stack(accs).sum(0)
    for rank in range(world):
        lo, hi = plan.bounds[rank]
        window = slice(None) if gather else slice(lo, hi)
        torch.testing.assert_close(applied[rank][window], total[window], rtol=1e-6, atol=1e-6)
        assert not lefts[rank].any()


@pytest.mark.parametrize("payload,density", [(None, 0.1), ("int4", 0.25), ("int8", 0.05), ("DENSE_INT8", 1.0)])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "distopt"])
def test_applied_plus_residuals_is_what_the_ranks_accumulated(payload, density, world, gather):
    """Conservation over the group: what every rank applies (the same everywhere; with the
    distributed optimizer each rank's shard) plus every rank's residual is the sum of what
    they accumulated, whatever the density and the format's rounding (the dense stage's int8
    included)."""
    plan = ShardedPlan(5003, SLOTS, 64, world, CPU, "int4" if payload == "DENSE_INT8" else (payload or "wide"))
    accs = _accs(world)
    applied, lefts = _exchange(plan, accs, density, DENSE_INT8 if payload == "DENSE_INT8" else None, gather=gather)
    if gather:
        assert all(torch.equal(applied[0], other) for other in applied[1:])
        together = applied[0]
    else:  # each rank's own shard of what it applied
        together = torch.cat([applied[rank].narrow(0, lo, hi - lo) for rank, (lo, hi) in enumerate(plan.bounds)])
    gap = (together + torch.stack(lefts).sum(0) - torch.stack(accs).sum(0)).abs().max()
    assert float(gap) < 1e-5, gap


def test_the_owner_sends_the_top_of_the_sum():
    """Rank 1 owns coordinates 2048..4095 and sums them whole; rank 0 sends it its own top one
    there. Their opposite spikes cancel in the sum and are not sent on; what is sent is the
    largest coordinate of the sum, and what rank 0 did not send stays in its residual."""
    plan = ShardedPlan(4096, [ParamSlot(0, 4096)], 64, 2, CPU, "wide")
    a, b = torch.zeros(4096), torch.zeros(4096)
    a[3000], b[3000] = 10.0, -10.0  # rank 0's top, cancelled by the owner's own
    a[3001], b[3001] = 2.0, 3.0  # the owner's 3 is the top of the sum; rank 0's 2 waits
    applied, lefts = _exchange(plan, [a, b], 1 / 2048)  # one coordinate per shard
    assert applied[0].nonzero().view(-1).tolist() == [3001] and float(applied[0][3001]) == 3.0
    assert lefts[0].nonzero().view(-1).tolist() == [3001] and float(lefts[0][3001]) == 2.0


@pytest.mark.parametrize("world", [4, 8])
def test_an_owner_that_sends_back_more_of_its_sum_keeps_less_and_conserves(world):
    """``--higgs-sum-density-factor``: the owners send back twice the density of their sums.
    What the group keeps shrinks (the sum holds the union of the ranks' choices), and applied
    plus residuals is still what the ranks accumulated."""
    plan = ShardedPlan(5003, SLOTS, 64, world, CPU, "int4")
    accs = _accs(world)
    kept = {}
    for factor in (1, 2):
        applied, lefts = _exchange(plan, accs, 0.25, sum_density=0.25 * factor)
        gap = (applied[0] + torch.stack(lefts).sum(0) - torch.stack(accs).sum(0)).abs().max()
        assert float(gap) < 1e-5, (factor, gap)
        kept[factor] = float(sum(left.norm() ** 2 for left in lefts))
    assert kept[2] < 0.8 * kept[1], kept


def test_bf16_gradients_at_density_one_with_odd_shards_decode():
    """A bf16 gradient, bf16 values, every coordinate sent (the implicit layout: an owner at
    density 1), shards of odd length: the gathered rows decode into the bucket."""
    plan = ShardedPlan(5002, [ParamSlot(0, 5002)], 64, 2, CPU, "bf16")
    accs = [acc.to(torch.bfloat16) for acc in _accs(2, 5002)]
    applied, lefts = _exchange(plan, accs, 1.0)
    total = torch.stack([acc.float() for acc in accs]).sum(0)
    assert torch.equal(applied[0], applied[1])
    gap = (applied[0].float() + torch.stack([left.float() for left in lefts]).sum(0) - total).abs().max()
    assert float(gap) < 0.05 * float(total.abs().max()), gap


def test_a_ramp_keeps_a_few_layouts_not_one_per_step():
    plan = ShardedPlan(5003, SLOTS, 64, 4, CPU, "int4")
    for step in range(50):
        plan.layout(0.25 ** (step / 50))
    assert len(plan._layouts) <= 4
