"""The sign codec's Triton kernels (compress/row_triton.py), without a GPU: compiled for one by
Triton's own compiler (to a cubin for sm_90), and run in Triton's interpreter against the
reference, bit for bit (tests/workers/row_triton.py). Skipped where Triton is not installed
(a CPU build of torch); the 3.12 run of CI has it."""

import os
import subprocess
import sys

import pytest

from higgs_megatron_bench.ranks import REPO_ROOT

triton = pytest.importorskip("triton", reason="Triton is not installed (a CPU build of torch)")


def test_the_kernels_equal_the_reference_bit_for_bit_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", HIGGS_CODEC="reference")
    done = subprocess.run([sys.executable, "-m", "tests.workers.row_triton"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("span", [256, 40])
def test_the_kernels_compile_for_a_gpu(span):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from higgs_megatron.compress import row_triton

    p2 = 1 << (span - 1).bit_length()
    shape = {"SPAN": span, "P2": p2}
    common = {"width": "i32", "n_scales": "i32", "row_bytes": "i32", "SPAN": "constexpr", "P2": "constexpr"}
    kernels = {
        "encode": (row_triton._encode, {"src": "*fp32", "positions": "*i64", "real": "*i1", "wire": "*u8",
                                         "scales": "*fp32", "left": "*fp32", **common, "LOG2": "constexpr",
                                         "ROWS": "constexpr"}, {"LOG2": p2.bit_length() - 1}),
        "decode_sum": (row_triton._decode_sum, {"wire": "*u8", "scales": "*fp32", "real_row": "*i1", "sums": "*fp32",
                                                 "rows": "i32", **common}, {}),
        "decode_add": (row_triton._decode_add, {"wire": "*u8", "scales": "*fp32", "positions": "*i64", "real": "*i1",
                                                 "target": "*fp32", **common, "OVERWRITE": "constexpr"}, {}),
    }
    for name, (kernel, signature, extra) in kernels.items():
        flag = {"encode": "ROWS", "decode_add": "OVERWRITE"}.get(name)
        for value in (False, True) if flag else (None,):
            constants = {**shape, **extra, **({flag: value} if flag else {})}
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants),
                                      target=GPUTarget("cuda", 90, 32))
            assert "cubin" in compiled.asm and compiled.asm["cubin"], name
