"""Run by tests/compress/test_row_triton.py in a process of its own, under Triton's interpreter
(TRITON_INTERPRET=1, read when the kernels are defined): the Triton kernels against the
reference on every plan of tests/compress/test_row_codec.py, bit for bit; exits non-zero
naming the first difference."""

from __future__ import annotations

import sys

from higgs_megatron.compress import row_triton
from higgs_megatron_bench.codec import first_difference, one_rank_codec
from tests.compress.test_row_codec import PLANS, cases


def main() -> int:
    for name in PLANS:
        for plan, grad, rank, owner_residual in cases(name):
            differ = first_difference(one_rank_codec(plan, grad, rank, owner_residual, kernels=row_triton),
                                      one_rank_codec(plan, grad, rank, owner_residual, fused=False))
            if differ:
                print(f"{name}, rank {rank}: the Triton kernels' {differ} differ from the reference's", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
