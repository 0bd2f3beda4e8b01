"""The agreed-mask sync (``--higgs-sync agreed``): its pure planning, in one process (the
multi-process runs against Megatron's DDP: ``test_owner_forms.py``)."""

import pytest
import torch

from higgs_megatron.compress.agreed import AgreedPlan, pack_rows, unpack_rows
from higgs_megatron.compress.compressor import ParamSlot

CPU = torch.device("cpu")
# A weight across three of four shards, a bias (sent whole), a small gap, a second weight.
SLOTS = [ParamSlot(0, 1000), ParamSlot(1000, 1010), ParamSlot(1024, 5000), ParamSlot(5000, 5003)]


def test_rows_hold_each_owners_shard_and_density_one_covers_every_parameter_once():
    """Row j holds coordinates of shard j only; the rows and the always-sent coordinates
    together cover every parameter's coordinate once and nothing else."""
    plan = AgreedPlan(5003, SLOTS, 64, 4, CPU, "int4")
    assert plan.shard == 1251 and [p.owner for p in plan.pieces] == [0, 0, 1, 2, 3]
    scores = plan.scores(torch.randn(5003, generator=torch.Generator().manual_seed(0)))
    for density in (0.1, 0.5, 1.0):
        positions, real = plan.select(scores, density)
        assert positions.shape == (4, plan.layout(density).width)
        for owner in range(4):  # every slot points into its owner's shard (padding too)
            assert bool(((positions[owner] // plan.shard) == owner).all())
        assert torch.equal(plan.select(scores.clone(), density)[0], positions)  # same scores, same rows
    sent = torch.cat([positions[real], plan.always_positions])  # the bias goes by an all-reduce of its own
    covered = torch.zeros(5003, dtype=torch.long).index_add_(0, sent, torch.ones_like(sent))
    in_params = torch.zeros(5003, dtype=torch.bool)
    for slot in SLOTS:
        in_params[slot.start:slot.end] = True
    assert bool((covered[in_params] == 1).all()) and bool((covered[~in_params] == 0).all())


def test_selection_follows_the_agreed_scores():
    plan = AgreedPlan(4096, [ParamSlot(0, 4096)], 64, 1, CPU)
    x = torch.zeros(4096)
    x[1000] = 5.0  # block 7 (coordinates 896..1023)
    positions, real = plan.select(plan.scores(x), 1 / 32)
    assert plan.layout(1 / 32).k_blocks == [1] and sorted(positions[0].tolist()) == list(range(896, 1024))


@pytest.mark.parametrize("value_format", ["wide", "bf16", "int8", "int4"])
def test_rows_decode_to_what_pack_rounded(value_format):
    values = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    wire, rounded = pack_rows(values, value_format, 256)
    assert wire.dtype == torch.uint8 and wire.shape[1] % 4 == 0
    assert torch.equal(unpack_rows(wire, value_format, 300, 256, torch.float32), rounded)
    error = {"wide": 0.0, "bf16": 2 ** -8, "int8": 1 / 254, "int4": 1 / 14}[value_format]
    assert float((values - rounded).abs().max()) <= error * float(values.abs().max()) * 1.01


def test_signs_decode_to_what_pack_rounded_with_the_mean_magnitude_of_real_slots():
    """``sign``: one bit a slot and a scale per span, the mean magnitude of the span's real
    slots; padding (not real) carries nothing into a scale and decodes to 0 on both sides."""
    generator = torch.Generator().manual_seed(2)
    values = torch.randn(3, 4096, generator=generator)
    real = torch.rand(3, 4096, generator=generator) > 0.25
    values = torch.where(real, values, 0)
    wire, rounded = pack_rows(values, "sign", 256, real)
    assert wire.shape == (3, 4 * 16 + 4096 // 8)
    assert torch.equal(unpack_rows(wire, "sign", 4096, 256, torch.float32, real), rounded)
    assert bool((rounded[~real] == 0).all())
    for row in range(3):
        for span in range(16):
            cut = slice(span * 256, (span + 1) * 256)
            mask = real[row, cut]
            scale = values[row, cut][mask].abs().mean()
            torch.testing.assert_close(rounded[row, cut][mask], torch.where(values[row, cut][mask] >= 0, scale, -scale))


def test_a_sign_plan_sends_every_parameter_in_rows_of_whole_bytes_and_no_scores():
    plan = AgreedPlan(5003, SLOTS, 64, 4, CPU, "sign", scored=False)
    layout = plan.layout(1.0)
    assert layout.width % 8 == 0 and layout.span == min(256, layout.width)
    assert plan.score_bytes() == 0
    assert plan.row_bytes(1.0, torch.float32) == -(-(layout.width // 8 + 4 * layout.n_scales) // 4) * 4
