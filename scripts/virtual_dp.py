"""A virtual data-parallel group: P ranks in one process, for the loss at a P no machine here holds.

Each of P virtual ranks trains on its own global_batch/P samples (the pretrain script's own
data order: ``training.data.microbatch_indices`` at its DP rank) and keeps its own
error-feedback residuals and selector. Its gradient sync is HiggsDDP's own: a twin of every
bucket group (Megatron's buckets, with this rank's gradients) runs ``start_grad_sync`` and
``finish_grad_sync``, every path's code unchanged. The only thing replaced is where a
collective goes (``VirtualCollectives``, the sync's ``Collectives``): the n-th collective of
every rank meets the others' at a ``Hub`` and is computed there, sums in the order gloo's ring
adds them (``ring_sum``), so every rank receives the bytes it would over gloo. Each rank runs
in a thread of its own, one at a time: a rank runs until it waits for a collective.

One model and one optimizer serve all ranks: the replicas of a data-parallel group hold the
same parameters, so one copy of them, updated with the synced gradient, is every replica's
(the harness checks that every rank's synced gradient is the same bytes). The process joins
torch's fake group of P ranks (``fake_group``): Megatron builds its buckets as at P ranks.

What a step costs: the forward and backward passes of the global batch, as single-process
training on it, plus P ranks' compression. Loss, wire bytes and validation go to the pretrain
script's log line and ``--log-json``, as a real run writes them (``Trainer``'s own loop).

With the distributed optimizer each rank's sync leaves only its own shard of every bucket
reduced (Megatron's reduce-scatter, or the sharded form's owner sum): the model takes shard r
from rank r, and one optimizer over every parameter, Megatron's own non-distributed one,
stands for the P shards' optimizers (the same Adam, coordinate by coordinate).

Not covered: several optimizer instances, ``--higgs-sync auto`` and ``hierarchical`` (they
measure links and nodes the fake group does not have), pipeline or tensor parallelism (one
model stands for a replica), and a step skipped on a non-finite gradient (the optimizer's vote
sees no rank's flag).

    python scripts/virtual_dp.py --dp 64 [-- <pretrain flags, e.g. --use-higgs ... --log-json F>]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_group import fake_group  # noqa: E402
from higgs_megatron.compress.compressor import make_selector  # noqa: E402
from higgs_megatron.ddp import HiggsBucketGroup, HiggsDDP, SyncStats  # noqa: E402
from higgs_megatron.device import DeviceTimer  # noqa: E402
from higgs_megatron.reduce.wire import Collectives, StepWaits  # noqa: E402
from higgs_megatron.runtime.exits import UsageError, exit_status  # noqa: E402
from higgs_megatron.training.arguments import parse_args  # noqa: E402
from higgs_megatron.training.launch import training_environment  # noqa: E402
from higgs_megatron.training.loop import Trainer  # noqa: E402


class _Meeting:
    """One collective: every rank's arguments, and, once the last has come, every rank's result."""

    def __init__(self, kind: str, world: int) -> None:
        self.kind = kind
        self.inputs: list[torch.Tensor | None] = [None] * world
        self.results: list[torch.Tensor] | None = None
        self.collected = 0


class Hub:
    """Where P virtual ranks' collectives meet: the n-th call of every rank is one collective.
    Every rank issues the same calls in the same order (HiggsDDP's invariant), so the n-th
    calls are the same collective; a call of another kind is a broken invariant, reported."""

    def __init__(self, world: int) -> None:
        self.world = world
        # Re-entrant: a rank runs its whole sync holding it (``turn``), and its waits here release it.
        self._cond = threading.Condition(threading.RLock())
        self._meetings: dict[int, _Meeting] = {}
        self.failed: BaseException | None = None

    def arrive(self, rank: int, number: int, kind: str, input: torch.Tensor, op) -> "VirtualWork":
        with self._cond:
            meeting = self._meetings.setdefault(number, _Meeting(kind, self.world))
            if meeting.kind != kind:
                self.fail(RuntimeError(f"collective {number}: rank {rank} issued {kind}, another rank "
                                       f"{meeting.kind}"))
            meeting.inputs[rank] = input
            if all(x is not None for x in meeting.inputs):
                # Computed once, by the last to come, before any rank's wait returns: no input
                # has been written yet (an in-place all-reduce writes its input at its wait).
                meeting.results = _compute(kind, meeting.inputs, op)
                self._cond.notify_all()
        return VirtualWork(self, rank, number)

    def collect(self, rank: int, number: int) -> torch.Tensor:
        """Rank ``rank``'s result of collective ``number``, once every rank has issued it."""
        with self._cond:
            self._cond.wait_for(lambda: self.failed is not None or self._meetings[number].results is not None)
            if self.failed is not None:
                raise RuntimeError("another virtual rank failed") from self.failed
            meeting = self._meetings[number]
            result = meeting.results[rank]
            meeting.collected += 1
            if meeting.collected == self.world:
                del self._meetings[number]
            return result

    def turn(self) -> threading.Condition:
        """Held by a rank while it runs (``with hub.turn():``), released while it waits for a
        collective: one rank runs at a time, and none spins for the interpreter's lock (P
        threads contending for it made a step several times slower than the ranks' work)."""
        return self._cond

    def fail(self, error: BaseException) -> None:
        """A rank failed: every rank waiting here raises instead of waiting for ever."""
        with self._cond:
            self.failed = self.failed or error
            self._cond.notify_all()
        raise error


def ring_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``inputs`` (one per rank) added in the order gloo's ring all-reduce adds them,
    so that floating-point sums come out bit for bit as over gloo: the buffer is cut into P
    chunks of two segments of ceil(n / 2P) elements; chunk c starts at rank c-1 and travels
    down the ring, each rank adding its own values to what it received, and ends at rank c."""
    world, numel = len(inputs), inputs[0].numel()
    flat = [tensor.reshape(-1) for tensor in inputs]
    total = torch.empty_like(flat[0])
    chunk = 2 * -(-numel // (2 * world))
    for c in range(world):
        lo, hi = min(c * chunk, numel), min((c + 1) * chunk, numel)
        if hi > lo:
            part = total.narrow(0, lo, hi - lo)
            part.copy_(flat[(c - 1) % world].narrow(0, lo, hi - lo))
            for step in range(2, world + 1):
                torch.add(flat[(c - step) % world].narrow(0, lo, hi - lo), part, out=part)
    return total.view_as(inputs[0])


def _compute(kind: str, inputs: list[torch.Tensor], op) -> list[torch.Tensor]:
    """Every rank's result of one collective; sums as gloo's ring makes them (``ring_sum``)."""
    world = len(inputs)
    if kind in ("all_reduce", "reduce_scatter"):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(f"virtual {kind}: only SUM and AVG are computed here, not {op}")
        total = ring_sum(inputs)
        if op == dist.ReduceOp.AVG:
            total.div_(world)
        if kind == "all_reduce":
            return [total] * world
        return list(total.view(world, -1).unbind(0))
    if kind == "all_gather":
        return [torch.cat([tensor.reshape(-1) for tensor in inputs])] * world
    # all-to-all: part j of rank i's input goes to rank j, after rank i-1's
    parts = torch.stack([tensor.reshape(world, -1) for tensor in inputs])  # [source, destination, n]
    return [parts.select(1, rank).reshape(-1) for rank in range(world)]


class VirtualWork:
    """What an asynchronous virtual collective returns; ``wait`` writes this rank's result."""

    def __init__(self, hub: Hub, rank: int, number: int) -> None:
        self.hub, self.rank, self.number = hub, rank, number
        self.output: torch.Tensor | None = None

    def wait(self, timeout=None) -> bool:
        result = self.hub.collect(self.rank, self.number)
        self.output.view(-1).copy_(result.view(-1))
        return True


class VirtualCollectives(Collectives):
    """One virtual rank's collectives, counted as the real ones are (in the fake group's size),
    computed at the ``Hub``."""

    def __init__(self, hub: Hub, rank: int) -> None:
        super().__init__()
        self.hub, self._rank, self._issued = hub, rank, 0

    def rank(self, group: dist.ProcessGroup) -> int:
        return self._rank

    def issue(self, kind: str, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op,
              async_op: bool):
        if dist.get_world_size(group) != self.hub.world:
            raise RuntimeError(f"a {kind} over {dist.get_world_size(group)} ranks: the virtual group has only "
                               f"the data-parallel group of {self.hub.world}")
        work = self.hub.arrive(self._rank, self._issued, kind, input, op)
        self._issued += 1
        work.output = output
        if async_op:
            return work
        work.wait()
        return None


class VirtualRank:
    """One rank of the virtual group: a twin of each of ``ddp``'s bucket groups, holding this
    rank's gradients, residuals, selector and collectives; the plans are shared (they depend
    only on the bucket, the config and P)."""

    def __init__(self, ddp: HiggsDDP, rank: int, hub: Hub) -> None:
        shared, domain = ddp._higgs, ddp.bucket_groups[0].higgs_domain
        selector = None if domain.selector is None else make_selector(shared.config.compressor, seed=rank)
        # ledger=None: the optimizer counts its steps for the model's bucket groups, not for
        # these twins; each twin's sync keeps the step before it (a run here drops none)
        self.shared = dataclasses.replace(shared, stats=SyncStats(), trace=None, compress_timer=DeviceTimer(),
                                          waits=StepWaits(), comm=VirtualCollectives(hub, rank), ledger=None)
        self.domain = dataclasses.replace(domain, selector=selector)
        self.groups = [self._twin(group, rank) for group in ddp.bucket_groups]

    def _twin(self, group: HiggsBucketGroup, rank: int) -> HiggsBucketGroup:
        twin = copy.copy(group)
        twin.buckets = [copy.copy(bucket) for bucket in group.buckets]
        for bucket in twin.buckets:
            bucket.grad_data = torch.zeros_like(bucket.grad_data)
        twin.higgs, twin.higgs_domain = self.shared, self.domain
        twin.intra_distributed_optimizer_instance_rank = rank
        twin.cached_grad_buffer_shard_list = [None] * len(twin.buckets)
        twin.grad_reduce_handle = None
        twin._higgs_make_residuals()
        return twin

    def pairs(self, ddp: HiggsDDP):
        """(the model's bucket, this rank's twin of it), for every bucket."""
        for group, twin in zip(ddp.bucket_groups, self.groups):
            yield from zip(group.buckets, twin.buckets)

    def sync(self) -> None:
        """This rank's gradient sync in a real run's order: with ``--overlap-grad-reduce`` every
        bucket group is launched (as backward makes each ready, first to last) before
        ``finalize_model_grads`` finishes them; without it, each is launched and finished in turn.
        Each twin is reset first, as ``zero_grad_buffer`` resets the model's bucket groups (from
        megatron-core 0.19 a finished group's second ``finish_grad_sync`` in an iteration is a no-op)."""
        for twin in self.groups:
            twin.reset()
        if self.groups[0].ddp_config.overlap_grad_reduce:
            for twin in self.groups:
                twin.start_grad_sync()
        for twin in self.groups:
            twin.finish_grad_sync()


class VirtualTrainer(Trainer):
    """The pretrain script's ``Trainer`` (its loop, schedule, validation and logs), with each
    forward and backward pass run for every virtual rank in turn, and their sync at the end."""

    def __init__(self, args: argparse.Namespace) -> None:
        # With the distributed optimizer, one optimizer over every parameter: Megatron's
        # DistributedOptimizer on the fake group would update rank 0's shard only.
        loop = sys.modules[Trainer.__module__]
        build = loop.build_optimizer
        loop.build_optimizer = lambda args_, model: build(
            argparse.Namespace(**{**vars(args_), "use_distributed_optimizer": False}), model)
        try:
            super().__init__(args)
        finally:
            loop.build_optimizer = build
        ddp = self.model[0]
        # The sync runs after the passes of every rank, here, not inside Megatron's schedule:
        # nothing finishes it there, and no backward hook starts it (``_forward_backward``
        # runs under ``no_sync``; with --overlap-grad-reduce, which makes Megatron's buckets
        # what they are, the schedule's own no_sync would end before the last micro-batch).
        config = get_model_config(ddp)
        config.finalize_model_grads_func = None
        config.no_sync_func = contextlib.nullcontext
        self.hub = Hub(self.dp_size)
        self.ranks = [VirtualRank(ddp, rank, self.hub) for rank in range(self.dp_size)]
        self.pool = ThreadPoolExecutor(max_workers=self.dp_size)

    def writes_logs(self) -> bool:
        return True  # the fake group's rank 0 is the only process: it writes

    def _forward_backward(self, consumed_samples: int, forward_only: bool, dataset, poison: bool = False) -> list[dict]:
        ddp, losses = self.model[0], []
        for index, rank in enumerate(self.ranks):
            self.dp_rank = index  # its samples: the pretrain script's data order at this DP rank
            if not forward_only:
                ddp.zero_grad_buffer()
            with ddp.no_sync():
                losses += super()._forward_backward(consumed_samples, forward_only, dataset, poison)
            if not forward_only:
                for bucket, twin in rank.pairs(ddp):
                    twin.grad_data.copy_(bucket.grad_data)
        self.dp_rank = 0
        if not forward_only:
            self._sync()
        return losses

    def _sync(self) -> None:
        """Every rank's sync, one thread each (they meet at the hub); the model takes the result:
        the same bytes on every rank, or with the distributed optimizer shard r from rank r."""
        futures = [self.pool.submit(self._sync_rank, rank) for rank in self.ranks]
        for future in futures:
            future.result()
        ddp = self.model[0]
        sharded = ddp.ddp_config.use_distributed_optimizer
        for index, rank in enumerate(self.ranks):
            for bucket, twin in rank.pairs(ddp):
                if sharded:  # Megatron's shards: the bucket is padded to a multiple of P
                    bucket.grad_data.view(self.dp_size, -1)[index].copy_(twin.grad_data.view(self.dp_size, -1)[index])
                elif index == 0:
                    bucket.grad_data.copy_(twin.grad_data)
                elif not torch.equal(bucket.grad_data, twin.grad_data):
                    raise RuntimeError(f"virtual rank {index} synced another gradient than rank 0")

    def _sync_rank(self, rank: VirtualRank) -> None:
        try:
            with self.hub.turn():
                rank.sync()
        except BaseException as error:
            self.hub.fail(error)

    def _traffic(self) -> SyncStats:
        total = SyncStats()  # summed over the ranks, as the log's all-reduce over the group would
        for rank in self.ranks:
            total.add(rank.shared.take_stats())
        return total

    def close(self) -> None:
        self.pool.shutdown()
        super().close()


def check_supported(args: argparse.Namespace) -> None:
    """What the harness does not stand for (see the module docstring), refused before training."""
    if not args.use_higgs:
        raise UsageError("virtual_dp: pass --use-higgs (with --higgs-compressor none for Megatron's dense "
                         "reduction, run through the same harness)")
    if args.num_distributed_optimizer_instances != 1:
        raise UsageError("virtual_dp: --num-distributed-optimizer-instances is not covered (one level of "
                         "data parallelism: the virtual group)")
    if args.run_config.compression.sync in ("auto", "hierarchical") and args.run_config.compression.compressor != "none":
        raise UsageError(f"virtual_dp: --higgs-sync {args.run_config.compression.sync} measures links and nodes the "
                         "virtual group does not have; name a form (sparse, agreed, sharded)")
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise UsageError("virtual_dp: data parallelism only (--tensor/--pipeline-model-parallel-size 1)")
    if args.save or args.load:
        raise UsageError("virtual_dp: --save and --load are not covered")
    if args.num_experts is not None:
        raise UsageError("virtual_dp: --num-experts is not covered (the expert-data-parallel group is another group)")


def run_virtual(world_size: int, argv: list[str]) -> dict:
    """Train ``argv`` (pretrain flags) over a virtual data-parallel group of ``world_size``
    ranks, in this process (which must have no process group yet). Returns the per-iteration
    losses and validation losses."""
    with fake_group(world_size):
        args = parse_args(argv)
        check_supported(args)
        with training_environment(args):
            trainer = VirtualTrainer(args)
            try:
                result = trainer.train()
            finally:
                trainer.close()
    return {"losses": result.losses, "valid_losses": result.valid_losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, required=True, help="the virtual data-parallel size P")
    parser.add_argument("pretrain", nargs="*", help="after --: the pretrain script's flags")
    args = parser.parse_args()
    if args.dp < 1:
        parser.error(f"--dp {args.dp}: expected a positive number of ranks")
    return exit_status(lambda: run_virtual(args.dp, args.pretrain), prog="virtual_dp.py")


if __name__ == "__main__":
    sys.exit(main())
