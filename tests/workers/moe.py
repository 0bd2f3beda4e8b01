"""Rank functions for tests/sync/drill_moe.py (run through higgs_megatron_bench.ranks.run_ranks)."""

from __future__ import annotations

import torch

from tests.workers.common import train_variants_on_the_compressed_form


def expert_coordinates() -> dict[str, int]:
    """This rank's place in both layouts: (TP, PP, DP) for the dense parameters, (ETP, EP,
    expert DP) for the experts'."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "edp": ps.get_expert_data_parallel_rank()}


def moe_variants(variants: dict[str, list[str]]) -> dict:
    """``train_variants_on_the_compressed_form``, plus this rank's coordinates in both layouts,
    which parameters are experts' (``allreduce=False``), the bucket groups each domain holds,
    and each routing bias as the first forward of every attempt found it (after
    ``HiggsDDP.forward`` settled it), and each step's gradient norm."""
    from higgs_megatron.ddp import HiggsDDP
    from higgs_megatron.training.loop import Trainer

    groups, experts, biases, coords, norms = {}, set(), {}, {}, {}
    names = iter(variants)  # train_variants builds one Trainer per variant, in order
    original_init, original_step = Trainer.__init__, Trainer.train_step

    def recording_step(self):
        stepped, loss, grad_norm = original_step(self)
        norms.setdefault(self.higgs_variant, []).append(grad_norm)
        return stepped, loss, grad_norm

    def recording_init(self, args, *a, **k):
        original_init(self, args, *a, **k)
        name = self.higgs_variant = next(names)
        coords.update(expert_coordinates())
        for i, chunk in enumerate(self.model):
            experts.update(f"{i}.{n}" for n, p in chunk.module.named_parameters() if not getattr(p, "allreduce", True))
            if isinstance(chunk, HiggsDDP):
                groups[name] = {"dense": [g.higgs_index for g in chunk.bucket_groups],
                                "expert": [g.higgs_index for g in chunk.expert_parallel_bucket_groups]}
            seen = biases.setdefault(name, {})

            def record(module, inputs, trainer=self, seen=seen, chunk_index=i):
                step = trainer.iteration + 1
                if step not in seen:
                    seen[step] = {f"{chunk_index}.{n}": b.detach().clone() for n, b in module.named_buffers()
                                  if n.endswith("expert_bias")}

            chunk.module.register_forward_pre_hook(record)

    Trainer.__init__, Trainer.train_step = recording_init, recording_step
    try:
        out = train_variants_on_the_compressed_form(variants)
    finally:
        Trainer.__init__, Trainer.train_step = original_init, original_step
    return {**out, "coords": coords, "experts": sorted(experts), "groups": groups, "biases": biases,
            "grad_norms": norms}


def replicas_equal(outs: list[dict], variant: str, names: list[str], place: tuple[str, ...]) -> None:
    """Assert that ``names`` of ``variant`` are bitwise equal on every two ranks at the same
    ``place`` (the coordinates that say which shard a rank holds: its replicas share them)."""
    by_place: dict[tuple, list[dict]] = {}
    for out in outs:
        by_place.setdefault(tuple(out["coords"][axis] for axis in place), []).append(out["params"][variant])
    assert any(len(replicas) > 1 for replicas in by_place.values()), "no two replicas to compare"
    for replicas in by_place.values():
        for name in names:
            for other in replicas[1:]:
                assert torch.equal(replicas[0][name], other[name]), f"{variant}: replicas differ at {name}"
