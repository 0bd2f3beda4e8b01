"""Rank functions for tests/checkpoint/drill_checkpoint.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations

from tests.workers.common import tensor_pieces


def optimizer_state_both_ways(argv: list[str]) -> dict:
    """After two steps: the distributed optimizer's fully_reshardable state as Megatron builds
    it (all-DP gather) and as ``owner_param_state`` builds it, as main-replica pieces."""
    from higgs_megatron.checkpoint.state import owner_written_optimizer_state
    from higgs_megatron.checkpoint.state import SHARDING
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv + ["--train-iters", "2"])
    with training_environment(args):
        trainer = Trainer(args)
        trainer.train()
        model_sd = trainer.model[0].module.sharded_state_dict()
        optimizer = getattr(trainer.optimizer, "inner", trainer.optimizer)
        megatron = tensor_pieces(optimizer.sharded_state_dict(model_sd, metadata=SHARDING))
        with owner_written_optimizer_state():
            ours = tensor_pieces(optimizer.sharded_state_dict(model_sd, metadata=SHARDING))
        trainer.close()
    keep = lambda pieces: {k: v for k, v in pieces.items() if k.startswith("optimizer.state.")}  # noqa: E731
    return {"megatron": keep(megatron), "ours": keep(ours)}


def save_schedule_decisions() -> list[bool]:
    """``SaveSchedule(3, 0.2)`` asked after iterations 1..6, the wall clock passing its 0.2 s
    before iteration 5 (and restarted by every save); on the default group, as a loop asks it."""
    import time

    import torch.distributed as dist

    from higgs_megatron.checkpoint.interval import SaveSchedule

    dist.init_process_group("gloo")
    schedule, decisions = SaveSchedule(3, 0.2), []
    for iteration in range(1, 7):
        if iteration == 5:
            time.sleep(0.25)
        decisions.append(schedule.due(iteration))
        if decisions[-1]:
            schedule.saved()
    dist.destroy_process_group()
    return decisions


def load_failing_on_rank_1(argv: list[str], where: str) -> dict:
    """Load with rank 1's part failing at ``where``: ``early`` (megatron-core's load raises at
    once, before the collectives the other ranks go into), ``read`` (its shard files cannot be
    read, inside torch's collective read step) or ``restore`` (its model refuses the state,
    after the last collective of the load). Each rank's ``CheckpointError``, if any."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from higgs_megatron.checkpoint.manifest import CheckpointError
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    def failing(original, error: Exception):
        def fail(*a, **k):
            if dist.get_rank() == 1:
                raise error
            return original(*a, **k)
        return fail

    if where == "early":
        dist_checkpointing.load = failing(dist_checkpointing.load, OSError(5, "Input/output error"))
    elif where == "read":
        FileSystemReader.read_data = failing(FileSystemReader.read_data, OSError(5, "Input/output error"))
    else:
        GPTModel.load_state_dict = failing(GPTModel.load_state_dict, RuntimeError("size mismatch for decoder"))
    args = parse_args(argv)
    with training_environment(args):
        try:
            Trainer(args).close()
            error = None
        except CheckpointError as raised:
            error = str(raised)
    return {"error": error}


def save_failing_on_rank_1_alone(argv: list[str]) -> dict:
    """Train with a synchronous save at iteration 2 whose hashing of rank 1's files fails on
    rank 1 alone (an I/O error while it reads them back), before megatron-core's finalization
    collectives rank 0 goes into. Each rank's error: its class and message."""
    import torch.distributed as dist

    from higgs_megatron.checkpoint import save as save_module
    from higgs_megatron.checkpoint.manifest import CheckpointError
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    hash_files = save_module.hash_files

    def failing(paths):
        if dist.get_rank() == 1 and paths:
            raise OSError(5, "Input/output error")
        return hash_files(paths)

    save_module.hash_files = failing
    args = parse_args(argv)
    with training_environment(args):
        trainer = Trainer(args)
        try:
            trainer.train()
            error = None
        except CheckpointError as raised:
            error = (type(raised).__name__, str(raised))
    return {"error": error}
