"""One rank's local work in a compressed step of 1-bit Adam's exchange, and its timing, for the
codec's tests and benchmarks (tests/compress/test_row_codec.py, tests/workers/row_triton.py,
scripts/bench_codec.py, scripts/gpu_check.py): what ``reduce.agreed_reduce`` computes between
the collectives, with every rank's rows standing in for what it receives."""

from __future__ import annotations

import time
from types import ModuleType
from typing import Callable

import torch

from higgs_megatron.compress import row_codec
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


def time_codec(plan: AgreedPlan, grad: torch.Tensor, repeats: int, fused: bool = True, fmt: str = "sign"
               ) -> dict[str, float]:
    """Seconds of each of ``STEPS`` for rank 0 in ``fmt`` (the fastest of ``repeats``); ``fused``
    False: the reference."""
    positions, real = plan.select(torch.empty(0, device=grad.device), 1.0)
    span, device = plan.layout(1.0).span, grad.device
    runs = plan.row_runs if fused else None
    mine_runs = runs.row(0) if runs is not None else None
    left, bucket = torch.empty_like(grad), torch.empty_like(grad)
    rows = row_codec.encode(grad, positions, real, span, left, runs, fmt)
    mine = real.narrow(0, 0, 1)
    sums = row_codec.decode_sum(rows, mine, real.shape[1], span, mine_runs, fmt)
    owner_left = torch.empty_like(sums)
    bucket.index_fill_(0, plan.outside_rows, 0)

    def decode() -> None:  # as the exchange's finish: written over
        row_codec.decode_add(rows, positions, real, span, bucket, runs, overwrite=True, fmt=fmt)

    return {"encode": fastest(lambda: row_codec.encode(grad, positions, real, span, left, runs, fmt), device, repeats),
            "owner sum": fastest(lambda: row_codec.decode_sum(rows, mine, real.shape[1], span, mine_runs, fmt),
                                 device, repeats),
            "owner encode": fastest(lambda: row_codec.encode(sums, None, mine, span, owner_left, mine_runs, fmt),
                                    device, repeats),
            "decode": fastest(decode, device, repeats)}


OUTPUTS = ("rows", "residual", "owner sums", "owner rows", "owner residual", "bucket", "bucket written over", "owners' rows decoded")


def one_rank_codec(plan: AgreedPlan, grad: torch.Tensor, rank: int, owner_residual: torch.Tensor,
                   fused: bool = True, kernels: ModuleType = row_codec, fmt: str = "sign") -> tuple[torch.Tensor, ...]:
    """``OUTPUTS`` for ``rank``: its rows of ``grad`` and the residual; as the owner of its shard,
    the sum of ``plan.world`` copies of its row, plus ``owner_residual``, re-signed; its rows
    decoded into a bucket of zeros, and written over one of NaNs; its owner's row, as every
    owner's, decoded into a bucket. ``fused`` False: the reference; ``kernels``: ``row_codec`` (which
    dispatches) or a kernel module of the same functions (``row_triton``); ``fmt``: the rows'
    format (``row_codec.FORMATS``; a kernel module other than ``row_codec`` takes signs)."""
    extra = {"fmt": fmt} if kernels is row_codec else {}
    positions, real = plan.select(torch.empty(0, device=grad.device), 1.0)
    span, runs = plan.layout(1.0).span, plan.row_runs if fused else None
    left = torch.full_like(grad, float("nan"))
    rows = kernels.encode(grad, positions, real, span, left, runs, **extra)
    received = rows.narrow(0, rank, 1).repeat(plan.world, 1)
    mine_real = real.narrow(0, rank, 1)
    mine = runs.row(rank) if runs is not None else None
    sums = kernels.decode_sum(received, mine_real, real.shape[1], span, mine, **extra)
    sums.add_(owner_residual)
    owner_left = torch.empty_like(sums)
    owner_rows = kernels.encode(sums, None, mine_real, span, owner_left, mine, **extra)
    bucket = torch.zeros_like(grad)
    kernels.decode_add(rows, positions, real, span, bucket, runs, **extra)
    written = torch.full_like(grad, float("nan")).index_fill_(0, plan.outside_rows, 0)  # what finish hands it
    kernels.decode_add(rows, positions, real, span, written, runs, overwrite=True, **extra)
    gathered = torch.zeros_like(grad)  # the owner's row standing in for every owner's (its padding not 0)
    kernels.decode_add(owner_rows.repeat(plan.world, 1), positions, real, span, gathered, runs, **extra)
    return rows, left, sums, owner_rows, owner_left, bucket, written, gathered


def first_difference(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> str | None:
    """The first of ``OUTPUTS`` whose bytes differ between ``a`` and ``b`` (None: all equal)."""
    for what, x, y in zip(OUTPUTS, a, b):
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return what
    return None
