"""The training loop behind ``examples/pretrain_gpt.py``, readable top to bottom.

    setup:  flags -> process groups -> corpus -> datasets -> model chunks in DDP -> optimizer
            -> LR schedule -> Megatron's config hooks (no_sync, grad sync, finalize, loss scale)
    train:  per iteration: zero grad buffers -> Megatron's forward_backward_func over the
            micro-batches (gradient accumulation and pipeline schedules live there) ->
            optimizer.step() (which finalizes grads: DP reduction, clipping) -> LR step ->
            log every --log-interval, validate every --eval-interval

Everything model-parallel is megatron-core's own; this module only sequences it. Parts
that later layers swap (the DDP class, the optimizer wrapper) come in through ``Trainer``'s
constructor, so the loop itself does not change.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import check_param_hashes_across_dp_replicas, get_model_config

from ..callbacks import Callback, callbacks_from_args
from ..checkpoint.load import load_checkpoint
from ..checkpoint.manifest import CheckpointError
from ..checkpoint.outcome import RanksOutOfStep
from ..checkpoint.async_save import AsyncCheckpointer
from ..checkpoint.save import SaveResult, save_checkpoint
from ..checkpoint.state import TrainingState, torch_optimizers
from ..checkpoint.load import vocab_record
from ..ddp import HiggsDDP, SyncStats, sync_traffic
from ..device import collective_device, model_device, to_device
from ..logs import get_logger, setup_logging
from ..stability.exit_conditions import ExitConditions
from ..elastic.replicas import ElasticReplicas
from ..runtime.attach import attach
from ..runtime.exits import UsageError
from .corpus import ByteTokenizer, build_corpus
from .data import Batch, build_datasets, iteration_batches
from .length_buckets import LengthBuckets
from ..runtime.metrics import LogWindow, MetricsLogger
from .model import build_model, build_optimizer, build_scheduler, num_parameters, transformer_config
from .parallel import set_seeds


log = get_logger(__name__)


@dataclass
class TrainResult:
    """Per-iteration history, as seen by this rank (losses only on the last pipeline stage)."""

    losses: dict[int, float] = field(default_factory=dict)
    valid_losses: dict[int, float] = field(default_factory=dict)
    step_times: dict[int, float] = field(default_factory=dict)
    tokens_per_second: dict[int, float] = field(default_factory=dict)
    alignments: int = 0
    exit_reason: str | None = None  # why the run left before --train-iters (--exit-*)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss, its token count, and both for reporting (Megatron's 3-tuple protocol)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module, poison: bool = False):
    """Megatron's forward-step protocol; ``poison`` makes the loss NaN (the ``nan`` fault).
    The host batch goes to the model's device here, asynchronously (``device.to_device``)."""
    batch = to_device(next(data_iterator), model_device(model))
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    if poison:
        output = output * float("nan")
    return output, partial(loss_func, batch["loss_mask"])


class Trainer:
    """Owns one job's state; ``train()`` runs the loop and returns the history."""

    def __init__(self, args: argparse.Namespace, callbacks: list[Callback] | None = None) -> None:
        setup_logging()
        self.args = args
        self.run = run = args.run_config  # the typed config (``runtime.run_config``): what the runtime reads
        self.rank = dist.get_rank()
        is_writer = self.writes_logs()
        self.log = MetricsLogger(is_writer=is_writer, log_json=args.log_json,
                                 callbacks=(callbacks_from_args(args) if is_writer else []) + list(callbacks or []))
        self.elastic = None
        if run.elastic is not None:  # before the model: its sync runs on the replicas' group
            self.elastic = ElasticReplicas(run.elastic, args.distributed_backend, run.stability.higgs_step_timeout)
        # This rank's share of each global batch: its data-parallel index, or its replica's.
        self.dp_rank = parallel_state.get_data_parallel_rank() if self.elastic is None else self.elastic.replica
        self.dp_size = parallel_state.get_data_parallel_world_size() if self.elastic is None \
            else run.elastic.higgs_replicas
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.exits = ExitConditions(args)  # the run's clock starts here; the signal is caught from now on

        self._build_data()

        self.config = transformer_config(args)
        set_seeds(args.seed)
        if run.compression is not None:
            self.model = build_model(args, self.config, HiggsDDP, higgs_config=run.compression,
                                     **({"replicas": self.elastic.replica_group} if self.elastic else {}))
        else:
            self.model = build_model(args, self.config)
        self.iteration = 0
        self.runtime = attach(self.model, build_optimizer(args, self.model), run, self.log, self.elastic)
        self.optimizer = self.runtime.optimizer
        # Megatron's optimizer's param groups, which HiggsOptimizer only hands through
        self.scheduler = build_scheduler(args, getattr(self.optimizer, "inner", self.optimizer))
        self._wire_megatron_hooks()

        self._log_setup()
        self._log_sync_plan()
        self.consumed_samples = 0
        self.checkpointer = AsyncCheckpointer() if run.checkpoint.async_checkpoint else None
        if self.checkpointer is not None:
            self.runtime.resilience.before_orderly_restart = lambda: self._committed(self.checkpointer.poll)
        if run.checkpoint.load:
            self._load()
        if self.elastic is not None:
            if self.iteration:
                self._drop_loaded_residuals()
            self.elastic.start(self.model, self._heal_state, self._load_healed, self.iteration)
        self._saved_at = self.iteration
        self.failed_saves = 0  # in a row

    def writes_logs(self) -> bool:
        """Whether this process writes the log lines and records: the last rank (the last
        pipeline stage's, which holds the loss)."""
        return self.rank == dist.get_world_size() - 1

    def _build_data(self) -> None:
        """The corpus, the train and validation datasets, and the length buckets if asked for."""
        args = self.args
        started = time.monotonic()
        corpus = build_corpus(args.data_path, args.data_cache_path,
                              progress=lambda line: log.info(f"[rank {self.rank}] {line}"))
        self.corpus = corpus
        evals = args.train_iters // args.eval_interval + 1
        self.datasets = build_datasets(
            corpus, args.seq_length, args.seed, args.split,
            train_samples=args.train_iters * args.global_batch_size,
            valid_samples=max(1, args.eval_iters) * args.global_batch_size,
            cache_dir=args.data_cache_path,
        )
        self.length_buckets = None
        if args.length_buckets is not None:
            try:
                self.length_buckets = LengthBuckets(self.datasets.train, args.length_buckets, args.seq_length,
                                                    args.global_batch_size, args.seed)
            except ValueError as error:
                raise UsageError(f"--higgs-length-buckets: {error}") from None
        self.log.event("corpus_ready", f"corpus: {corpus.source}: {corpus.files} files, {corpus.documents} documents, "
                       f"{corpus.tokens:,} tokens ({time.monotonic() - started:.1f}s); "
                       f"{len(self.datasets.train)} train / {len(self.datasets.valid)} validation samples",
                       documents=corpus.documents, tokens=corpus.tokens, source=corpus.source,
                       evaluations=evals)
        if self.length_buckets is not None:
            summary = self.length_buckets.summary(args.train_iters)
            shares = ", ".join(f"{b}: {n}" for b, n in zip(summary["buckets"], summary["batches_per_bucket"]))
            self.log.event("length_buckets", f"length buckets: {summary['chunks']} document chunks; batches per "
                           f"bucket over {args.train_iters} iterations {{{shares}}}; "
                           f"{summary['padding']:.1%} of trained positions are padding", **summary)

    def _log_setup(self) -> None:
        """The model's size and the run's layout, once (event ``setup_done``)."""
        args, run = self.args, self.run
        params = torch.tensor([num_parameters(self.model)], dtype=torch.long, device=collective_device())
        if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_context_parallel_rank() != 0:
            params.zero_()
        dist.all_reduce(params)
        self.log.event(
            "setup_done",
            f"model: {params.item():,} parameters; world {dist.get_world_size()} = "
            f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x DP {self.dp_size}; "
            f"backend {args.distributed_backend}; {args.num_microbatches} micro-batch(es) per step",
            parameters=params.item(), world_size=dist.get_world_size(),
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            data_parallel_size=self.dp_size,
            higgs=run.compression.to_dict() if run.compression else None,
        )

    def _log_sync_plan(self) -> None:
        """What --higgs-sync auto measured and chose, per bucket (the logging rank's stage)."""
        for chunk in self.model:
            if not isinstance(chunk, HiggsDDP) or chunk.link_costs is None:
                continue
            costs = chunk.link_costs
            choices = "; ".join(
                f"{entry['bucket']} ({entry['numel']:,} elements): {entry['path']}"
                + (" (" + ", ".join(f"{p} {ms:.1f} ms" for p, ms in entry["predicted_ms"].items()) + ")"
                   if entry["predicted_ms"] else "")
                for entry in chunk.higgs_sync_report)
            self.log.event("higgs_sync_plan", f" higgs sync auto: links {costs.describe()}; buckets: {choices}",
                           costs=costs.to_dict(), buckets=chunk.higgs_sync_report)

    def training_state(self) -> TrainingState:
        """What a checkpoint saves and restores, named (see ``checkpoint.state``)."""
        return TrainingState(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             iteration=self.iteration, consumed_samples=self.consumed_samples,
                             use_distributed_optimizer=self.args.use_distributed_optimizer,
                             higgs=self.run.compression.to_dict() if self.run.compression else None,
                             vocab=vocab_record(ByteTokenizer().vocab_size, self.args.make_vocab_size_divisible_by,
                                                self.args.tensor_model_parallel_size))

    def _heal_state(self) -> dict:
        """What an elastic replica healing from this one receives: ``state_dict()``, its
        error-feedback part without the residuals (``HiggsDDP.peer_residual_state``)."""
        state = self.state_dict()
        state["optimizer"]["higgs_residuals"] = [chunk.peer_residual_state() for chunk in self.optimizer.model_chunks]
        return state

    def _load_healed(self, state: dict) -> float:
        """This elastic replica heals: a peer's ``_heal_state``, with zero residuals of its own;
        returns the L2 norm of its own residuals dropped."""
        peer_residuals = state["optimizer"]["higgs_residuals"]
        state["optimizer"] = state["optimizer"]["optimizer"]
        skip, self.optimizer.skip_residuals_on_load = self.optimizer.skip_residuals_on_load, True
        try:
            self.load_state_dict(state)
        finally:
            self.optimizer.skip_residuals_on_load = skip
        return sum(chunk.adopt_peer_residual_state(residuals)
                   for chunk, residuals in zip(self.optimizer.model_chunks, peer_residuals))

    def _drop_loaded_residuals(self) -> None:
        """Elastic replicas: a checkpoint holds the residuals of the replica that wrote it, the
        gradient mass that replica had not sent; every replica that loads it starts from zero,
        as a healed one does, or that mass would be sent once per replica (event
        ``residuals_dropped``)."""
        dropped = sum(chunk.adopt_peer_residual_state(chunk.peer_residual_state())
                      for chunk in self.optimizer.model_chunks)
        self.log.event("residuals_dropped", f" elastic replicas: the loaded error-feedback residuals (L2 norm "
                       f"{dropped:.4g}) belong to the replica that saved them: every replica starts from zero",
                       iteration=self.iteration, norm=dropped)

    def _load(self) -> None:
        args, checkpoint = self.args, self.run.checkpoint
        started = time.perf_counter()
        training = self.training_state()
        loaded = load_checkpoint(training, checkpoint.load, checkpoint.recovery_mode, checkpoint.checkpoint_version)
        if loaded is None:
            self.log.event("checkpoint_not_found", f" no committed checkpoint in {checkpoint.load}: starting from "
                           "scratch", path=checkpoint.load)
            return
        self.iteration, self.consumed_samples = training.iteration, training.consumed_samples
        if loaded.warning:
            self.log.event("checkpoint_fallback", f" WARNING: {loaded.warning}", path=str(loaded.path),
                           warning=loaded.warning)
        self.log.event("checkpoint_validated", f" rank map of {loaded.path} validated "
                       f"({'resharded from ' + str(loaded.manifest.layout) if loaded.resharded else 'same sharding'})",
                       path=str(loaded.path), resharded=loaded.resharded)
        if loaded.resharded:
            # Policy: per-rank state (RNG, error-feedback residuals) belongs to the old layout.
            set_seeds(args.seed + self.iteration)
            self.log.event("reshard_policy", " resharded: RNG reseeded from --seed + iteration, "
                           "error-feedback residuals start from zero", iteration=self.iteration)
        self.log.event("checkpoint_loaded", f" loaded {loaded.path} at iteration {self.iteration} "
                       f"({time.perf_counter() - started:.2f}s)", path=str(loaded.path), iteration=self.iteration,
                       consumed_samples=self.consumed_samples, seconds=time.perf_counter() - started)

    def save(self, final: bool = False) -> None:
        """Synchronous: the whole save. With ``--async-checkpoint``: wait for the previous save,
        then hand this one to the background writer. ``final``: no save comes after it."""
        checkpoint = self.run.checkpoint
        self.runtime.checkpoint_phase(self.iteration)
        if self.checkpointer is None:
            self.log.event("save_started", iteration=self.iteration)
            self._committed(lambda: [save_checkpoint(self.training_state(), checkpoint.save, checkpoint.keep_last)],
                            last_chance=final)
        else:
            self._committed(self.checkpointer.wait)
            self.log.event("save_started", iteration=self.iteration)
            started = time.perf_counter()
            if self._committed(lambda: self.checkpointer.start(self.training_state(), checkpoint.save,
                                                               checkpoint.keep_last) or [], last_chance=final):
                stall = time.perf_counter() - started
                self.log.event("checkpoint_started_in_background", f" iteration {self.iteration}: save planned; the "
                               f"host copy, writing and hashing run in the background; the loop paid "
                               f"{stall * 1000:.0f} ms", iteration=self.iteration, stall_seconds=stall)
        self._saved_at = self.iteration
        if self.runtime.memory is not None and self.checkpointer is not None:
            self.checkpointer.before_update()  # the host copy first: offloaded state leaves again in ``saved``
        self.runtime.saved()

    def _committed(self, finish: Callable[[], list[SaveResult]], last_chance: bool = False) -> bool:
        """Log what ``finish()`` committed; whether it went through. A save that failed on any
        rank (its begin, a write, an async save's host copy, rank 0's commit: each raised on
        every rank) committed nothing and cost the run no state, so training goes on and the
        next save tries again (event ``checkpoint_failed``); a second failure in a row, or a
        failed last save, ends the run (``CheckpointError``, exit status 3), as does a failure
        only some ranks raised, after which their collectives may be out of step
        (``RanksOutOfStep``)."""
        try:
            results = finish()
        except CheckpointError as error:
            self.failed_saves += 1
            if last_chance or self.failed_saves >= FAILED_SAVES_TO_STOP or isinstance(error, RanksOutOfStep):
                raise
            self.log.event("checkpoint_failed", f" WARNING: {error}; the latest committed checkpoint stays the "
                           "latest; training goes on and the next save tries again", iteration=self.iteration,
                           error=str(error))
            return False
        if results:
            self.failed_saves = 0
        for result in results:
            self.log.event("checkpoint_committed", f" saved {result.path} ({result.bytes / 1e6:.1f} MB, "
                           f"{result.seconds:.2f}s from start to commit)", path=str(result.path),
                           iteration=result.iteration, seconds=result.seconds, bytes=result.bytes)
        return True

    def _save_due(self) -> bool:
        """``--save-interval`` by iteration count; ``--checkpoint-interval`` by wall clock, agreed
        on by all ranks (``checkpoint.interval``)."""
        return (bool(self.run.checkpoint.save) and self.runtime.saves.due(self.iteration)
                and (self.elastic is None or self.elastic.saves(self.run.checkpoint.save, self.iteration)))

    def finish_saves(self) -> None:
        """At the end of training: pending saves finish (every rank)."""
        if self.checkpointer is not None:
            self._committed(self.checkpointer.close, last_chance=True)

    def _wire_megatron_hooks(self) -> None:
        """What Megatron-LM's training.py sets on the model config before its loop."""
        config = get_model_config(self.model[0])
        if self.args.overlap_grad_reduce:
            config.no_sync_func = self.model[0].no_sync
            config.grad_sync_func = self.model[0].start_grad_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss

    def _forward_backward(self, consumed_samples: int, forward_only: bool, dataset, poison: bool = False) -> list[dict]:
        args = self.args
        seq_length = args.seq_length
        if dataset is self.datasets.train and self.length_buckets is not None:
            seq_length = self.length_buckets.seq_length(consumed_samples // args.global_batch_size)
            batches = self.length_buckets.iteration_batches(consumed_samples, args.micro_batch_size, self.dp_rank,
                                                            self.dp_size, args.num_microbatches)
        else:
            batches = iteration_batches(dataset, consumed_samples, args.micro_batch_size, self.dp_rank,
                                        self.dp_size, args.num_microbatches)
        return get_forward_backward_func()(
            forward_step_func=partial(forward_step, poison=poison),
            data_iterator=batches,
            model=self.model,
            num_microbatches=args.num_microbatches,
            seq_length=seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=forward_only,
        )

    def _reduce_loss(self, loss_dicts: list[dict]) -> float | None:
        """Token-weighted mean loss over micro-batches and DP ranks; None off the last stage."""
        if not self.is_last_stage:
            return None
        total = torch.stack([d["lm loss"] for d in loss_dicts]).sum(dim=0)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return (total[0] / total[1].clamp(min=1)).item()

    def train_step(self) -> tuple[bool, float | None, float | None]:
        """The next iteration, under the runtime (``Runtime.step``: attempts that every rank
        drops, progress alignments, run again on the same data): (stepped, loss, grad norm)."""

        def attempt(fault) -> tuple[bool, float | None, float | None]:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            loss_dicts = self._forward_backward(self.consumed_samples, False, self.datasets.train,
                                                poison=fault is not None and fault.kind == "nan")
            self.runtime.resilience.phase(self.iteration + 1, "vote")  # the step's decision, then the optimizer
            if self.checkpointer is not None:
                self.checkpointer.before_update()  # an async save's host copy must be done first
            update_successful, grad_norm, _ = self.optimizer.step()
            return update_successful, loss_dicts, grad_norm

        update_successful, loss_dicts, grad_norm = self.runtime.step(self.iteration + 1, attempt)
        if update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        return update_successful, self._reduce_loss(loss_dicts), grad_norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        self.runtime.resilience.phase(self.iteration, "evaluation")
        for chunk in self.model:
            chunk.eval()
        losses = []
        for i in range(self.args.eval_iters):
            losses += self._forward_backward(i * self.args.global_batch_size, True, self.datasets.valid)
        for chunk in self.model:
            chunk.train()
        return self._reduce_loss(losses) if losses else None

    def _tokens(self, consumed_samples: int) -> int:
        """Tokens trained on in the global batch at ``consumed_samples`` (padding not counted)."""
        if self.length_buckets is None:
            return self.args.global_batch_size * self.args.seq_length
        return self.length_buckets.tokens(consumed_samples // self.args.global_batch_size)

    def _traffic(self) -> SyncStats:
        """This step's gradient traffic: bytes handed, ring wire bytes, dense's of both, compression."""
        return sync_traffic(self.model)

    def _check_replicas(self) -> None:
        """Megatron's own check: every DP replica holds bitwise-identical parameters (across
        elastic replicas, the replicas in the quorum: ``ElasticReplicas.check_identical``)."""
        if self.elastic is not None:
            identical = self.elastic.check_identical(self.model)
            if identical is False:
                raise RuntimeError(f"elastic replicas hold different parameters at iteration {self.iteration} "
                                   "(--check-weight-hash-across-dp-replicas-interval)")
            if identical:
                self.log.event("replicas_identical", iteration=self.iteration, replicas=self.elastic.participants)
            return
        if not check_param_hashes_across_dp_replicas(self.model, cross_check=True):
            raise RuntimeError(f"data-parallel replicas hold different parameters at iteration {self.iteration} "
                               "(--check-weight-hash-across-dp-replicas-interval)")
        self.log.event("replicas_identical", iteration=self.iteration)

    def train(self) -> TrainResult:
        args = self.args
        result = TrainResult()
        skipped = skipped_samples = 0
        window = LogWindow()
        while self.iteration < args.train_iters:
            started = time.perf_counter()
            ok, loss, grad_norm = self.train_step()
            step_time = time.perf_counter() - started
            tokens = self._tokens(self.consumed_samples)
            batch = args.global_batch_size
            if self.elastic is not None:  # the replicas out of the quorum: their share is skipped
                batch = self.elastic.participants * args.global_batch_size // self.dp_size
                skipped_samples += args.global_batch_size - batch
                tokens = tokens * batch // args.global_batch_size
            self.iteration += 1
            self.consumed_samples += args.global_batch_size
            skipped += 0 if ok else 1
            window.add(self._traffic(), tokens=tokens)
            result.step_times[self.iteration] = step_time
            result.tokens_per_second[self.iteration] = tokens / step_time
            if loss is not None:
                result.losses[self.iteration] = loss
            interval = args.check_weight_hash_across_dp_replicas_interval
            if interval and self.iteration % interval == 0:
                self._check_replicas()
            if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                elapsed = window.seconds_per_iteration()
                sent, dense, compress_seconds, wire, dense_wire, density = window.per_rank_per_step()
                fields = {
                    "consumed samples": self.consumed_samples,
                    "elapsed time per iteration (ms)": elapsed * 1000.0,
                    "learning rate": self.scheduler.get_lr(self.optimizer.param_groups[0]),
                    "global batch size": batch,
                }
                if self.elastic is not None:
                    fields["replicas"] = self.elastic.participants
                    fields["skipped samples"] = skipped_samples
                    fields["quorum time (ms)"] = self.elastic.quorum_seconds * 1000.0  # the last step's
                if loss is not None:
                    fields["lm loss"] = loss
                if grad_norm is not None:
                    fields["grad norm"] = float(grad_norm)
                fields["tokens per second"] = window.tokens / max(1, window.iterations) / elapsed
                fields["bytes sent"] = int(sent)
                fields["dense bytes"] = int(dense)
                fields["wire bytes"] = int(wire)
                fields["dense wire bytes"] = int(dense_wire)
                if self.run.compression is not None:
                    fields["density"] = density  # the window's mean
                    fields["compression time (ms)"] = compress_seconds * 1000.0
                fields["number of skipped iterations"] = skipped
                self.log.iteration(self.iteration, args.train_iters, fields)
                window = LogWindow()
            if args.eval_iters > 0 and (self.iteration % args.eval_interval == 0
                                        or self.iteration == args.train_iters):
                paused = time.perf_counter()
                valid_loss = self.evaluate()
                if valid_loss is not None:
                    result.valid_losses[self.iteration] = valid_loss
                    self.log.event("validation", f" validation loss at iteration {self.iteration}: "
                                   f"{valid_loss:.6E}", iteration=self.iteration, loss=valid_loss)
                window.excluded += time.perf_counter() - paused
            if self.checkpointer is not None:
                self._committed(self.checkpointer.poll)
            if self._save_due():
                paused = time.perf_counter()
                self.save()
                window.excluded += time.perf_counter() - paused
            result.exit_reason = self.exits.due(self.iteration)
            if result.exit_reason is not None:
                self.log.event("exit_requested", f" exiting after iteration {self.iteration}: {result.exit_reason}"
                               + ("; saving a checkpoint first" if self.run.checkpoint.save and self._saved_at != self.iteration
                                  else ""), iteration=self.iteration, reason=result.exit_reason)
                break
        if self.run.checkpoint.save and self._saved_at != self.iteration and \
                (self.elastic is None or self.elastic.saves(self.run.checkpoint.save, self.iteration)):
            self.save(final=True)
        self.finish_saves()
        result.alignments = self.runtime.alignments
        return result

    def state_dict(self) -> dict:
        """Everything a same-layout resume needs, for this rank (model, optimizer, schedule, position).

        Megatron's distributed optimizer leaves Adam's moments out of its ``state_dict()`` (its
        checkpoints save them through the sharded or DP-zero paths), so with it this rank's
        shards of them come along as the inner torch optimizers' own state dicts."""
        state = {"model": [chunk.state_dict() for chunk in self.model], "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "iteration": self.iteration,
                 "consumed_samples": self.consumed_samples}
        if self.args.use_distributed_optimizer:
            state["optimizer_shards"] = [inner.state_dict() for _, inner in torch_optimizers(self.optimizer)]
        return state

    def load_state_dict(self, state: dict) -> None:
        for chunk, chunk_state in zip(self.model, state["model"]):
            chunk.load_state_dict(chunk_state)
        self.optimizer.load_state_dict(state["optimizer"])
        for (_, inner), shard in zip(torch_optimizers(self.optimizer), state.get("optimizer_shards", [])):
            inner.load_state_dict(shard)
        self.scheduler.num_steps = 0  # Megatron's scheduler adds the loaded steps to its own
        self.scheduler.load_state_dict(state["scheduler"])
        self.iteration = state["iteration"]
        self.consumed_samples = state["consumed_samples"]

    def close(self) -> None:
        if self.elastic is not None:
            self.elastic.close()
        self.exits.close()
        self.runtime.close(self.iteration)
        self.log.close()


FAILED_SAVES_TO_STOP = 2  # failed saves in a row that end the run
