"""Selection cost of exact top-k against the sampled threshold, on gradient-like tensors.

For each size, times ``compress`` (the whole per-bucket path: magnitudes, layer-wise
selection, gathering values) with exact ``topk`` and with ``sampled-topk`` at the given
density, and reports the sampled selector's shortfall (coordinates it failed to find, as a
fraction of k; 0 means its selection was the exact top-k). The sampled selector reuses its
threshold across steps, so it is timed over several steps of a slowly changing gradient.
Runs on CUDA when available, else on CPU with the given threads.

    python scripts/bench_compressors.py [--sizes 3.3e6 12.9e6 1e8] [--density 0.01]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.compress.compressor import BucketPlan, ParamSlot, compress, make_selector  # noqa: E402


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[3.3e6, 12.9e6])
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, density {args.density}, {args.steps} steps per measurement")
    print("| elements | params | exact top-k (ms) | sampled top-k (ms) | speed-up | sampled shortfall |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        n = int(size)
        # parameters shaped like a transformer bucket: a few large matrices
        per = max(1, n // 8)
        slots = [ParamSlot(i * per, min(n, (i + 1) * per)) for i in range(8)]
        plan = BucketPlan(n, slots, min_param_numel=0, device=device)
        generator = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(n, generator=generator, device=device)
        results = {}
        for name in ("topk", "sampled-topk"):
            selector = make_selector(name)
            compress(base.clone(), plan, args.density, selector, key=0)  # warm-up (and first threshold)
            total = 0.0
            for step in range(args.steps):
                grad = base + 0.1 * torch.randn(n, generator=generator, device=device)
                total += timed(lambda: compress(grad, plan, args.density, selector, key=0), device)
            results[name] = (total / args.steps, selector.stats.shortfall)
        exact, sampled = results["topk"][0], results["sampled-topk"][0]
        print(f"| {n:,} | {len(slots)} | {exact * 1e3:.1f} | {sampled * 1e3:.1f} | {exact / sampled:.2f}x | "
              f"{results['sampled-topk'][1]:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
