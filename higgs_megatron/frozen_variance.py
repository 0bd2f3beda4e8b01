"""Adam with its second moment frozen: the optimizer stage that error feedback needs at low density.

Why. Error feedback sends, late and all at once, gradient mass that top-k held back: a
coordinate picked once every ~1/density steps arrives as one burst of the gradients it
accumulated. Adam divides each coordinate by the root of its recent squared gradients, so a
burst is flattened to a few learning-rate steps whatever its size (with beta2 = 0.95, about
six), while dense Adam would have moved it once per step: error feedback conserves the mass
and Adam throws it away: error feedback alone ends well above dense, worse than no feedback
at all (the measurements: ``docs/experiments/convergence.md``).

The remedy is 1-bit Adam's (Tang et al., ICML 2021): train the first ``freeze_step`` steps
densely with plain Adam, then keep its bias-corrected second moment fixed. From there the
update, ``lr * m / (sqrt(v_frozen) + eps)`` with ``m`` the usual first moment, is linear in
the gradient, so a burst moves its coordinate exactly as far as the steps it stands for
would have, and error feedback is exact again.

The price of linearity is Adam's self-limiting step: with the second moment fixed, gradients
that grow (a loss spike) move the weights further, which makes the gradients grow again,
and longer runs without a cap became unstable. So the frozen update is capped as Adafactor
caps its own (Shazeer & Stern, 2018, update clipping with d = 1): per parameter,
``u = m_hat / (sqrt(v_frozen) + eps)`` is scaled down to an RMS of ``MAX_UPDATE_RMS`` when its
RMS is larger. "Parameter" is the tensor this optimizer holds:
with the distributed optimizer or tensor parallelism, this rank's shard of it (each shard
has one owner, so replicas stay identical, but where a tensor is cut depends on the layout).
A burst of error feedback touches a small fraction of a tensor's coordinates and usually
stays below the cap, so bursts remain linear; a tensor whose whole gradient blows up is held
to Adam's usual step size. In a small model, where one selected coordinate is a larger share
of a small tensor, the cap binds more often and costs a little loss.

Only at low density. The flattening grows with a burst's length, about 1/density steps; the
frozen moment's costs do not: it is an estimate of about twenty squared gradients per
coordinate (beta2 = 0.95) kept for hundreds of steps, where live Adam redraws it every step,
and it keeps the gradients' scale of the moment it froze. At 1% a burst stands for a hundred
steps and freezing is what makes error feedback work; at 25% (the lean schedule of
``scripts/bench_convergence.py``) a burst is a few steps long, and Adam as it is did as well
as frozen Adam on one model and better on another (``docs/experiments/convergence.md``).

A second moment frozen early (at the end of the learning-rate warm-up, for a short dense
stage) keeps the gradients' scale of then, and as they shrink every later step is too short.
So it can be thawed for a few steps at a time (``thawed``; 0/1 Adam's variance refresh, Lu et
al., 2022): torch's Adam runs those steps, on densely synced gradients, and the second moment
moves as it would have.

A coordinate whose second moment is exactly zero when it freezes had no gradient in the
whole dense stage (an untied embedding row of a token not yet seen): it has no scale to
keep, and dividing by ``eps`` would move it ``lr * m / eps`` on its first gradient. So on the
first frozen step, and only then, such coordinates are set to their tensor's mean second
moment; that is the one write to ``exp_avg_sq`` after the dense stage, and a checkpoint
taken later carries it.

How. ``freeze_variance(torch_optimizer, freeze_step)`` replaces the optimizer's ``step`` on
that instance. A parameter whose Adam ``step`` count is below ``freeze_step`` takes torch's
own update (bitwise the same as without this); one at or past it takes the frozen update,
which leaves ``exp_avg_sq`` untouched (its zeros aside, above). So the frozen moment is what
``exp_avg_sq`` held after step ``freeze_step``, and it is saved, loaded and resharded as the ordinary optimizer state
it is: a resumed run needs nothing else. Only torch's ``AdamW`` (what megatron-core uses
without Transformer Engine or Apex) is supported; anything else is refused.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

SUPPORTED = (torch.optim.AdamW,)
MAX_UPDATE_RMS = 1.0  # Adafactor's d: the RMS of one parameter's frozen update, lr aside


def check_supported(torch_optimizer: torch.optim.Optimizer, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``torch_optimizer`` can be frozen."""
    if type(torch_optimizer) not in SUPPORTED:
        raise ValueError(f"{flag} needs Adam (torch.optim.AdamW); this run's optimizer is "
                         f"{type(torch_optimizer).__module__}.{type(torch_optimizer).__name__}")
    for group in torch_optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            raise ValueError(f"{flag} does not support AdamW with amsgrad or maximize")


def freeze_variance(torch_optimizer: torch.optim.Optimizer, freeze_step: int,
                    thawed: Callable[[int], bool] | None = None, first_moment_given: bool = False) -> None:
    """From Adam step ``freeze_step`` on, update with the second moment of that step (see the
    module docstring); ``thawed(step)``: whether the update from ``step`` (0-based, the updates
    done before it) takes torch's own Adam after all, which moves the second moment (the
    refresh windows of ``grad_paths.DensitySchedule.refresh_window``). Only this instance's ``step`` is
    replaced: torch pickles an optimizer without it, so a copy made that way is plain AdamW
    until frozen again. ``first_moment_given``: a frozen step's gradient is the first moment
    itself (1-bit Adam's exchange, ``first_moment``): it replaces ``exp_avg`` instead of being
    averaged into it."""
    check_supported(torch_optimizer, "freeze_variance")
    torch_optimizer._higgs_freeze_step = freeze_step
    torch_optimizer._higgs_first_moment_given = first_moment_given
    torch_optimizer._higgs_thawed = thawed or (lambda step: False)
    torch_optimizer.step = types.MethodType(_step, torch_optimizer)


def _step(self: torch.optim.Optimizer, closure=None):
    assert closure is None, "frozen-variance Adam takes no closure"
    adam_step = type(self).step
    frozen = _frozen_params(self)
    if not frozen:
        return adam_step(self)
    saved = [(group, group["params"]) for group in self.param_groups]
    try:  # torch's update for the params not yet frozen, ours for the rest
        for group in self.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in frozen]
        if any(group["params"] for group in self.param_groups):
            adam_step(self)
    finally:
        for group, params in saved:
            group["params"] = params
    _frozen_step(self, frozen)


def _frozen_params(torch_optimizer: torch.optim.Optimizer) -> set[int]:
    """ids of the params with a gradient whose Adam step count has reached ``freeze_step``,
    outside the thawed steps."""
    freeze_step, thawed = torch_optimizer._higgs_freeze_step, torch_optimizer._higgs_thawed
    frozen = set()
    for group in torch_optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or "step" not in torch_optimizer.state.get(p, {}):
                continue
            step = int(torch_optimizer.state[p]["step"])
            if step >= freeze_step and not thawed(step):
                frozen.add(id(p))
    return frozen


@torch.no_grad()
def _frozen_step(torch_optimizer: torch.optim.Optimizer, frozen: set[int]) -> None:
    """AdamW's update with ``exp_avg_sq`` read, never written, bias-corrected as of
    ``freeze_step``. Per parameter group, as torch's AdamW."""
    freeze_step = torch_optimizer._higgs_freeze_step
    for group in torch_optimizer.param_groups:
        params = [p for p in group["params"] if id(p) in frozen]
        if not params:
            continue
        beta1, beta2 = group["betas"]
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        states = [torch_optimizer.state[p] for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        steps = [int(s["step"]) + 1 for s in states]  # this update's Adam step, read once
        for s, step in zip(states, steps):
            if step == freeze_step + 1:  # freezing now: zeros have no scale to keep
                v = s["exp_avg_sq"]
                v.masked_fill_(v == 0, v.mean())
            s["step"] += 1
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        if torch_optimizer._higgs_first_moment_given:
            torch._foreach_copy_(exp_avgs, grads)
        else:
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        denominators = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
        torch._foreach_div_(denominators, (1 - beta2 ** freeze_step) ** 0.5)
        torch._foreach_add_(denominators, eps)
        updates = denominators  # m / (sqrt(v) + eps), in the denominators' memory
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, exp_avgs)
        for p, step, update, norm in zip(params, steps, updates, torch._foreach_norm(updates)):
            bias_correction = 1 - beta1 ** step
            # u = m_hat / (sqrt(v_hat) + eps), scaled down to an RMS of MAX_UPDATE_RMS if above it
            over_cap = norm.div_(bias_correction * MAX_UPDATE_RMS * update.numel() ** 0.5).clamp_(min=1.0)
            p.add_(update.div_(over_cap), alpha=-lr / bias_correction)
