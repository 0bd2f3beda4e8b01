"""Functions the multi-process tests run on each rank (importable by name, as spawn needs)."""

from __future__ import annotations

import copy

import torch


def pretrain_on_rank(argv: list[str]):
    """Train with the pretrain script's flags; return this rank's history."""
    from higgs_megatron.training.loop import pretrain

    return pretrain(argv)


def coordinates() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank()}


def parameters(trainer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": p.detach().clone() for i, chunk in enumerate(trainer.model)
            for name, p in chunk.module.named_parameters()}


def train_variants(variants: dict[str, list[str]]) -> dict:
    """Train each variant in turn in one set of process groups; return final params, losses,
    progress alignments and (on the logging rank, with --log-json) events per variant.

    All variants must share the parallel layout (the groups are made once)."""
    import json

    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    parsed = {name: parse_args(argv) for name, argv in variants.items()}
    out = {"coords": None, "params": {}, "losses": {}, "valid_losses": {}, "alignments": {}, "events": {}}
    with training_environment(next(iter(parsed.values()))):
        out["coords"] = coordinates()
        for name, args in parsed.items():
            trainer = Trainer(args)
            result = trainer.train()
            out["params"][name] = parameters(trainer)
            out["losses"][name] = result.losses
            out["valid_losses"][name] = result.valid_losses
            out["alignments"][name] = result.alignments
            trainer.close()
            if args.log_json and trainer.log.is_writer:
                with open(args.log_json) as log:
                    out["events"][name] = [r for r in map(json.loads, log) if r["type"] == "event"]
    return out


def staged_sync(variants: dict[str, list[str]]) -> dict:
    """``train_variants``, recording per step of the last variant the bytes sent, the dense
    bytes and a checksum of Adam's second moment after the step."""
    from higgs_megatron.optimizer import torch_optimizers
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


def sparse_sync_invariants(argv: list[str]) -> dict:
    """Train at low density, recording each compression and the sync order; check per rank
    that sent + residual == accumulated gradient, and report params, bytes and the trace."""
    import higgs_megatron.compress.compressor as compressor
    import higgs_megatron.reduce.sparse_allreduce as sparse_allreduce
    import megatron.core.pipeline_parallel.schedules as schedules
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    args = parse_args(argv)
    records, handed = [], []
    original_compress, original_backward = compressor.compress, schedules.backward_step
    original_pack = sparse_allreduce.pack

    def recording_compress(acc, plan, density, selector, key=None):
        accumulated = acc.clone()
        sparse = original_compress(acc, plan, density, selector, key=key)
        records.append((key, accumulated, sparse, plan, density))
        return sparse

    def recording_pack(*a, **k):  # what each compression hands the all-gather, in bytes
        payload = original_pack(*a, **k)
        handed.append(payload.numel() * payload.element_size())
        return payload

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

        compressor.compress, schedules.backward_step = recording_compress, traced_backward
        sparse_allreduce.pack = recording_pack
        trainer.train_step = traced_step
        try:
            trainer.train()
        finally:
            compressor.compress, schedules.backward_step = original_compress, original_backward
            sparse_allreduce.pack = original_pack
        # sent + residual == accumulated, for the last step's buckets
        assert len(handed) == len(records), (len(handed), len(records))  # one payload per compression
        last = {}
        for (key, accumulated, sparse, plan, density), nbytes in zip(records, handed):
            last[key] = (accumulated, sparse, plan, density, nbytes)
        conservation = []
        byte_ratios = []
        for (group, bucket), (accumulated, sparse, plan, density, nbytes) in last.items():
            residual = ddp.bucket_groups[group].higgs_residuals[bucket].current
            sent = torch.zeros_like(accumulated)
            sent[plan.always_positions] = sparse.always
            sent.index_add_(0, sparse.positions, sparse.values)
            conservation.append(bool(torch.equal(sent + residual, accumulated)))
            # Bytes handed to the collective against the dense bucket, over the selected part
            # (the always-sent small parameters travel dense by design).
            itemsize = accumulated.element_size()
            always_bytes = plan.n_always * itemsize
            assert nbytes == plan.payload_bytes(density, accumulated.dtype)  # the plan's size is what went out
            byte_ratios.append((nbytes - always_bytes) / (accumulated.numel() * itemsize - always_bytes))
        out = {"coords": coordinates(), "params": parameters(trainer), "conservation": conservation,
               "byte_ratios": byte_ratios, "trace": list(trace), "groups": len(ddp.bucket_groups),
               "compressions_per_step": len(records) / args.train_iters,
               "buckets": sum(len(g.buckets) for g in ddp.bucket_groups)}
        trainer.close()
    return out


def nan_on_one_rank(argv: list[str], bad_rank: int, bad_iteration: int) -> dict:
    """Put a NaN into one rank's gradients at one iteration; report what every rank did."""
    import torch.distributed as dist

    from higgs_megatron.ddp import HiggsBucketGroup
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    args = parse_args(argv)
    with training_environment(args):
        trainer = Trainer(args)
        ddp = trainer.model[0]
        original = HiggsBucketGroup.start_grad_sync

        def poisoned(group, *a, **k):
            if dist.get_rank() == bad_rank and trainer.iteration + 1 == bad_iteration:
                group.buckets[0].grad_data[0] = float("nan")
            return original(group, *a, **k)

        HiggsBucketGroup.start_grad_sync = poisoned
        history = []
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
    from higgs_megatron.training.loop import Trainer, training_environment

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


def run_trainer(argv: list[str], kill_rank_during_save_at: int | None = None,
                unwritable_rank_from: int | None = None, slow_host_copy: float | None = None) -> dict:
    """Train (with whatever --save/--load flags) and report losses, the loaded iteration and the
    global tensors this rank holds (model and optimizer state, by key and offset).
    ``slow_host_copy``: an async save's host copy starts only after this many seconds."""
    import os
    import signal
    import time

    from higgs_megatron.checkpoint import async_save

    if slow_host_copy is not None:
        copy = async_save._host_copies

        def slow(*a, **k):
            time.sleep(slow_host_copy)
            return copy(*a, **k)

        async_save._host_copies = slow

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from higgs_megatron.checkpoint.state import sharded_training_state
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    args = parse_args(argv)
    original_save = dist_checkpointing.save

    def dying_save(state, directory, *a, **k):
        result = original_save(state, directory, *a, **k)
        if dist.get_rank() == 1 and state["iteration"] == kill_rank_during_save_at and result is None:
            os.kill(os.getpid(), signal.SIGKILL)  # files written, nothing hashed or committed
        return result

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original_write = FileSystemWriterAsync.write_preloaded_data

    def dying_write(transform_list, index, bucket, *a, **k):
        """--async-checkpoint: the rank dies as its writer thread begins the file."""
        if dist.get_rank() == 1 and f"iter_{kill_rank_during_save_at:07d}.tmp" in str(bucket[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        return original_write(transform_list, index, bucket, *a, **k)

    if kill_rank_during_save_at is not None and args.async_checkpoint:
        FileSystemWriterAsync.write_preloaded_data = staticmethod(dying_write)
    dist_checkpointing.save = dying_save
    if unwritable_rank_from is not None:
        # From that iteration on, this rank's shard files cannot be opened for writing, as on a
        # read-only or full file system (the writer processes fork from here and inherit it).
        import builtins

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        trainer_box = {}

        def unwritable_open(path, mode="r", *a, **k):
            trainer = trainer_box.get("trainer")
            if ("w" in mode and f"__{unwritable_rank_from[0]}_" in os.path.basename(str(path))
                    and trainer is not None and trainer.iteration >= unwritable_rank_from[1]):
                raise PermissionError(13, "Permission denied", str(path))
            return builtins.open(path, mode, *a, **k)

        filesystem_async.open = unwritable_open
    try:
        with training_environment(args):
            trainer = Trainer(args)
            if unwritable_rank_from is not None:
                trainer_box["trainer"] = trainer
            start = trainer.iteration
            resident_after_saves = []
            if trainer.memory is not None:  # the optimizer state still on the device once each save returns
                save = trainer.save
                trainer.save = lambda: (save(), resident_after_saves.append(trainer.memory.resident_bytes()))
            state_after_load = tensor_pieces(sharded_training_state(trainer.training_state())) if args.load else None
            result = trainer.train()
            out = {"start": start, "losses": result.losses, "after_load": state_after_load,
                   "resident_after_saves": resident_after_saves,
                   "final": tensor_pieces(sharded_training_state(trainer.training_state())), "coords": coordinates()}
            trainer.close()
    finally:
        dist_checkpointing.save = original_save
        FileSystemWriterAsync.write_preloaded_data = original_write
    return out


def tensor_pieces(state: dict) -> dict:
    """{key: [(global_offset, tensor)]} of the main-replica ShardedTensors in a sharded state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pieces = {}
    for value in nested_values(state):
        if isinstance(value, ShardedTensor) and all(r == 0 for r in (value.replica_id if isinstance(
                value.replica_id, tuple) else (value.replica_id,))):
            data = value.data.detach().clone().reshape([1] * value.prepend_axis_num + list(value.local_shape))
            pieces.setdefault(value.key, []).append((tuple(value.global_shape), tuple(value.global_offset), data))
    return pieces


def optimizer_state_both_ways(argv: list[str]) -> dict:
    """After two steps: the distributed optimizer's fully_reshardable state as Megatron builds
    it (all-DP gather) and as ``owner_param_state`` builds it, as main-replica pieces."""
    from higgs_megatron.checkpoint.optimizer_shards import owner_written_optimizer_state
    from higgs_megatron.checkpoint.state import SHARDING
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

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


def on_simulated_nodes(ranks_per_node: int, fn, *args):
    """Run ``fn(*args)`` with this rank placed on node ``rank // ranks_per_node`` (the override
    of higgs_megatron.topology)."""
    import os

    os.environ["HIGGS_NODE_ID"] = str(int(os.environ["RANK"]) // ranks_per_node)
    return fn(*args)


def node_groups_of_world() -> dict:
    """build_node_groups over the whole world as one DP group: what this rank got."""
    import torch.distributed as dist

    from higgs_megatron.topology import TopologyError, build_node_groups

    dist.init_process_group("gloo")
    try:
        groups = build_node_groups(dist.group.WORLD)
    except TopologyError as error:
        return {"error": str(error)}
    finally:
        dist.barrier()
    return {"intra": dist.get_process_group_ranks(groups.intra), "inter": dist.get_process_group_ranks(groups.inter),
            "nodes": groups.nodes, "ranks_per_node": groups.ranks_per_node, "local_index": groups.local_index}


def auto_sync_choices(variants: dict[str, list[str]]) -> dict:
    """Train each variant; report what ``--higgs-sync auto`` chose, the bytes the steps handed
    to collectives against dense, and the final parameters."""
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    parsed = {name: parse_args(argv) for name, argv in variants.items()}
    out = {"params": {}, "reports": {}, "sources": {}, "traffic": {}}
    with training_environment(next(iter(parsed.values()))):
        for name, args in parsed.items():
            trainer = Trainer(args)
            totals = [0, 0]
            measure = trainer._traffic

            def counting_traffic():
                sent, dense, seconds, density = measure()
                totals[0] += sent
                totals[1] += dense
                return sent, dense, seconds, density

            trainer._traffic = counting_traffic
            trainer.train()
            chunk = trainer.model[0]
            out["params"][name] = parameters(trainer)
            out["reports"][name] = getattr(chunk, "higgs_sync_report", None)
            costs = getattr(chunk, "link_costs", None)
            out["sources"][name] = costs.source if costs is not None else None
            out["traffic"][name] = tuple(totals)
            trainer.close()
    return out



def host_syncs_in_gradient_path(argv: list[str]) -> dict:
    """Train with ``argv``, auditing host synchronisations made by higgs_megatron's code in
    the gradient path: ``start_grad_sync`` and ``finish_grad_sync`` of every bucket group
    (selection, error feedback, the collectives' launch, their waits and decompression) and
    the non-finite flags the optimizer wrapper folds into its one decision. Returns the calls
    by site.

    The audit is entered and left inside each audited call: backward hooks run with torch's
    function-mode stack emptied (``torch.autograd.backward`` is itself a torch function), so a
    mode entered around the whole step would not see them."""
    from higgs_megatron.ddp import HiggsBucketGroup, HiggsDDP
    from higgs_megatron.host_sync import HostSyncAudit
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.loop import Trainer, training_environment

    args = parse_args(argv)
    audit = HostSyncAudit("higgs_megatron")
    counts = {"depth": 0, "start_grad_sync": 0, "finish_grad_sync": 0, "nonfinite_flag": 0}
    audited = [(HiggsBucketGroup, "start_grad_sync"), (HiggsBucketGroup, "finish_grad_sync"),
               (HiggsDDP, "nonfinite_flag")]
    originals = {(owner, name): getattr(owner, name) for owner, name in audited}

    def audited_call(name, original):
        def call(self, *a, **k):
            counts[name] += 1
            counts["depth"] += 1
            if counts["depth"] == 1:
                audit.__enter__()
            try:
                return original(self, *a, **k)
            finally:
                counts["depth"] -= 1
                if counts["depth"] == 0:
                    audit.__exit__(None, None, None)
        return call

    for (owner, name), original in originals.items():
        setattr(owner, name, audited_call(name, original))
    try:
        with training_environment(args):
            trainer = Trainer(args)
            trainer.train()
            trainer.close()
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    counts.pop("depth")
    return {"calls": dict(audit.calls), **counts}
