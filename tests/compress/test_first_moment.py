"""1-bit Adam's exchange (``first_moment``): a rank's share of the next first moment, and the
frozen step that takes the synced sum as Adam's first moment."""

import torch

from higgs_megatron.first_moment import FirstMoments, MomentSlot, adam_beta1
from higgs_megatron.frozen_variance import freeze_variance


def _adam(params, beta1=0.9):
    return torch.optim.AdamW(params, lr=1e-2, betas=(beta1, 0.95), weight_decay=0.0)


def test_the_ranks_shares_sum_to_the_next_first_moment():
    """P ranks' ``(1 - beta) g_i + beta m / P``, summed, are Adam's next first moment of the mean
    gradient (the gradients pre-scaled by 1/P, as Megatron hands them to a summing collective)."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, generator=generator)), torch.nn.Parameter(torch.randn(3, generator=generator))
    optimizer = _adam([a, b])
    a.grad, b.grad = torch.randn(5, generator=generator), torch.randn(3, generator=generator)
    optimizer.step()  # Adam now holds a first moment
    moment = torch.cat([optimizer.state[a]["exp_avg"], optimizer.state[b]["exp_avg"]])
    moments = FirstMoments({(0, 0): [MomentSlot(0, 5, optimizer, a), MomentSlot(6, 9, optimizer, b)]},
                           adam_beta1([optimizer]))
    world, grads = 4, [torch.randn(10, generator=generator) for _ in range(4)]
    total = torch.zeros(10)
    for grad in grads:
        local = grad / world
        moments.to_local_momentum((0, 0), local, 1 / world)
        total += local
    mean = torch.stack(grads).mean(0)
    expected = 0.1 * mean
    expected[:5] += 0.9 * moment[:5]
    expected[6:9] += 0.9 * moment[5:]
    torch.testing.assert_close(total, expected)  # coordinate 5 (padding) holds only its gradient's share


def test_a_frozen_step_given_the_first_moment_takes_it_as_exp_avg():
    generator = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(8, generator=generator))
    optimizer = _adam([p])
    freeze_variance(optimizer, 1, first_moment_given=True)
    p.grad = torch.randn(8, generator=generator)
    optimizer.step()  # step 1: Adam's own
    v = optimizer.state[p]["exp_avg_sq"].clone()
    moment = torch.randn(8, generator=generator)
    p.grad = moment.clone()
    before = p.detach().clone()
    optimizer.step()  # frozen: the gradient is the first moment
    assert torch.equal(optimizer.state[p]["exp_avg"], moment) and torch.equal(optimizer.state[p]["exp_avg_sq"], v)
    update = moment / (1 - 0.9 ** 2) / ((v / (1 - 0.95)).sqrt() + 1e-8)
    scale = max(1.0, float(update.norm()) / 8 ** 0.5)  # the frozen update's RMS cap
    torch.testing.assert_close(p.detach(), before - 1e-2 * update / scale)


def test_copies_summed_after_the_sync_share_the_moment():
    """Megatron sums the tied embedding's synced gradient over the pipeline's first and last
    stage, and layer norms' over the TP ranks under sequence parallelism or qk_layernorm: each
    copy must carry 1/copies of the moment."""
    from types import SimpleNamespace

    from higgs_megatron.first_moment import copies_summed_after_sync

    plain = torch.nn.Parameter(torch.zeros(2))
    tied = torch.nn.Parameter(torch.zeros(2))
    tied.shared_embedding = True
    norm = torch.nn.Parameter(torch.zeros(2))
    norm.sequence_parallel = True
    sp, no_sp = SimpleNamespace(sequence_parallel=True), SimpleNamespace(sequence_parallel=False)
    assert copies_summed_after_sync(plain, "decoder.layers.0.mlp.linear_fc1.weight", sp, 4, 2) == 1
    assert copies_summed_after_sync(tied, "embedding.word_embeddings.weight", no_sp, 4, 2) == 2
    assert copies_summed_after_sync(norm, "decoder.layers.0.input_layernorm.weight", sp, 4, 2) == 4
    assert copies_summed_after_sync(norm, "decoder.layers.0.input_layernorm.weight", no_sp, 4, 2) == 1
    qk = SimpleNamespace(sequence_parallel=False, qk_layernorm=True)
    assert copies_summed_after_sync(plain, "decoder.layers.0.self_attention.q_layernorm.weight", qk, 2, 1) == 2
