"""higgs-megatron: compressed data-parallel gradient sync, rank-mapped checkpoints and
stability for megatron-core training, without changing the training loop.

Three calls in your own loop::

    higgs = HiggsConfig(compression_ratio=0.01)                          # 1. configure
    model = HiggsDDP(config, ddp_config, gpt_model, higgs_config=higgs)  # 2. instead of Megatron's DDP
    optimizer = wrap_optimizer(get_megatron_optimizer(opt_config, [model]), [model])  # 3.
"""

__version__ = "0.1.0"

import warnings  # noqa: E402

# megatron-core announces at import that it falls back to torch kernels when neither
# Transformer Engine nor Apex is installed: expected on CPU, and once per rank is noise.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex) (are|is) not installed.*")
# megatron-core 0.16.1's TransformerConfig warns about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message="full scope is deprecated")
# torch 2.13 renamed the collective megatron-core's distributed optimizer calls.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated.*")

from .config import HiggsConfig  # noqa: E402
from .ddp import HiggsDDP  # noqa: E402
from .optimizer import HiggsOptimizer, wrap_optimizer  # noqa: E402

__all__ = ["HiggsConfig", "HiggsDDP", "HiggsOptimizer", "wrap_optimizer", "__version__"]
