"""KeptExpertBias: the routing bias Megatron moves after each sync counts once per step taken."""

import torch

from higgs_megatron.expert_bias import KeptExpertBias


class _Router(torch.nn.Module):
    def __init__(self, values):
        super().__init__()
        self.register_buffer("expert_bias", torch.tensor(values))


def _model():
    return torch.nn.ModuleDict({"a": _Router([0.0, 0.0]), "b": _Router([1.0, -1.0]), "dense": torch.nn.Linear(2, 2)})


def _megatron_moves(model, by=0.5):
    """What finalize_model_grads does after the sync: each bias moves."""
    for name in ("a", "b"):
        model[name].expert_bias.add_(by)


def test_a_step_taken_keeps_the_move_and_one_not_taken_puts_it_back():
    model = _model()
    kept = KeptExpertBias(model)
    assert len(kept.biases) == 2
    kept.stage(taken=0)  # the sync of iteration 1 finished
    _megatron_moves(model)
    kept.settle(taken=1)  # the optimizer stepped: iteration 2's forward keeps the move
    assert model["a"].expert_bias.tolist() == [0.5, 0.5]
    kept.stage(taken=1)
    _megatron_moves(model)
    kept.settle(taken=1)  # no step since (the iteration runs again, or its step was skipped)
    assert model["a"].expert_bias.tolist() == [0.5, 0.5] and model["b"].expert_bias.tolist() == [1.5, -0.5]


def test_an_iteration_synced_twice_moves_the_bias_once():
    model = _model()
    kept = KeptExpertBias(model)
    for _ in range(2):  # Megatron-LM's rerun: forward, sync, Megatron's move; twice before one step
        kept.settle(taken=0)
        kept.stage(taken=0)
        _megatron_moves(model)
    kept.settle(taken=1)
    assert model["a"].expert_bias.tolist() == [0.5, 0.5]


def test_the_kept_copy_follows_the_routers_dtype():
    """The router keeps its bias in fp32 by swapping .data: the copy is taken at each stage."""
    model = _model()
    kept = KeptExpertBias(model)
    model["a"].expert_bias.data = model["a"].expert_bias.data.to(torch.float64) + 1e-12
    kept.stage(taken=0)
    _megatron_moves(model)
    kept.settle(taken=0)
    assert model["a"].expert_bias.dtype == torch.float64 and model["a"].expert_bias.tolist() == [1e-12, 1e-12]


def test_a_model_without_experts_holds_nothing():
    kept = KeptExpertBias(torch.nn.Linear(2, 2))
    kept.stage(taken=0)
    assert kept.pending is None and not kept.biases
