"""The agreed rows' codec, per element of a bucket, beside a copy of the same tensor.

A step's local work on one rank, for one bucket of N elements at P ranks, in 1-bit Adam's
signs and in the dense steps' int8 (``compress.row_codec``; the collectives are not timed):

* ``encode``: its N values to P rows, the residual written back;
* ``owner sum``: the P rows of its shard it received (N / P each), summed;
* ``owner encode``: those sums encoded again (N / P);
* ``decode``: the P rows gathered back, written into the bucket.

Each is timed for the reference (the eager torch ops of ``compress.agreed``) and for the fused
form the run uses (the C loops on a CPU), as nanoseconds per element of the bucket (the
fastest of ``--repeats``), with their total and that total against one copy of the bucket
(``clone``). The buckets hold parameters as a transformer's do: large matrices with small
parameters between them, which go whole and not in the rows. One thread unless ``--threads``.

    python scripts/bench_codec.py [--numel 4e6 25e6] [--world 2 8 64] [--formats sign int8] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.compress import row_codec  # noqa: E402
from higgs_megatron.compress.agreed import AgreedPlan  # noqa: E402
from higgs_megatron_bench.codec import STEPS, bucket_slots, fastest, time_codec  # noqa: E402

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, nargs="+", default=[4e6, 25e6])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", nargs="+", default=list(row_codec.FORMATS), choices=row_codec.FORMATS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fused = {"cpu": row_codec.codec_library() is not None and "the C loops",
             "cuda": row_codec.triton_kernels() is not None and "the Triton kernels"}.get(device.type)
    print(f"device {device}, {args.threads} thread(s); ns per element of the bucket, the fastest of {args.repeats}; "
          f"fused: {fused or 'none here (the reference runs)'}")
    print("| elements | P | format | codec | " + " | ".join(STEPS) + " | total | a copy | total vs a copy |")
    print("|---|---|---|---|" + "---|" * (len(STEPS) + 3))
    for numel in (int(n) for n in args.numel):
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
        copy = fastest(grad.clone, device, args.repeats) / numel * 1e9
        for world in args.world:
            plan = AgreedPlan(numel, bucket_slots(numel), 4096, world, device, "sign", scored=False)
            for fmt in args.formats:
                for codec in ("reference", "fused") if fused else ("reference",):
                    seconds = time_codec(plan, grad, args.repeats, fused=codec == "fused", fmt=fmt)
                    per_element = {k: v / numel * 1e9 for k, v in seconds.items()}
                    total = sum(per_element.values())
                    print(f"| {numel:,} | {world} | {fmt} | {codec} | "
                          + " | ".join(f"{per_element[k]:.2f}" for k in STEPS)
                          + f" | **{total:.2f}** | {copy:.2f} | {total / copy:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
