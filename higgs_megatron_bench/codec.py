"""One rank's local work in a compressed step of 1-bit Adam's exchange, and its timing, for the
codec's tests and benchmarks (tests/compress/test_sign_codec.py, tests/workers/sign_triton.py,
scripts/bench_codec.py, scripts/gpu_check.py): what ``reduce.agreed_reduce`` computes between
the collectives, with every rank's rows standing in for what it receives."""

from __future__ import annotations

import time
from types import ModuleType
from typing import Callable

import torch

from higgs_megatron.compress import sign_codec
from higgs_megatron.compress.agreed import AgreedPlan
from higgs_megatron.compress.compressor import ParamSlot

STEPS = ("encode", "owner sum", "owner encode", "decode")


def bucket_slots(numel: int, layers: int = 4) -> list[ParamSlot]:
    """Per layer a matrix, a bias and a norm, then a matrix: as a transformer layer's bucket."""
    slots, at, per = [], 0, numel // layers
    for _ in range(layers):
        big = (per - 2048) // 2
        for size in (big, 1024, big, 1024):
            slots.append(ParamSlot(at, at + size))
            at += size
    return slots


def fastest(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def time_codec(plan: AgreedPlan, grad: torch.Tensor, repeats: int, fused: bool = True) -> dict[str, float]:
    """Seconds of each of ``STEPS`` for rank 0 (the fastest of ``repeats``); ``fused`` False: the reference."""
    positions, real = plan.select(torch.empty(0, device=grad.device), 1.0)
    span, device = plan.layout(1.0).span, grad.device
    runs = plan.sign_runs if fused else None
    mine_runs = runs.row(0) if runs is not None else None
    left, bucket = torch.empty_like(grad), torch.empty_like(grad)
    rows = sign_codec.encode(grad, positions, real, span, left, runs)
    mine = real.narrow(0, 0, 1)
    sums = sign_codec.decode_sum(rows, mine, real.shape[1], span, mine_runs)
    owner_left = torch.empty_like(sums)

    def decode() -> None:
        bucket.zero_()
        sign_codec.decode_add(rows, positions, real, span, bucket, runs)

    return {"encode": fastest(lambda: sign_codec.encode(grad, positions, real, span, left, runs), device, repeats),
            "owner sum": fastest(lambda: sign_codec.decode_sum(rows, mine, real.shape[1], span, mine_runs),
                                 device, repeats),
            "owner encode": fastest(lambda: sign_codec.encode(sums, None, mine, span, owner_left, mine_runs),
                                    device, repeats),
            "decode": fastest(decode, device, repeats)}


OUTPUTS = ("rows", "residual", "owner sums", "owner rows", "owner residual", "bucket", "bucket written over")


def one_rank_codec(plan: AgreedPlan, grad: torch.Tensor, rank: int, owner_residual: torch.Tensor,
                   fused: bool = True, kernels: ModuleType = sign_codec) -> tuple[torch.Tensor, ...]:
    """``OUTPUTS`` for ``rank``: its rows of ``grad`` and the residual; as the owner of its shard,
    the sum of ``plan.world`` copies of its row, plus ``owner_residual``, re-signed; its rows
    decoded into a bucket of zeros, and written over one of NaNs. ``fused`` False: the reference; ``kernels``: ``sign_codec`` (which
    dispatches) or a kernel module of the same functions (``sign_triton``)."""
    positions, real = plan.select(torch.empty(0, device=grad.device), 1.0)
    span, runs = plan.layout(1.0).span, plan.sign_runs if fused else None
    left = torch.full_like(grad, float("nan"))
    rows = kernels.encode(grad, positions, real, span, left, runs)
    received = rows.narrow(0, rank, 1).repeat(plan.world, 1)
    mine_real = real.narrow(0, rank, 1)
    mine = runs.row(rank) if runs is not None else None
    sums = kernels.decode_sum(received, mine_real, real.shape[1], span, mine)
    sums.add_(owner_residual)
    owner_left = torch.empty_like(sums)
    owner_rows = kernels.encode(sums, None, mine_real, span, owner_left, mine)
    bucket = torch.zeros_like(grad)
    kernels.decode_add(rows, positions, real, span, bucket, runs)
    written = torch.full_like(grad, float("nan")).index_fill_(0, plan.outside_rows, 0)  # what finish hands it
    kernels.decode_add(rows, positions, real, span, written, runs, overwrite=True)
    return rows, left, sums, owner_rows, owner_left, bucket, written


def first_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> str | None:
    """The first of ``OUTPUTS`` whose bytes differ between ``a`` and ``b`` (None: all equal)."""
    for what, x, y in zip(OUTPUTS, a, b):
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return what
    return None
