"""The reusable training loop behind ``examples/pretrain_gpt.py`` (data, model, logging)."""

import warnings

# megatron-core announces at import that it falls back to torch kernels when neither
# Transformer Engine nor Apex is installed: expected on CPU, and once per rank is noise.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex) (are|is) not installed.*")
# megatron-core 0.16.1's TransformerConfig warns about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message="full scope is deprecated")
# torch 2.13 renamed the collective megatron-core's distributed optimizer calls.
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor` is deprecated.*")
