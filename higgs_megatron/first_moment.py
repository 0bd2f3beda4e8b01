"""1-bit Adam's exchange: each data-parallel rank sends its own view of Adam's first moment.

Why. After the dense stage a compressed step sends every coordinate as a sign with one scale a
span (``compress.agreed``'s ``sign`` rows), its error kept in the error-feedback residual. Sent
as the sign of each rank's *gradient*, the error is that of a noisy 1/P of the batch, and the
sum carries it into Adam's first moment step after step. 1-bit Adam (Tang et al., 2021) sends
each rank's *momentum* instead, ``m_i = beta m + (1 - beta) g_i``: most of it is the first
moment ``m`` every rank already holds, so its sign is mostly the moment's and the error is
small beside it, whatever P is. The sum over the ranks is the next first moment.

How, with Megatron's loop and optimizer unchanged:

* **The sync** (``HiggsBucketGroup`` in a compressed step of ``sync='onebit'``): before any path
  reads a bucket, ``to_local_momentum`` turns this rank's gradient (already pre-scaled by
  Megatron for the group's sum) into its share of the next moment, ``(1 - beta) g + share x beta
  m``, where ``share`` makes the ranks' shares of ``beta m`` add up to ``beta m``. Every path
  sums (the sign rows, and Megatron's own all-reduce for a bucket that stays dense), so every
  bucket ends holding ``beta m + (1 - beta) mean(g)``, less what the signs left in the residuals.
* **The optimizer** (``frozen_variance`` with ``first_moment_given``): Adam's second moment is
  frozen from the end of the dense stage, and a frozen step takes the synced gradient as its
  first moment, not averaging it in again. Megatron's gradient clipping, when on, clips that
  moment: the size of the update.
* **Where ``m`` comes from** (``FirstMoments``): Adam's own ``exp_avg``, added per parameter into
  the bucket at each compressed step (one fused add on the device). The sync keeps no moment
  of its own, so checkpoints, reshards and heals carry it as the optimizer state it is.
* **Sums after the sync**: Megatron sums some gradients again once the sync is done (the tied
  embedding over two pipeline stages, layer norms over the TP ranks under sequence
  parallelism); each copy then carries 1/copies of the moment (``copies_summed_after_sync``).

* **With the distributed optimizer** a rank holds Adam's state of its own shard only. The owners'
  re-signed sums are gathered back to every rank in the compressed steps (1/28 of an fp32
  all-reduce's bytes), and each rank keeps them (``FirstMoments.held``, a bucket's size in fp32)
  to make its next share; each owner corrects the sum on its shard to Adam's exact moment.

Not with elastic replicas, several optimizer instances, or optimizer state offloaded to the
host: each is refused before any process group exists (``runtime.run_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MomentSlot:
    """One parameter's place in a bucket, and where Adam keeps its state."""

    start: int  # the parameter's gradient in its bucket: [start, end)
    end: int
    optimizer: torch.optim.Optimizer  # the torch optimizer that steps it
    main_param: torch.Tensor  # the parameter that optimizer holds (a model param, or its fp32 main copy)
    summed_by: int = 1  # the copies Megatron sums after the sync (``copies_summed_after_sync``)


class FirstMoments:
    """Adam's first moment of every parameter of one model chunk's buckets, by (bucket group
    index, bucket index); made by the optimizer wrapper, which knows the main parameters.

    ``sharded`` (the distributed optimizer): a rank holds Adam's state of its own shard only, so
    ``slots`` are the pieces of its shard, and the rest of the moment comes from ``held``, the
    bucket's last synced moment (``hold``: the owners' re-signed sums, gathered back, the same
    bytes on every rank). Every rank adds its share of ``held``; each owner adds, for its own
    shard only, the difference between Adam's exact moment and ``held``. The sum is Adam's moment
    whatever ``held`` is (clipped moments, sums Megatron makes after the sync, a resumed run
    that has none yet): ``held`` only makes each rank's signs those of the moment."""

    def __init__(self, slots: dict[tuple[int, int], list[MomentSlot]], beta: float, sharded: bool = False) -> None:
        self.slots, self.beta, self.sharded = slots, beta, sharded
        # [start, end) over a bucket's slots: this rank's shard under ``sharded`` (the buffer's
        # padding between its pieces is 0 in every synced bucket, so one op covers the pieces)
        self._spans = {key: (min(s.start for s in entries), max(s.end for s in entries))
                       for key, entries in slots.items() if entries}
        self.held: dict[tuple[int, int], torch.Tensor] = {}  # the last synced moment, by bucket (``hold``)

    def to_local_momentum(self, key: tuple[int, int], grad: torch.Tensor, share: float, average_over: int = 1) -> None:
        """``grad = (1 - beta) grad + share x beta x exp_avg / copies`` in place, for the bucket
        ``key``: a parameter whose copies Megatron sums after the sync takes its share of the
        moment once over them all. A parameter Adam has not stepped yet has no moment and adds
        nothing. ``sharded``: ``share x beta x held``, and on this rank's shard
        ``average_over x beta x (exp_avg / copies - held)`` (the paths divide the sum by
        ``average_over``). No host sync: a scale and fused adds."""
        grad.mul_(1 - self.beta)
        held = self.held.get(key)
        own_weight = average_over if self.sharded else share
        if held is not None and key in self._spans:
            lo, hi = self._spans[key]
            grad.add_(held, alpha=share * self.beta)
            grad.narrow(0, lo, hi - lo).sub_(held.narrow(0, lo, hi - lo), alpha=own_weight * self.beta)
        by_copies: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for slot in self.slots[key]:
            exp_avg = slot.optimizer.state.get(slot.main_param, {}).get("exp_avg")
            if exp_avg is not None:
                views, moments = by_copies.setdefault(slot.summed_by, ([], []))
                views.append(grad.narrow(0, slot.start, slot.end - slot.start))
                moments.append(exp_avg.view(-1))
        for copies, (views, moments) in by_copies.items():
            torch._foreach_add_(views, moments, alpha=own_weight * self.beta / copies)

    def hold(self, key: tuple[int, int], synced: torch.Tensor) -> None:
        """Keep the bucket's synced moment (the same bytes on every rank) for the next step's shares."""
        if key in self.held:
            self.held[key].copy_(synced)
        else:
            self.held[key] = synced.detach().clone()

    def release(self) -> None:
        """Forget what is held (a dense step moved Adam's moment on; a dropped step, a load): the
        next compressed step's shares take the owners' moments alone."""
        self.held.clear()


def copies_summed_after_sync(param: torch.nn.Parameter, name: str, config, tp_size: int, embedding_size: int) -> int:
    """How many copies of ``param``'s synced gradient Megatron's ``finalize_model_grads`` sums
    after the data-parallel sync: the tied word embedding's over the first and last pipeline
    stages (``shared_embedding``), a layer norm's over the tensor-parallel ranks under sequence
    parallelism or ``qk_layernorm``. Each copy holds a share of the moment, so each must hold
    1/copies of it. (Averaged copies, ``average_gradients_across_tp_domain``, need nothing.)"""
    copies = embedding_size if getattr(param, "shared_embedding", False) else 1
    if (getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False)) or (
            getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)):
        copies *= tp_size
    return copies


def main_params(megatron_optimizer, torch_optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, torch.Tensor]:
    """model param -> the parameter ``torch_optimizer`` steps for it: its fp32 main copy under
    Megatron's mixed-precision optimizer (``float16_groups`` beside ``fp32_from_float16_groups``),
    itself otherwise."""
    mapping = {p: p for group in torch_optimizer.param_groups for p in group["params"]}
    for model_group, main_group in zip(getattr(megatron_optimizer, "float16_groups", []),
                                       getattr(megatron_optimizer, "fp32_from_float16_groups", [])):
        mapping.update(zip(model_group, main_group))
    return mapping


def shard_pieces(megatron_optimizer, torch_optimizer: torch.optim.Optimizer
                 ) -> dict[torch.Tensor, tuple[torch.Tensor, int, int]]:
    """Megatron's distributed optimizer: model param -> (the main parameter ``torch_optimizer``
    steps for this rank's piece of it, and that piece's [start, end) in its bucket), for the
    parameters this rank holds a piece of."""
    pieces = {}
    for model_param, (group_index, order) in megatron_optimizer.model_param_group_index_map.items():
        gbuf_index, dtype, bucket_id = megatron_optimizer.model_param_gbuf_map[model_param]
        world = megatron_optimizer.gbuf_ranges[gbuf_index][dtype][bucket_id]["param_map"][model_param][
            "gbuf_world_in_bucket"]
        pieces[model_param] = (torch_optimizer.param_groups[group_index]["params"][order], world.start, world.end)
    return pieces


def adam_beta1(torch_optimizers: list[torch.optim.Optimizer]) -> float:
    """The first-moment decay every parameter group of every optimizer shares (ValueError if
    they differ: the ranks' shares of the moment are made with one)."""
    betas = {group["betas"][0] for optimizer in torch_optimizers for group in optimizer.param_groups}
    if len(betas) != 1:
        raise ValueError(f"--higgs-sync onebit needs one Adam beta1 for every parameter group, got {sorted(betas)}")
    return betas.pop()
