"""Rank helpers shared by test_{checkpoint,higgs_ddp,length_buckets,offload,stability,topology,training}.py."""

from __future__ import annotations

import torch


def pretrain_on_rank(argv: list[str]):
    """Train with the pretrain script's flags; return this rank's history."""
    from higgs_megatron.training.launch import pretrain

    return pretrain(argv)


def coordinates() -> dict[str, int]:
    """This rank's TP, PP and DP coordinates (the checkpoint's own reading of them)."""
    from higgs_megatron.checkpoint.manifest import current_coords

    return {axis: rank for axis, rank in current_coords().items() if axis in ("tp", "pp", "dp")}


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(trainer.model)
            for name, p in chunk.module.named_parameters()}


def train_variants(variants: dict[str, list[str]]) -> dict:
    """Train each variant in turn in one set of process groups; return final params, losses,
    progress alignments, the last iteration and why the run left early (``--exit-*``), and (on the logging rank, with --log-json) events per variant.

    All variants must share the parallel layout (the groups are made once)."""
    import json

    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    parsed = {name: parse_args(argv) for name, argv in variants.items()}
    out = {"coords": None, "params": {}, "losses": {}, "valid_losses": {}, "alignments": {}, "events": {}, "exits": {},
           "groups": {}}
    with training_environment(next(iter(parsed.values()))):
        out["coords"] = coordinates()
        for name, args in parsed.items():
            trainer = Trainer(args)
            result = trainer.train()
            out["params"][name] = parameters(trainer)
            out["losses"][name] = result.losses
            out["valid_losses"][name] = result.valid_losses
            out["alignments"][name] = result.alignments
            out["exits"][name] = (trainer.iteration, result.exit_reason)
            out["groups"][name] = reachable_groups(trainer)
            trainer.close()
            if args.log_json and trainer.log.is_writer:
                with open(args.log_json) as log:
                    out["events"][name] = [r for r in map(json.loads, log) if r["type"] == "event"]
    return out


def reachable_groups(trainer) -> list[tuple[str, float, bool]]:
    """Every process group reachable from the trainer's model and optimizer and from
    megatron-core's ``parallel_state`` (a walk of ``gc``'s referents, not into modules,
    classes or functions): its description, timeout, and whether c10d still has it (an
    aborted group does not)."""
    import gc
    import types

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d

    from higgs_megatron.compat.groups import group_timeout

    seen, found, todo = set(), {}, [trainer.model, trainer.optimizer, vars(parallel_state)]
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor)
    while todo:
        value = todo.pop()
        if id(value) in seen or isinstance(value, skip):
            continue
        seen.add(id(value))
        if isinstance(value, dist.ProcessGroup):
            found[id(value)] = value
            continue
        todo.extend(gc.get_referents(value))
    return sorted((group.group_desc, group_timeout(group), group in distributed_c10d._world.pg_map)
                  for group in found.values())


def train_variants_on_the_compressed_form(variants: dict[str, list[str]]) -> dict:
    """``train_variants`` with every compressible bucket on its compressed form whatever its
    payload's size: density 1.0 through the compressed machinery, which the rule that a payload
    not smaller than dense goes dense (``grad_paths.BucketPaths.smaller_than_dense``) would
    otherwise skip. Patched in this rank's process only."""
    from higgs_megatron.grad_paths import BucketPaths

    forced = []
    BucketPaths.smaller_than_dense = lambda bucket, density: forced.append(bucket.name) or True
    out = train_variants(variants)
    return {**out, "forced": len(forced)}


def sparse_sync_invariants(argv: list[str]) -> dict:
    """Train at low density, recording each compression and the sync order; check per rank
    that sent + residual == accumulated gradient, and report params, bytes and the trace."""
    import higgs_megatron.compress.compressor as compressor
    import higgs_megatron.reduce.sparse_allreduce as sparse_allreduce
    import megatron.core.pipeline_parallel.schedules as schedules
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    from higgs_megatron.compress.payload import SlotLayout, position_encoding

    args = parse_args(argv)
    records, handed = [], []
    original_compress, original_backward = compressor.compress, schedules.backward_step
    original_gather = sparse_allreduce.gather_payloads

    def recording_compress(acc, plan, density, selector, key=None, payload=None):
        accumulated = acc.clone()
        sparse = original_compress(acc, plan, density, selector, key=key, payload=payload)
        records.append((key, accumulated, sparse, plan, density))
        return sparse

    def recording_gather(comm, payload, *a, **k):  # what each compression hands the all-gather, in bytes
        handed.append(payload.numel() * payload.element_size())
        return original_gather(comm, payload, *a, **k)

    with training_environment(args):
        trainer = Trainer(args)
        ddp = trainer.model[0]
        trace = ddp.trace_sync_order()

        def traced_backward(*a, **k):
            out = original_backward(*a, **k)
            trace.append(("backward_end", -1))
            return out

        original_step = trainer.train_step

        def traced_step():
            trace.append(("step", trainer.iteration + 1))
            return original_step()

        trainer.train_step = traced_step
        try:
            compressor.compress, schedules.backward_step = recording_compress, traced_backward
            sparse_allreduce.gather_payloads = recording_gather
            trainer.train()
        finally:
            compressor.compress, schedules.backward_step = original_compress, original_backward
            sparse_allreduce.gather_payloads = original_gather
        # sent + residual == accumulated, for the last step's buckets
        assert len(handed) == len(records), (len(handed), len(records))  # one payload per compression
        last = {}
        for (key, accumulated, sparse, plan, density), nbytes in zip(records, handed):
            last[key] = (accumulated, sparse, plan, density, nbytes)
        conservation = []
        byte_ratios = []
        for (group, bucket), (accumulated, sparse, plan, density, nbytes) in last.items():
            residual = ddp.higgs_bucket_groups[group].higgs_residuals[bucket].current
            sent = torch.zeros_like(accumulated)
            sent[plan.always_positions] = sparse.always
            sent.index_add_(0, sparse.positions, sparse.values)
            conservation.append(bool(torch.equal(sent + residual, accumulated)))
            # Bytes handed to the collective against the dense bucket, over the selected part
            # (the always-sent small parameters travel whole by design).
            itemsize = accumulated.element_size()
            layout = plan.layout(density)
            nothing_selected = SlotLayout(plan.numel, plan.always_positions, 0,
                                          position_encoding(plan.payload.name, plan.numel, 0, False), layout.span)
            always_bytes = plan.payload.nbytes(nothing_selected, accumulated.dtype)
            assert nbytes == plan.payload_bytes(density, accumulated.dtype)  # the plan's size is what went out
            byte_ratios.append((nbytes - always_bytes) / (accumulated.numel() * itemsize - plan.n_always * itemsize))
        out = {"coords": coordinates(), "params": parameters(trainer), "conservation": conservation,
               "byte_ratios": byte_ratios, "trace": list(trace), "groups": len(ddp.higgs_bucket_groups),
               "compressions_per_step": len(records) / args.train_iters,
               "buckets": sum(len(g.buckets) for g in ddp.higgs_bucket_groups)}
        trainer.close()
    return out


def run_trainer(argv: list[str], kill_rank_during_save_at: int | None = None,
                unwritable_rank_from: int | None = None, slow_host_copy: float | None = None,
                rank0_fails: dict[str, int] | None = None, hold_save: tuple[int, str] | None = None,
                rank0_dies_in: tuple[str, int] | None = None) -> dict:
    """Train (with whatever --save/--load flags) and report losses, the loaded iteration and the
    global tensors this rank holds (model and optimizer state, by key and offset).
    ``slow_host_copy``: an async save's host copy starts only after this many seconds.
    ``rank0_fails``: rank 0's part of the save's ``begin`` or ``commit`` raises an OSError at
    the iteration given for it (the save directory unwritable, the disk full).
    ``hold_save``: (iteration, path): once the save of that iteration has begun (its ``.tmp``
    made), every rank waits for ``path`` to exist before writing.
    ``rank0_dies_in``: (step, iteration): rank 0 is killed as it enters that step of the
    commit of that iteration (``replace_dir``: the rank map written, the directory not yet
    renamed; ``write_latest``: renamed, ``latest`` not yet moved)."""
    import builtins
    import os
    import signal
    import time

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from higgs_megatron.checkpoint import async_save
    from higgs_megatron.checkpoint import save as save_module
    from higgs_megatron.checkpoint.state import sharded_training_state
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    original_host_copies = async_save._host_copies

    def slow(*a, **k):
        time.sleep(slow_host_copy)
        return original_host_copies(*a, **k)

    args = parse_args(argv)
    original_save = dist_checkpointing.save
    original_commit = save_module.commit

    def dying_commit(pending, *a, **k):
        if dist.get_rank() == 1 and pending.iteration == kill_rank_during_save_at:
            os.kill(os.getpid(), signal.SIGKILL)  # files written and hashed, nothing committed
        return original_commit(pending, *a, **k)

    original_write = FileSystemWriterAsync.write_preloaded_data
    original_write_attr = vars(FileSystemWriterAsync)["write_preloaded_data"]  # the staticmethod itself

    def dying_write(transform_list, index, bucket, *a, **k):
        """--async-checkpoint: the rank dies as its writer thread begins the file."""
        if dist.get_rank() == 1 and f"iter_{kill_rank_during_save_at:07d}." in str(bucket[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        return original_write(transform_list, index, bucket, *a, **k)

    trainer_box = {}
    original_leftovers, original_commit_files = save_module.remove_leftovers, save_module.commit_files
    original_begin = save_module.begin
    original_steps = {step: getattr(save_module, step) for step in ("replace_dir", "write_latest")}

    def holding_begin(pending):
        pending = original_begin(pending)
        if pending.iteration == hold_save[0]:
            while not os.path.exists(hold_save[1]):
                time.sleep(0.05)
        return pending

    def dying(step: str):
        def die(*a, **k):
            iteration = trainer_box["commit"].iteration
            if dist.get_rank() == 0 and (step, iteration) == rank0_dies_in:
                os.kill(os.getpid(), signal.SIGKILL)
            return original_steps[step](*a, **k)
        return die

    def remembering_commit_files(pending, *a, **k):
        trainer_box["commit"] = pending
        return original_commit_files(pending, *a, **k)

    def failing(step: str, original, error: OSError):
        def fail(*a, **k):  # the save's iteration: the commit's own (an async one commits later), else now
            iteration = a[0].iteration if step == "commit" else trainer_box["trainer"].iteration
            if (rank0_fails or {}).get(step) == iteration:
                raise error
            return original(*a, **k)
        return fail

    def unwritable_open(path, mode="r", *a, **k):
        trainer = trainer_box.get("trainer")
        if ("w" in mode and f"__{unwritable_rank_from[0]}_" in os.path.basename(str(path))
                and trainer is not None and trainer.iteration >= unwritable_rank_from[1]):
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, mode, *a, **k)

    had_open = "open" in vars(filesystem_async)  # the module normally reads the builtin
    original_open = getattr(filesystem_async, "open", None)
    try:
        if slow_host_copy is not None:
            async_save._host_copies = slow
        if kill_rank_during_save_at is not None and args.async_checkpoint:
            FileSystemWriterAsync.write_preloaded_data = staticmethod(dying_write)
        elif kill_rank_during_save_at is not None:
            save_module.commit = dying_commit
        save_module.remove_leftovers = failing("begin", original_leftovers, PermissionError(13, "Permission denied"))
        save_module.commit_files = failing("commit", remembering_commit_files, OSError(28, "No space left on device"))
        if hold_save is not None:
            save_module.begin = async_save.begin = holding_begin
        if rank0_dies_in is not None:
            setattr(save_module, rank0_dies_in[0], dying(rank0_dies_in[0]))
        if unwritable_rank_from is not None:
            # From that iteration on, this rank's shard files cannot be opened for writing, as on a
            # read-only or full file system (the writer processes fork from here and inherit it).
            filesystem_async.open = unwritable_open
        with training_environment(args):
            trainer = trainer_box["trainer"] = Trainer(args)
            start = trainer.iteration
            resident_after_saves = []
            if trainer.runtime.memory is not None:  # the optimizer state still on the device once each save returns
                save = trainer.save
                trainer.save = lambda **kw: (save(**kw), resident_after_saves.append(trainer.runtime.memory.resident_bytes()))
            state_after_load = tensor_pieces(sharded_training_state(trainer.training_state())) if args.load else None
            result = trainer.train()
            if trainer.runtime.memory is not None:
                trainer.runtime.memory.bring_all()  # as a save does (Runtime.checkpoint_phase), to read it
            out = {"start": start, "losses": result.losses, "after_load": state_after_load,
                   "resident_after_saves": resident_after_saves,
                   "final": tensor_pieces(sharded_training_state(trainer.training_state())), "coords": coordinates()}
            trainer.close()
    finally:
        async_save._host_copies = original_host_copies
        dist_checkpointing.save = original_save
        save_module.commit = original_commit
        save_module.remove_leftovers, save_module.commit_files = original_leftovers, original_commit_files
        save_module.begin = async_save.begin = original_begin
        for step, original in original_steps.items():
            setattr(save_module, step, original)
        FileSystemWriterAsync.write_preloaded_data = original_write_attr
        if had_open:
            filesystem_async.open = original_open
        elif "open" in vars(filesystem_async):
            del filesystem_async.open
    return out


def tensor_pieces(state: dict) -> dict:
    """{key: [(global_offset, tensor)]} of the main-replica ShardedTensors in a sharded state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from higgs_megatron.checkpoint.state import is_main_replica

    pieces = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            data = value.data.detach().clone().reshape([1] * value.prepend_axis_num + list(value.local_shape))
            pieces.setdefault(value.key, []).append((tuple(value.global_shape), tuple(value.global_offset), data))
    return pieces
