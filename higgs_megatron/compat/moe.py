"""Where megatron-core's mixture-of-experts code differs between the supported releases.

megatron-core 0.16.1 imports ``te_general_gemm`` into ``transformer.moe.moe_utils`` only when
Transformer Engine is installed, yet the router's gating GEMM reads it either way: without
Transformer Engine (on CPU, or a GPU install without it) every MoE forward raises
``NameError``. 0.19 binds the name to None when Transformer Engine is absent, which selects
the plain ``torch.mm`` path; ``define_absent_te_gemm`` does the same on a release that does not.
"""

from __future__ import annotations


def define_absent_te_gemm() -> None:
    """Bind ``moe_utils.te_general_gemm`` to None where the release left it undefined (as 0.19
    does without Transformer Engine). Idempotent; a no-op where the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
