"""The distributed optimizer's parameter all-gather sent as changes (``reduce.param_gather``), on
real gloo ranks without a model: every rank ends each step with the same bytes, the owner's
reference is what the others hold, and the parameters trail the exact values by a bounded gap
(error feedback through the reference: the rounding of one step is sent by the next)."""

import pytest
import torch

from higgs_megatron.reduce.param_gather import change_row_bytes
from higgs_megatron_bench.ranks import run_ranks
from tests.workers.wire import param_changes_over_steps


@pytest.mark.parametrize("payload", ["int8", "int4", "sign"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_rank_holds_the_same_parameters_and_they_trail_the_exact_ones(payload, dtype):
    steps, world = 40, 3
    outs = run_ranks(param_changes_over_steps, world, args=(payload, steps, dtype), timeout=120)
    for step in range(steps):
        for out in outs[1:]:
            assert torch.equal(out["buffers"][step], outs[0]["buffers"][step]), f"ranks differ after step {step}"
    for out in outs:
        assert torch.equal(out["agreed"], out["mine"]), "the owner's reference is not what every rank holds"
        # Not lost, only late: the gap stays within a few of the largest steps however long the run
        # (without the reference's feedback a sign's gap grows with every step).
        bound = {"int8": 0.05, "int4": 0.3, "sign": 8.0}[payload] * max(out["largest"])
        assert max(out["gaps"][steps // 2:]) <= bound, (payload, max(out["gaps"]), bound)
        # what the meter counted of the tensors handed in: each owner's row, (P - 1) of them a step, of
        # about bits + 32 / 64 bits a parameter (a scale per 64), padding included
        bits = {"int8": 8, "int4": 4, "sign": 1}[payload] + 0.5
        assert out["wire"] == pytest.approx(steps * (world - 1) * change_row_bytes(1000, payload))
        assert 1000 * bits / 8 <= change_row_bytes(1000, payload) <= 1000 * bits / 8 + 12
