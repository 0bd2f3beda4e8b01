"""Adam with a frozen second moment (``higgs_megatron.frozen_variance``), one process."""

import copy

import pytest
import torch

from higgs_megatron.frozen_variance import MAX_UPDATE_RMS, freeze_variance


def _pair(freeze_step, **adam):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(9))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adam = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, **adam}
    frozen, plain = torch.optim.AdamW(params, **adam), torch.optim.AdamW(twins, **adam)
    freeze_variance(frozen, freeze_step)
    return frozen, plain


def _step(optimizer, grads):
    for p, g in zip(optimizer.param_groups[0]["params"], grads):
        p.grad = g.clone()
    optimizer.step()


def test_torch_update_before_the_freeze_and_the_frozen_one_after():
    frozen, plain = _pair(freeze_step=3)
    params, twins = frozen.param_groups[0]["params"], plain.param_groups[0]["params"]
    for step in range(1, 7):  # after the freeze, gradients small enough to stay below the cap
        grads = [torch.randn_like(p) * (1.0 if step <= 3 else 0.5) for p in params]
        before = [p.detach().clone() for p in params]
        moments = [(frozen.state[p]["exp_avg"].clone(), frozen.state[p]["exp_avg_sq"].clone()) if frozen.state[p]
                   else None for p in params]
        _step(frozen, grads)
        _step(plain, grads)
        if step <= 3:  # Adam's own update, bitwise
            assert all(torch.equal(p, q) for p, q in zip(params, twins)), step
            continue
        for p, g, x, (m, v) in zip(params, grads, before, moments):
            state = frozen.state[p]
            assert int(state["step"]) == step
            assert torch.equal(state["exp_avg_sq"], v), "the frozen second moment is never written"
            m = 0.9 * m + 0.1 * g
            expected = x * (1 - 1e-2 * 0.1) - 1e-2 / (1 - 0.9 ** step) * m / ((v / (1 - 0.95 ** 3)).sqrt() + 1e-8)
            torch.testing.assert_close(state["exp_avg"], m)
            torch.testing.assert_close(p.detach(), expected)
        assert not torch.equal(params[0], twins[0])


def _clone(optimizer, freeze_step):
    params = [torch.nn.Parameter(p.detach().clone()) for p in optimizer.param_groups[0]["params"]]
    clone = torch.optim.AdamW(params)
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    freeze_variance(clone, freeze_step)
    return clone


def _displacement(optimizer, grads):
    start = optimizer.param_groups[0]["params"][0].detach().clone()
    for g in grads:
        _step(optimizer, [g, torch.zeros(9)])
    return optimizer.param_groups[0]["params"][0].detach() - start


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "plain-adam"])
def test_a_burst_moves_a_coordinate_as_far_as_the_steps_it_stands_for_only_when_frozen(frozen):
    """Why the freeze: error feedback delivers 20 steps' gradients as one burst, on the few
    coordinates top-k picked. With the second moment frozen the burst moves them as far as the
    20 steps would have (the update cap does not touch a burst this sparse); plain Adam
    flattens it to a fraction of that."""
    freeze_step = 50 if frozen else 10**9
    optimizer, _ = _pair(freeze_step, weight_decay=0.0)
    for _ in range(50):  # dense warm-up: the second moment learns the gradient scale
        _step(optimizer, [torch.randn(6, 4), torch.randn(9)])
    g = torch.zeros(6, 4)
    g[0, :2] = 0.5
    spread_out, burst = _clone(optimizer, freeze_step), _clone(optimizer, freeze_step)
    quiet = [torch.zeros(6, 4)] * 100  # the momentum plays out
    moved_spread = _displacement(spread_out, [g] * 20 + quiet)
    moved_burst = _displacement(burst, [20 * g] + [torch.zeros(6, 4)] * 19 + quiet)
    ratio = (moved_burst[0, :2] / moved_spread[0, :2]).mean().item()
    if frozen:
        assert abs(ratio - 1) < 0.01, ratio
    else:
        assert ratio < 0.5, ratio


def test_a_frozen_update_is_held_to_an_rms_of_one_learning_rate_when_gradients_blow_up():
    """Linear in the gradient, a frozen update would grow with a loss spike's gradients (and
    feed the spike); capped like Adafactor's, each parameter moves MAX_UPDATE_RMS learning
    rates in RMS at most, in the direction of the uncapped update."""
    optimizer, _ = _pair(freeze_step=20, weight_decay=0.0)
    for _ in range(20):  # the second moment learns a gradient scale of 1
        _step(optimizer, [torch.randn(6, 4), torch.randn(9)])
    params = optimizer.param_groups[0]["params"]
    for scale in (0.1, 1000.0):
        grads = [scale * torch.randn_like(p) for p in params]
        before = [(p.detach().clone(), optimizer.state[p]["exp_avg"].clone(), optimizer.state[p]["exp_avg_sq"])
                  for p in params]
        step = int(optimizer.state[params[0]]["step"]) + 1
        _step(optimizer, grads)
        for p, g, (x, m, v) in zip(params, grads, before):
            uncapped = (0.9 * m + 0.1 * g) / (1 - 0.9 ** step) / ((v / (1 - 0.95 ** 20)).sqrt() + 1e-8)
            rms = uncapped.square().mean().sqrt().item()
            assert (rms < MAX_UPDATE_RMS) if scale < 1 else (rms > 50 * MAX_UPDATE_RMS), rms
            torch.testing.assert_close(p.detach(), x - 1e-2 * uncapped / max(1.0, rms / MAX_UPDATE_RMS))


def test_a_coordinate_without_gradient_in_the_dense_stage_moves_like_its_neighbours():
    """Its second moment is 0 as it freezes: divided by eps it would take the whole capped
    update. It takes the tensor's mean, once, and is frozen at that."""
    optimizer, _ = _pair(freeze_step=20, weight_decay=0.0)
    for _ in range(20):
        g = torch.randn(6, 4)
        g[0, 0] = 0.0  # a token not seen in the dense stage
        _step(optimizer, [g, torch.randn(9)])
    params = optimizer.param_groups[0]["params"]
    v = optimizer.state[params[0]]["exp_avg_sq"]
    assert v[0, 0] == 0
    mean = v.mean().item()
    before = params[0].detach().clone()
    _step(optimizer, [torch.ones(6, 4), torch.zeros(9)])
    moved = (before - params[0].detach()).abs() / 1e-2
    assert moved[0, 0] < 2 * moved.flatten()[1:].max(), moved
    assert v[0, 0].item() == pytest.approx(mean) and (v > 0).all()
    frozen = v.clone()
    _step(optimizer, [torch.ones(6, 4), torch.zeros(9)])
    assert torch.equal(v, frozen)


def test_a_frozen_optimizer_resumes_from_its_state_dict():
    frozen, _ = _pair(freeze_step=2)
    for _ in range(4):
        _step(frozen, [torch.randn(6, 4), torch.randn(9)])
    resumed = _clone(frozen, freeze_step=2)
    grads = [torch.randn(6, 4), torch.randn(9)]
    _step(frozen, grads)
    _step(resumed, grads)
    assert all(torch.equal(p, q) for p, q in zip(frozen.param_groups[0]["params"], resumed.param_groups[0]["params"]))


def test_only_adamw_is_frozen_and_the_error_names_the_flag():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="freeze_variance needs Adam .*SGD"):
        freeze_variance(sgd, 5)
    amsgrad = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        freeze_variance(amsgrad, 5)


def test_a_thawed_step_takes_torchs_update_and_moves_the_second_moment():
    """Steps 5 and 6 (0-based 4 and 5) thawed: Adam's own update there, the frozen one around."""
    from higgs_megatron.config import HiggsConfig
    from higgs_megatron.grad_paths import DensitySchedule

    schedule = DensitySchedule.of(HiggsConfig(dense_iters=2, freeze_adam_variance=True, variance_refresh_iters=2))
    assert [schedule.refresh_window(step) for step in range(10)] == [False] * 4 + [True] * 2 + [False] * 2 + [True] * 2
    assert [schedule.dense_stage(step) for step in range(10)] == [True] * 2 + [False] * 2 + [True] * 2 + [False] * 2 \
        + [True] * 2
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(9))]
    optimizer = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))
    freeze_variance(optimizer, 2, thawed=schedule.refresh_window)
    moved = []
    for step in range(8):
        before = optimizer.state[params[0]]["exp_avg_sq"].clone() if optimizer.state[params[0]] else None
        _step(optimizer, [torch.randn_like(p) * 0.5 for p in params])
        after = optimizer.state[params[0]]["exp_avg_sq"]
        moved.append(before is None or not torch.equal(before, after))
    assert moved == [True, True, False, False, True, True, False, False]


def test_refresh_windows_need_a_frozen_moment_and_fit_between_each_other():
    from higgs_megatron.config import HiggsConfig
    from higgs_megatron.grad_paths import DensitySchedule

    with pytest.raises(ValueError, match="needs freeze_adam_variance"):
        HiggsConfig(dense_iters=10, variance_refresh_iters=5)
    with pytest.raises(ValueError, match=r"variance_refresh_iters \(11\) must be at most dense_iters \(10\)"):
        HiggsConfig(dense_iters=10, freeze_adam_variance=True, variance_refresh_iters=11)
    windows = DensitySchedule.of(HiggsConfig(dense_iters=240, freeze_adam_variance=True, variance_refresh_iters=20))
    assert [step for step in range(2400) if windows.refresh_window(step)] == \
        list(range(480, 500)) + list(range(960, 980)) + list(range(1920, 1940))
