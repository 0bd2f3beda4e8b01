"""``runtime.attach``: what it refuses before wiring anything. One process."""

import pytest
import torch

from higgs_megatron.ddp import HiggsConfigurationError
from higgs_megatron.runtime.attach import attach
from higgs_megatron.runtime.metrics import MetricsLogger
from higgs_megatron.runtime.run_config import PRETRAIN, run_config_from_args
from higgs_megatron.training.arguments import build_parser


def test_use_higgs_without_a_higgs_ddp_chunk_is_an_error_never_a_dense_run():
    """A front-end whose Megatron wrapped the model in its own DDP (megatron-core 0.19's model
    builders) must not train dense under --use-higgs's name."""
    args = build_parser().parse_args(["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                                      "--seq-length", "8", "--micro-batch-size", "1", "--use-higgs"])
    config = run_config_from_args(args, PRETRAIN, 2, 10, 0)
    with pytest.raises(HiggsConfigurationError, match=r"--use-higgs: none of the model chunks is a HiggsDDP "
                                                      r"\(Megatron built Linear\)"):
        attach([torch.nn.Linear(2, 2)], object(), config, MetricsLogger(is_writer=False))
