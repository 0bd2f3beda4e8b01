"""Compressors, error feedback and plans: pure tensor code, one process."""

import pytest
import torch

from higgs_megatron.compress.compressor import (
    BucketPlan, ParamSlot, ResidualBuffer, SampledTopK, SparseGrad, TopK, compress)
from higgs_megatron.config import HiggsConfig
from higgs_megatron.grad_paths import DensitySchedule


def _heavy_tailed(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4


def test_topk_is_exact():
    x = _heavy_tailed(10_000)
    selection = TopK().select(x.abs(), 100)
    assert selection.valid is None
    assert set(selection.positions.tolist()) == set(torch.topk(x.abs(), 100).indices.tolist())


def test_sampled_topk_is_exact_unless_it_overflows_and_counts_its_shortfall():
    selector = SampledTopK(seed=1)
    k, exact_calls, overflows = 2_000, 0, 0
    for step in range(20):
        x = _heavy_tailed(200_000, seed=step).abs()
        selection = selector.select(x, k, key="bucket")
        assert selection.positions.numel() == k and selection.valid.numel() == k
        real = selection.positions[selection.valid]
        assert real.unique().numel() == real.numel(), "a coordinate selected twice"
        exact = torch.topk(x, k).indices
        overflowed, before = selector.stats.overflow_calls - overflows, selector.stats.overflow_calls
        overflows = before
        if not overflowed and bool(selection.valid.all()):
            assert set(real.tolist()) == set(exact.tolist())
            exact_calls += 1
        # Whatever happened, what it found are the largest of what it considered: never a
        # coordinate below the k-th largest while it padded.
        if not bool(selection.valid.all()):
            assert set(real.tolist()) <= set(exact.tolist())
    stats = selector.stats
    assert stats.calls == 20 and exact_calls >= 18, (exact_calls, stats.overflow_calls, stats.short_calls)
    assert stats.shortfall < 0.001, stats.shortfall  # the sampled threshold almost never falls short


def test_sampled_topk_pads_when_fewer_than_k_coordinates_are_nonzero():
    x = torch.zeros(100_000)
    hot = torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:50]
    x[hot] = torch.rand(50) + 1.0
    selector = SampledTopK(seed=0)
    selection = selector.select(x, 1000, key="b")
    assert int(selection.valid.sum()) == 50
    assert set(selection.positions[selection.valid].tolist()) == set(hot.tolist())
    assert selector.stats.missed == 950 and selector.stats.short_calls == 1


def test_the_largest_magnitudes_are_selected_not_the_first_or_the_largest_signed():
    """A selector taking the first k, or the largest signed values, must fail this."""
    x = torch.zeros(50_000)
    x[-300:] = -torch.arange(1, 301, dtype=torch.float32)  # the largest magnitudes: negative, at the end
    x[:1000] = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 0.01  # small, first, positive
    plan = BucketPlan(50_000, [ParamSlot(0, 50_000)], min_param_numel=0, device=torch.device("cpu"))
    for selector in (TopK(), SampledTopK(seed=3)):
        sparse = compress(x.clone(), plan, 0.004, selector)  # k = 200
        assert set(sparse.positions.tolist()) == set(range(50_000 - 200, 50_000)), selector.name
        assert torch.equal(sparse.values, x[sparse.positions])


def _plan():
    # bucket: a small bias (100), a TP-sharded weight (5000), a TP-replicated weight (3000)
    slots = [ParamSlot(0, 100), ParamSlot(100, 5100), ParamSlot(5100, 8100)]
    return BucketPlan(8100, slots, min_param_numel=1024, device=torch.device("cpu"))


def test_plan_parts_and_fixed_k():
    plan = _plan()
    assert plan.n_always == 100
    assert [(u.start, u.end) for u in plan.units] == [(100, 5100), (5100, 8100)]
    assert plan.k_selected(0.01) == 50 + 30
    assert plan.payload_bytes(0.01, torch.float32) == 100 * 4 + 80 * 8


def test_compress_sends_always_part_and_conserves_with_error_feedback():
    plan = _plan()
    residual = ResidualBuffer(8100, torch.float32, torch.device("cpu"))
    residual.load(_heavy_tailed(8100, seed=5) * 0.1)
    grad = _heavy_tailed(8100, seed=6)
    acc_expected = grad + residual.current
    residual.accumulate(grad)  # grad is now acc
    assert torch.equal(grad, acc_expected)
    sparse = compress(grad, plan, 0.01, TopK(), key=0)
    assert torch.equal(sparse.always, grad[:100])
    assert sparse.positions.numel() == plan.k_selected(0.01)
    assert not set(sparse.positions.tolist()) & set(range(100)), "always-sent positions are not selected"
    # layer-wise: each parameter sends its own share
    assert sum(100 <= p < 5100 for p in sparse.positions.tolist()) == 50
    assert plan.payload.pack(sparse, plan.layout(0.01)).numel() == plan.payload_bytes(0.01, torch.float32)
    residual.stage(grad, sparse)
    sent = torch.zeros(8100)
    sent[plan.always_positions] = sparse.always
    sent.index_add_(0, sparse.positions, sparse.values)
    assert torch.equal(sent + residual.current, acc_expected)


def test_a_parameters_selection_depends_only_on_its_own_gradient():
    """Two TP ranks: same replicated gradients, different sharded ones -> same replicated picks."""
    plan = _plan()
    a, b = _heavy_tailed(8100, seed=1), _heavy_tailed(8100, seed=2)
    b[5100:] = a[5100:]
    picks = []
    for acc in (a, b):
        positions = compress(acc.clone(), plan, 0.01, TopK()).positions
        picks.append(sorted(p for p in positions.tolist() if p >= 5100))
    assert picks[0] == picks[1] and len(picks[0]) == 30


def test_residual_rollback_restores_the_committed_state():
    residual = ResidualBuffer(10, torch.float32, torch.device("cpu"))
    residual.load(torch.ones(10))
    grad = torch.full((10,), 2.0)
    residual.accumulate(grad)
    positions = torch.tensor([0, 1])
    residual.stage(grad, SparseGrad(torch.empty(0), torch.empty(0, dtype=torch.long), positions, grad[positions]))
    assert residual.current[:2].tolist() == [0.0, 0.0] and residual.current[2].item() == 3.0
    residual.rollback()
    assert torch.equal(residual.current, torch.ones(10))
    residual.accumulate(torch.zeros(10))  # a rolled-back stage never commits
    assert torch.equal(residual.committed, torch.ones(10))


def test_a_dense_step_leaves_a_zero_residual_without_writing_it():
    residual = ResidualBuffer(10, torch.float32, torch.device("cpu"))
    residual.load(torch.ones(10))
    grad = torch.zeros(10)
    residual.accumulate(grad)
    assert torch.equal(grad, torch.ones(10))
    residual.stage_all_sent()
    assert torch.equal(residual.current, torch.zeros(10))
    residual.commit()  # the step is taken
    grad = torch.full((10,), 5.0)
    residual.accumulate(grad)  # the zero residual: nothing is added
    assert torch.equal(grad, torch.full((10,), 5.0))
    residual.rollback()
    assert torch.equal(residual.current, torch.zeros(10))


def test_wide_pack_round_trip_bf16_and_fp32():
    plan = BucketPlan(20_000, [ParamSlot(0, 7), ParamSlot(7, 20_000)], min_param_numel=8, device=torch.device("cpu"))
    layout = plan.layout(3 / 19_993)
    for dtype in (torch.float32, torch.bfloat16):
        sparse = SparseGrad(torch.randn(7).to(dtype), plan.always_positions, torch.tensor([3, 99, 12345]),
                            torch.randn(3).to(dtype))
        a, p, v = plan.payload.unpack(plan.payload.pack(sparse, layout), layout, dtype)
        assert torch.equal(a, sparse.always) and torch.equal(p, sparse.positions) and torch.equal(v, sparse.values)


def test_config_validation_and_density_warmup():
    with pytest.raises(ValueError, match=r"compression_ratio must be in \(0, 1\]"):
        HiggsConfig(compression_ratio=0.0)
    with pytest.raises(ValueError, match="compressor must be one of"):
        HiggsConfig(compressor="powersgd")
    schedule = DensitySchedule.of(HiggsConfig(compression_ratio=0.01, density_warmup_iters=4))
    densities = [schedule.density(step) for step in range(6)]
    assert densities[0] == 1.0 and densities[4] == densities[5] == 0.01
    assert all(a > b for a, b in zip(densities[:4], densities[1:5]))
    assert densities[2] == pytest.approx(0.1)
    staged = DensitySchedule.of(HiggsConfig(compression_ratio=0.01, dense_iters=3, density_warmup_iters=4))
    assert [staged.dense_stage(step) for step in range(5)] == [True, True, True, False, False]
    assert [staged.density(step) for step in range(3, 9)] == densities  # the warm-up starts after the dense stage
    with pytest.raises(ValueError, match="freeze_adam_variance needs dense_iters > 0"):
        HiggsConfig(freeze_adam_variance=True)


def test_the_schedule_in_one_pass_agrees_with_its_parts():
    schedule = DensitySchedule(0.01, dense_iters=3, density_warmup_iters=4, variance_refresh_iters=0)
    assert [schedule.at(step) for step in range(9)] == \
        [(schedule.density(step), schedule.dense_stage(step)) for step in range(9)]
