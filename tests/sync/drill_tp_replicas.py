"""Tensor-parallel replicas under compression: a parameter every rank of a TP group holds whole
(layer norms, a row-parallel layer's bias) must stay the same on each. Its gradient is the same
on each; a payload scale shared with coordinates of a TP-sharded parameter, which differ, would
round it differently on each rank and the replicas would drift apart. So such a parameter is
sent whole whatever its size (``compress.compressor.ParamSlot.whole``). The small parameter
threshold is set low here so that, as in a model of hidden size 1,024 or more at the default
threshold, the replicas are large enough to be compressed."""

import pytest
import torch

from higgs_megatron_bench.ranks import run_ranks
from tests.workers.common import train_variants

FORMS = {
    "sparse-int4-int8-dense": ["--higgs-sync", "sparse", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25"],
    "agreed-int4": ["--higgs-sync", "agreed", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25"],
    "sharded-int4": ["--higgs-sync", "sharded", "--higgs-payload", "int4", "--higgs-compression-ratio", "0.25"],
    "onebit": ["--higgs-sync", "onebit"],
}


def test_tp_replicated_parameters_stay_equal_on_every_form(tiny_gpt_args):
    base = tiny_gpt_args + ["--tensor-model-parallel-size", "2", "--global-batch-size", "16", "--train-iters", "6",
                            "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--use-higgs", "--higgs-dense-iters",
                            "2", "--higgs-min-bucket-numel", "0", "--higgs-min-param-numel", "32"]
    variants = {name: base + flags for name, flags in FORMS.items()}
    outs = run_ranks(train_variants, 4, args=(variants,), timeout=600)
    by_rank = {(out["coords"]["dp"], out["coords"]["tp"]): out["params"] for out in outs}
    replicated = [name for name in by_rank[(0, 0)]["onebit"] if "layernorm" in name or "linear_proj.bias" in name
                  or "linear_fc2.bias" in name]
    assert len(replicated) >= 8, replicated
    for form in FORMS:
        for dp in (0, 1):
            first, second = by_rank[(dp, 0)][form], by_rank[(dp, 1)][form]
            for name in replicated:
                assert torch.equal(first[name], second[name]), f"{form}: TP replicas of {name} differ (DP rank {dp})"
