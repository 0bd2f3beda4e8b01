"""Convergence of top-k with and without error feedback against dense Megatron DDP.

Trains the same GPT on the default corpus three times (same seed, data and iterations):
Megatron's own DDP, ``--use-higgs`` top-k at 1% with error feedback, and the same without
error feedback. Both compressed runs take the same schedule: dense for the first quarter of
the iterations (``--higgs-dense-iters``), Adam's second moment frozen as that ends
(``--higgs-freeze-adam-variance``), then density from 1 to the target over the next third
(``--higgs-density-warmup-iters``). Writes ``convergence.md`` (final validation loss, ratio
to dense, bytes per step at the end and over the whole run) and ``convergence.png`` (the
validation-loss curves) into ``--out``. ``--runs dense,ef`` leaves out the run without error
feedback, which a long run on CPU may spare.

The default is the long run, 9,600 iterations, where 1% with error feedback ends within 2%
of dense (about 40 minutes per run on a 2-core CPU); ``--train-iters 600`` is a quick look,
where it does not (1.04x).

    python scripts/bench_convergence.py [--train-iters 9600] [--nproc 2] [--runs dense,ef,no-ef]
                                        [--out runs/convergence]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.benchmarks import (REPO, higgs_flags, markdown_table, run_pretrain, summarize,  # noqa: E402
                                       validation_curve)


RUNS = ("dense", "ef", "no-ef")


def runs_list(value: str) -> list[str]:
    runs = [r.strip() for r in value.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or "dense" not in runs:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(RUNS)} that includes "
                                         f"dense, got {value!r}")
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-iters", type=int, default=9600)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--dense-iters", type=int, default=None, help="default: a quarter of --train-iters")
    parser.add_argument("--density-warmup-iters", type=int, default=None, help="default: a third of --train-iters")
    parser.add_argument("--out", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--runs", default=",".join(RUNS), type=runs_list,
                        help=f"comma-separated, from {', '.join(RUNS)} (dense is needed: the ratios are to it)")
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; train nothing")
    parser.add_argument("extra", nargs="*", help="more pretrain flags for every run, after -- (not --higgs-* "
                        "ones: the dense run refuses them; the compressed runs take --density and the schedule flags)")
    args = parser.parse_args()
    out = Path(args.out)
    common = ["--train-iters", str(args.train_iters), "--log-interval", "10",
              "--eval-interval", str(max(1, args.train_iters // 12)), "--eval-iters", "10",
              "--overlap-grad-reduce", "--ddp-bucket-size", "250000", *args.extra]
    higgs = higgs_flags(args.density, args.train_iters, args.dense_iters, args.density_warmup_iters)
    configurations = {
        "dense": ("megatron-ddp (dense)", common),
        "ef": (f"higgs top-k {args.density:g} + error feedback", common + higgs),
        "no-ef": (f"higgs top-k {args.density:g}, no error feedback", common + higgs + ["--no-higgs-error-feedback"]),
    }
    rows, curves = {}, {}
    for i, (key, (name, flags)) in enumerate(configurations.items()):
        if key not in args.runs:
            continue
        log = out / f"run{i}.jsonl"
        if not args.reuse:
            run_pretrain(flags, log, args.nproc, quiet=True)
        rows[name], curves[name] = summarize(log), validation_curve(log)
    dense = next(iter(rows.values()))["final validation loss"]
    for row in rows.values():
        row["loss vs dense"] = row["final validation loss"] / dense
    table = markdown_table(rows, ["iterations", "final validation loss", "loss vs dense", "bytes sent per step at the end",
                                  "traffic over the run vs dense", "tokens/s"], baseline="megatron-ddp (dense)")
    table = f"Compressed runs: `{' '.join(higgs)}`\n\n{table}"
    (out / "convergence.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'higgs-megatron[bench]')")
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    ax.set_title("GPT on the Python standard library, DP=2, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=120)
    print(f"wrote {out / 'convergence.md'} and {out / 'convergence.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
