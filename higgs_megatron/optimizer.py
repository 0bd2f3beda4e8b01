"""wrap_optimizer: a Megatron optimizer that knows about HiggsDDP's error-feedback state.

``HiggsOptimizer`` delegates every call to the Megatron optimizer it wraps
(``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``,
``ChainedOptimizer``) and adds two things:

* **State.** ``state_dict()`` returns ``{"optimizer": <wrapped state>, "higgs_residuals":
  [per model chunk]}``; ``sharded_state_dict()`` adds each rank's residuals as per-rank
  ``ShardedObject``s (never in the common part, which only rank 0 writes); the load
  methods restore them. Residuals are per rank: they belong to this rank's gradients.
* **A frozen second moment**, with ``freeze_adam_variance`` or ``sync='onebit'``: from the end
  of the dense stage (``dense_iters`` Adam steps) every torch AdamW inside takes
  ``frozen_variance``'s update. Under ``onebit`` that update takes the synced gradient as its
  first moment, and each chunk is handed Adam's first moments (``first_moment.FirstMoments``).
* **One decision per step** (``stability.alignment.StepDecision``). Before stepping, each
  rank's inputs (whether its local gradients held a NaN/inf: a device flag HiggsDDP records
  during the sync; why its sync cannot be trusted, if a bounded wait ran out) are agreed on
  by every rank, read once. If any rank cannot keep the step, every rank drops it, here and
  only here: no optimizer update, gradients zeroed, the residuals staged by this step rolled
  back (a kept step is counted on each chunk's ``StepLedger``, which commits them when the
  next sync starts; the same sync run twice in one iteration starts twice from the same
  residual), and ``step()`` returns ``(False, None, None)`` everywhere (a partial skip would hang
  the distributed optimizer's parameter all-gather). After a given-up sync the data-parallel
  groups are rebuilt (``stability.regroup``) before anything else runs on them (across elastic
  replicas, torchft's next quorum rebuilds its group instead: ``elastic.replicas``).
  ``take_verdict()`` says what the last step decided (once); ``on_skip`` callbacks hear of every drop.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer

from .checkpoint.state import residual_objects, torch_optimizers
from .ddp import HiggsDDP, slot_in_bucket
from .device import collective_device
from .first_moment import FirstMoments, MomentSlot, adam_beta1, copies_summed_after_sync, main_params, shard_pieces
from .frozen_variance import check_supported, freeze_variance
from .grad_paths import DensitySchedule
from .stability.alignment import StepDecision, Verdict
from .stability.progress import job_store
from .stability.regroup import rebuild_process_groups

class HiggsOptimizer(MegatronOptimizer):
    """A delegating MegatronOptimizer; see the module docstring."""

    def __init__(self, optimizer: MegatronOptimizer, model_chunks: list[HiggsDDP]) -> None:
        # MegatronOptimizer.__init__ is not called: all state lives in the wrapped optimizer.
        self.inner = optimizer
        self.model_chunks = [m for m in model_chunks if isinstance(m, HiggsDDP)]
        self.skipped_steps = 0
        self.skip_residuals_on_load = False
        """Set by a loader moving to another layout: residuals are not loaded and stay zero."""
        self.on_skip: list[Callable[[Verdict], None]] = []
        self.decision = StepDecision()
        """Replaced by a store-voting one when the sync's waits are bounded (``--higgs-step-timeout``)."""
        self._verdict: Verdict | None = None
        self.regroup_seconds = 0.0
        for chunk in self.model_chunks:
            chunk.track_nonfinite(True)
        self._ledgers = [chunk.step_ledger() for chunk in self.model_chunks]
        config = self.model_chunks[0].higgs_config if self.model_chunks else None
        if config is not None and config.param_payload != "dense" and any(
                chunk.ddp_config.use_distributed_optimizer for chunk in self.model_chunks):
            for megatron_optimizer, torch_optimizer in torch_optimizers(optimizer):
                separate_fp32_main_params(megatron_optimizer, torch_optimizer)
            for chunk in self.model_chunks:
                chunk.send_param_changes(config.param_payload)
        if config is not None and config.freezes_variance:
            flag = "--higgs-sync onebit" if config.first_moment_exchange else "--higgs-freeze-adam-variance"
            inner = [torch_optimizer for _, torch_optimizer in torch_optimizers(optimizer)]
            for torch_optimizer in inner:  # all checked before any is changed
                check_supported(torch_optimizer, flag)
            moments = _first_moments(optimizer, self.model_chunks) if config.first_moment_exchange else None
            for torch_optimizer in inner:
                freeze_variance(torch_optimizer, config.dense_iters, thawed=DensitySchedule.of(config).refresh_window,
                                first_moment_given=config.first_moment_exchange)
            for chunk, chunk_moments in zip(self.model_chunks, moments or []):
                chunk.set_first_moments(chunk_moments)

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (during unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    state = property(lambda self: self.inner.state, lambda self, value: setattr(self.inner, "state", value))
    param_groups = property(lambda self: self.inner.param_groups,
                            lambda self, value: setattr(self.inner, "param_groups", value))

    def _decide(self) -> Verdict:
        """The step's one decision: the chunks' device flags folded on the device, with each
        chunk's sync failure, agreed by every rank (the step's only read of its gradient path:
        Megatron's own step reads its grad norm right after)."""
        flag = torch.stack([chunk.nonfinite_flag() for chunk in self.model_chunks]).any() if self.model_chunks \
            else None  # still votes: the other ranks wait for this one's
        failures = [failure for chunk in self.model_chunks if (failure := chunk.take_sync_failure())]
        return self.decision.decide(flag, "; ".join(failures) or None,
                                    flag.device if flag is not None else collective_device())

    @torch.no_grad()
    def take_verdict(self) -> Verdict | None:
        """The last step's decision, once: None when no step decided since the last call (a
        caller that reads after each attempt never sees a stale one)."""
        verdict, self._verdict = self._verdict, None
        return verdict

    def step(self):
        verdict = self._verdict = self._decide()
        if verdict.keep:
            result = self.inner.step()
            if result[0]:  # an update the optimizer itself skipped (loss scale) keeps no residual
                for ledger in self._ledgers:
                    ledger.taken += 1
            return result
        self.skipped_steps += 1
        if verdict.sync_failed and self.decision.rebuilds_groups:
            # first: the drain lets given-up collectives finish writing the buffers
            vote = self.decision.vote
            store = vote.store if vote is not None else job_store("higgs/regroup/")
            self.regroup_seconds = rebuild_process_groups(
                self.model_chunks, [megatron for megatron, _ in torch_optimizers(self.inner)], store,
                vote.attempt if vote is not None else self.skipped_steps,
                (self.model_chunks[0].sync_timeout if self.model_chunks else None) or 60.0)
        for chunk in self.model_chunks:
            chunk.rollback_residuals()
            chunk.zero_grad_buffer()
        self.inner.zero_grad()
        for callback in self.on_skip:
            callback(verdict)
        return False, None, None

    def state_dict(self):
        return {"optimizer": self.inner.state_dict(),
                "higgs_residuals": [chunk.residual_state() for chunk in self.model_chunks]}

    def load_state_dict(self, state_dict):
        """Accepts what ``state_dict()`` returned, and what ``dist_checkpointing.load`` returns for
        ``sharded_state_dict()`` (the wrapped optimizer's keys plus ``higgs_residuals``), as
        Megatron-LM's loader passes it."""
        if state_dict.keys() == {"optimizer", "higgs_residuals"}:
            inner, residuals = state_dict["optimizer"], state_dict["higgs_residuals"]
        else:
            inner = {key: value for key, value in state_dict.items() if key != "higgs_residuals"}
            residuals = state_dict.get("higgs_residuals")
        if residuals is None and not self.skip_residuals_on_load:
            raise KeyError("optimizer state has no 'higgs_residuals': it was not saved by HiggsOptimizer")
        self.inner.load_state_dict(inner)
        if residuals is not None:
            self.load_higgs_residuals(residuals)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        state = self.inner.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        if is_loading and self.skip_residuals_on_load:
            return state
        state["higgs_residuals"] = residual_objects(self.model_chunks, loading=is_loading)  # a load fills them
        return state

    def load_higgs_residuals(self, loaded: list) -> None:
        """Restore residuals from what ``dist_checkpointing.load`` returned for them."""
        for chunk, residuals in zip(self.model_chunks, loaded):
            chunk.load_residual_state(residuals.data if isinstance(residuals, ShardedObject) else residuals)


def separate_fp32_main_params(megatron_optimizer, torch_optimizer: torch.optim.Optimizer) -> None:
    """Megatron's distributed optimizer steps an fp32 parameter's shard in place, a view of the
    parameter buffer; its all-gather sent as changes (``reduce.param_gather``) needs the exact
    value apart from what the model holds. Each such view is replaced, in the optimizer's groups
    and its own ``shard_fp32_groups``, by a copy: Megatron's step then copies it into the buffer
    as it copies bf16 parameters' main copies (before any step, so no state moves)."""
    for shard_group in getattr(megatron_optimizer, "shard_fp32_groups", []):
        for index, view in enumerate(shard_group):
            main = view.detach().clone().requires_grad_(view.requires_grad)
            for name, value in vars(view).items():  # tensor-parallel attributes, ``shared``
                setattr(main, name, value)
            for group in torch_optimizer.param_groups:
                group["params"] = [main if param is view else param for param in group["params"]]
            shard_group[index] = main


def _first_moments(optimizer: MegatronOptimizer, model_chunks: list[HiggsDDP]) -> list[FirstMoments]:
    """Each chunk's ``FirstMoments``: every bucket's parameters (with the distributed optimizer,
    this rank's pieces of them), with the torch optimizer that steps each and the parameter it
    holds (ValueError naming a parameter no optimizer steps)."""
    # Megatron's distributed optimizer holds this rank's pieces (a data-parallel group of one, as
    # the virtual group's, gets the plain optimizer: whole parameters, whole moments)
    sharded = any(hasattr(megatron_optimizer, "model_param_group_index_map")
                  for megatron_optimizer, _ in torch_optimizers(optimizer))
    owners: dict[torch.Tensor, tuple[torch.optim.Optimizer, torch.Tensor, int | None, int | None]] = {}
    for megatron_optimizer, torch_optimizer in torch_optimizers(optimizer):
        if hasattr(megatron_optimizer, "model_param_group_index_map"):
            for model_param, (main_param, start, end) in shard_pieces(megatron_optimizer, torch_optimizer).items():
                owners[model_param] = (torch_optimizer, main_param, start, end)
        else:
            for model_param, main_param in main_params(megatron_optimizer, torch_optimizer).items():
                owners[model_param] = (torch_optimizer, main_param, None, None)
    beta = adam_beta1([torch_optimizer for _, torch_optimizer in torch_optimizers(optimizer)])
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    embedding_size = (torch.distributed.get_world_size(parallel_state.get_embedding_group())
                      if parallel_state.get_pipeline_model_parallel_world_size() > 1 else 1)
    moments = []
    for chunk in model_chunks:
        names = {p: n for n, p in chunk.named_parameters()}
        slots = {}
        for group in chunk.higgs_bucket_groups:
            for idx, bucket in enumerate(group.buckets):
                entries = []
                for param in bucket.params_list:
                    if param not in owners:
                        if sharded:
                            continue  # no piece of it in this rank's shard
                        raise ValueError(f"--higgs-sync onebit: parameter {names.get(param, '?')} is in a gradient "
                                         "bucket but no optimizer steps it")
                    torch_optimizer, main_param, start, end = owners[param]
                    if start is None:
                        slot = slot_in_bucket(param, bucket.grad_data)
                        start, end = slot.start, slot.end
                    copies = copies_summed_after_sync(param, names.get(param, ""), chunk.config, tp_size,
                                                      embedding_size)
                    entries.append(MomentSlot(start, end, torch_optimizer, main_param, copies))
                slots[(group.higgs_index, idx)] = entries
        moments.append(FirstMoments(slots, beta, sharded=sharded))
    return moments


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Delegates to the wrapped optimizer's ``{name}``."
    return method


# Every public method of the installed release's MegatronOptimizer that the wrapper does not
# define goes to the wrapped optimizer: a method a release adds (0.19's
# ``prepare_model_params_for_param_sync``) reaches it too, not the base class's no-op.
for _name, _value in vars(MegatronOptimizer).items():
    if not _name.startswith("_") and inspect.isfunction(_value) and _name not in vars(HiggsOptimizer):
        setattr(HiggsOptimizer, _name, _delegate(_name))
HiggsOptimizer.__abstractmethods__ = frozenset()


def wrap_optimizer(optimizer: MegatronOptimizer, model_chunks: list) -> HiggsOptimizer:
    """Wrap a Megatron optimizer for HiggsDDP model chunks (see the module docstring)."""
    return HiggsOptimizer(optimizer, model_chunks)
