"""The all-gather's finish: every peer's payload decoded and summed, against a reference sum."""


import pytest
import torch

from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, SparseGrad
from higgs_megatron.reduce.sparse_allreduce import PendingSparseReduce


@pytest.mark.parametrize("payload,k", [("wide", 40), ("bf16", 40), ("int8", 40), ("int4", 40), ("bf16", 400),
                                       ("int8", 400), ("int4", 400)])
def test_finish_sums_every_peers_payload_against_a_reference_sum(payload, k):
    n = 1000
    plan = BucketPlan(n, [ParamSlot(0, 10), ParamSlot(10, n)], min_param_numel=11, device=torch.device("cpu"),
                      payload=payload)
    layout = plan.layout(k / (n - 10))
    assert layout.encoding == ("int32" if payload == "wide" else {40: "offsets", 400: "bitmap"}[k])
    generator = torch.Generator().manual_seed(0)
    payloads, reference = [], torch.zeros(n)
    for peer in range(3):
        positions = (torch.randperm(n - 10, generator=generator)[:k] + 10).sort().values
        sparse = plan.payload.round(SparseGrad(torch.randn(10, generator=generator), plan.always_positions, positions,
                                               torch.randn(k, generator=generator)), layout)
        payloads.append(plan.payload.pack(sparse, layout))
        reference.index_add_(0, plan.always_positions, sparse.always)
        reference.index_add_(0, positions, sparse.values)
    target = torch.full((n,), 7.0)  # stale contents must not survive
    PendingSparseReduce(work=None, gathered=torch.cat(payloads), world=3, payload=plan.payload, layout=layout,
                        target=target).finish()
    assert torch.equal(target, reference)
