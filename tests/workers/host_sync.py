"""Rank functions for tests/sync/drill_host_sync.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations


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
    from tests.workers.host_sync_audit import HostSyncAudit
    from higgs_megatron.training.arguments import parse_args
    from higgs_megatron.training.launch import training_environment
    from higgs_megatron.training.loop import Trainer

    args = parse_args(argv)
    audit = HostSyncAudit("higgs_megatron")
    counts = {"depth": 0, "start_grad_sync": 0, "finish_grad_sync": 0, "nonfinite_flag": 0, "start_param_sync": 0}
    audited = [(HiggsBucketGroup, "start_grad_sync"), (HiggsBucketGroup, "finish_grad_sync"),
               (HiggsDDP, "nonfinite_flag"), (HiggsBucketGroup, "start_param_sync")]
    originals = {(owner, name): getattr(owner, name) for owner, name in audited}
    inherited = {(owner, name) for owner, name in audited if name not in vars(owner)}  # e.g. finish_grad_sync

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

    try:
        for (owner, name), original in originals.items():
            setattr(owner, name, audited_call(name, original))
        with training_environment(args):
            trainer = Trainer(args)
            trainer.train()
            trainer.close()
    finally:
        for (owner, name), original in originals.items():
            if (owner, name) not in inherited:
                setattr(owner, name, original)
            elif name in vars(owner):  # patched here, found on a base class before
                delattr(owner, name)
    counts.pop("depth")
    return {"calls": dict(audit.calls), **counts}
