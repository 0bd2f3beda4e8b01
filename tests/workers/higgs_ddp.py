"""Rank functions for tests/sync/drill_higgs_ddp.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations

import copy

import torch

from tests.workers.common import parameters, train_variants


def staged_sync(variants: dict[str, list[str]]) -> dict:
    """``train_variants``, recording per step of the last variant the bytes sent, the dense
    bytes and a checksum of Adam's second moment after the step."""
    from higgs_megatron.checkpoint.state import torch_optimizers
    from higgs_megatron.training.loop import Trainer

    sent, dense, variance = [], [], []
    original_step = Trainer.train_step

    def recording_step(self):
        result = original_step(self)
        if self.args.use_higgs:
            stats = self.model[0].take_stats()
            sent.append(stats.bytes_sent)
            dense.append(stats.dense_bytes)
            variance.append(sum(float(state["exp_avg_sq"].double().sum())
                                for _, optimizer in torch_optimizers(self.optimizer)
                                for state in optimizer.state.values()))
        return result

    Trainer.train_step = recording_step
    try:
        out = train_variants(variants)
    finally:
        Trainer.train_step = original_step
    return {**out, "bytes_sent": sent, "dense_bytes": dense, "variance_after": variance}


def nan_on_one_rank(argv: list[str], bad_rank: int, bad_iteration: int) -> dict:
    """Put a NaN into one rank's gradients at one iteration; report what every rank did."""
    import torch.distributed as dist

    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv)
    with training_environment(args):
        trainer = Trainer(args)
        ddp = trainer.model[0]
        original = HiggsBucketGroup.start_grad_sync

        def poisoned(group, *a, **k):
            if dist.get_rank() == bad_rank and trainer.iteration + 1 == bad_iteration:
                group.buckets[0].grad_data[0] = float("nan")
            return original(group, *a, **k)

        history = []
        HiggsBucketGroup.start_grad_sync = poisoned
        try:
            for _ in range(args.train_iters):
                before = (parameters(trainer), ddp.residual_state())
                ok, loss, grad_norm = trainer.train_step()
                trainer.iteration += 1
                trainer.consumed_samples += args.global_batch_size
                after = (parameters(trainer), ddp.residual_state())
                history.append({
                    "ok": ok, "loss": loss,
                    "params_unchanged": all(torch.equal(before[0][n], after[0][n]) for n in before[0]),
                    "residuals_unchanged": all(torch.equal(before[1][n], after[1][n]) for n in before[1]),
                })
        finally:
            HiggsBucketGroup.start_grad_sync = original
        out = {"history": history, "skipped": trainer.optimizer.skipped_steps}
        trainer.close()
    return out


def resume_continuity(argv: list[str], split_at: int) -> dict:
    """Losses of an uninterrupted run vs one that saves state at ``split_at`` and resumes in a
    freshly built trainer (state_dict -> load_state_dict, same layout)."""
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv)
    with training_environment(args):
        straight = Trainer(args)
        straight_losses = straight.train().losses
        straight_params = parameters(straight)
        straight.close()

        first = Trainer(args)
        first.args = copy.copy(args)
        first.args.train_iters = split_at
        first_losses = first.train().losses
        state = first.state_dict()
        first.close()
        second = Trainer(args)
        second.load_state_dict(state)
        second_losses = second.train().losses
        resumed_params = parameters(second)
        second.close()
    return {"straight": straight_losses, "resumed": {**first_losses, **second_losses},
            "params_equal": all(torch.equal(straight_params[n], resumed_params[n]) for n in straight_params)}


def owner_sum_invariants(argv: list[str]) -> dict:
    """Train on a form whose shard owners sum (``--higgs-sync agreed`` or ``sharded``,
    ``--clip-grad 0`` so the optimizer leaves the summed gradient as the sync wrote it); after
    each step, per compressed bucket, sum over the DP group what every rank accumulated and what
    it kept as residual: the gradient applied (the same on every rank; with the distributed
    optimizer each rank's shard of it) plus the residuals must be the accumulated gradients, to
    float summation's rounding (what an owner does not send of its sums is in its owner residual).
    Returns the worst relative gap, the compressed steps, and this rank's parameters and
    coordinates."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from higgs_megatron.compress.compressor import ResidualBuffer
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer
    from tests.workers.common import coordinates

    args = parse_args(argv)
    accumulated: dict[int, torch.Tensor] = {}
    original = ResidualBuffer.accumulate

    def recording(self, grad, kept=True):
        original(self, grad, kept)
        accumulated[id(self)] = grad.clone()

    gaps, compressed_steps = [], 0
    with training_environment(args):
        trainer = Trainer(args)
        ddp = trainer.model[0]
        dp_group = ps.get_data_parallel_group()
        ResidualBuffer.accumulate = recording
        try:
            for _ in range(args.train_iters):
                accumulated.clear()
                # an agreed owner adds what it kept of its sums to the next ones: mass the ranks hold too
                owners_before = {id(owner): owner.current.clone() for group in ddp.bucket_groups
                                 for owner in group.higgs_owner_residuals if owner is not None}
                trainer.train_step()
                trainer.iteration += 1
                trainer.consumed_samples += args.global_batch_size
                compressed_steps += ddp.take_stats().sparse_buckets > 0
                for group in ddp.bucket_groups:
                    for bucket, residual, owner in zip(group.buckets, group.higgs_residuals,
                                                       group.higgs_owner_residuals):
                        if residual is None or id(residual) not in accumulated:
                            continue
                        acc, left = accumulated[id(residual)].double(), residual.current.double()
                        if owner is not None:  # an agreed owner's rounding, over its shard's coordinates
                            size = owner.current.numel() - 1  # its last coordinate is where padding writes 0
                            lo = min(dist.get_rank(dp_group) * size, left.numel())
                            n = min(size, left.numel() - lo)
                            left.narrow(0, lo, n).add_(owner.current.double().narrow(0, 0, n))
                            acc.narrow(0, lo, n).add_(owners_before[id(owner)].double().narrow(0, 0, n))
                        dist.all_reduce(acc, group=dp_group)
                        dist.all_reduce(left, group=dp_group)
                        applied = bucket.grad_data.double()
                        if args.use_distributed_optimizer:  # each rank holds its shard's sums: put them together
                            size, rank = applied.numel() // dp_group.size(), dist.get_rank(dp_group)
                            mine = applied.narrow(0, rank * size, size).clone()
                            applied.zero_().narrow(0, rank * size, size).copy_(mine)
                            dist.all_reduce(applied, group=dp_group)
                        gaps.append(float((applied + left - acc).abs().max() / acc.abs().max()))
        finally:
            ResidualBuffer.accumulate = original
        out = {"gaps": gaps, "compressed_steps": compressed_steps, "coords": coordinates(), "params": parameters(trainer)}
        trainer.close()
    return out


def check_owner_sum_invariants(outs: list[dict]) -> None:
    """``owner_sum_invariants``' verdict over every rank: at least three compressed steps, the
    gradient conserved over the group to 1e-6 at each, and DP replicas bitwise equal."""
    by_shard = {}
    for out in outs:
        assert out["compressed_steps"] >= 3 and out["gaps"] and max(out["gaps"]) < 1e-6, out["gaps"]
        by_shard.setdefault((out["coords"]["tp"], out["coords"]["pp"]), []).append(out["params"])
    for shard, replicas in by_shard.items():
        for name, value in replicas[0].items():
            assert torch.equal(value, replicas[1][name]), f"DP replicas differ at {name} (tp, pp) = {shard}"
