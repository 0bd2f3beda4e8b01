"""Convergence and bytes over a whole run: compressed schedules against dense Megatron DDP and the peer.

Trains the same GPT on the default corpus (same seed, data and iterations), each run a job of
its own, and compares, per run: the final validation loss, bytes handed to collectives over
the whole run and per step at the end, and tokens/s. The runs (``--runs``, in this order):

* ``dense``: Megatron's own DDP, fp32 (the baseline of every ratio);
* ``peer``: PyTorch DDP with its fp16 compression hook (``scripts/peer_torch_ddp.py``): the
  one-line option a user would pick instead, at half the bytes;
* ``ef``: ``--use-higgs`` top-k at ``--density`` with error feedback, the benchmark's schedule
  since the first release: dense for the first quarter of the iterations, Adam's second moment
  frozen as that ends, density from 1 to the target over the next third, wide payload;
* ``lean``: the schedule for fewer bytes (``--lean-*`` flags): a dense stage sent in int8 (or
  bf16) up to the end of the learning-rate warm-up, a short ramp, and a compact payload (by
  default 25% of the coordinates, a bitmap and 4-bit values), with Adam as it is: at 25%
  error feedback's bursts are a few steps long, and a frozen second moment cost more loss
  than they do. ``--lean-freeze-variance`` freezes it after the dense stage and refreshes it in
  short dense windows at 2, 4, 8... times the dense stage (the lean schedule before that was
  measured; ``docs/experiments/convergence.md``);
* ``agreed``: the lean schedule on the agreed form (``--higgs-sync agreed``: every rank the same
  blocks, summed by an all-to-all, so its wire bytes per rank do not grow with the DP size);
* ``onebit``: ``--use-higgs --higgs-sync onebit``, 1-bit Adam's exchange (``first_moment``): a
  dense stage as long as the learning-rate warm-up (its steps in int8), then every rank's share
  of Adam's first moment, every coordinate as a sign, summed by the agreed exchange, Adam's
  second moment frozen (``--onebit-refresh-iters`` refreshes it in dense windows at 2, 4, 8...
  times the dense stage);
* ``default``: ``--use-higgs`` alone, the schedule it derives (1-bit Adam's exchange, its second
  moment thawed in short dense windows; with ``--use-distributed-optimizer`` among the extra
  flags, the parameter all-gather as int4 changes);
* ``no-ef``: ``ef`` without error feedback.

``--scale 2,8,v64`` makes the table by P instead (``scale_table``): Megatron's DDP, the bf16
peer, the sharded top-k form and ``--use-higgs`` at each P, with and without the distributed
optimizer, the P = 1,024 count and ``scale.png``.

Writes ``convergence.md`` and ``convergence.png`` (the validation-loss curves, and each run's
loss ratio against its wire bytes per rank over the run, at this run's DP size) into ``--out``. ``--also LOG=NAME`` adds the JSONL
log of another run (an experiment) to the table and the plot.

``--virtual-dp P`` trains every run over P ranks in one process (``scripts/virtual_dp.py``: each
rank its own samples, residuals and sync, the collectives computed as gloo computes them),
for the loss at a data-parallel size this machine cannot hold as processes.

The default is the long run, 9,600 iterations (about 40 minutes per run on a 2-core CPU);
``--train-iters 2400`` is the short one.

    python scripts/bench_convergence.py [--train-iters 9600] [--nproc 2 | --virtual-dp 64]
                                        [--runs dense,peer,ef,lean] [--out runs/convergence] [--keep]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from higgs_megatron_bench.runs import (REPO, finished, higgs_flags, lean_flags, markdown_table,  # noqa: E402
                                       run_pretrain, summarize, validation_curve)
from higgs_megatron.compress.payload import PAYLOADS  # noqa: E402
from higgs_megatron.logs import get_logger, setup_logging  # noqa: E402

log = get_logger("bench_convergence")


RUNS = ("dense", "peer", "ef", "lean", "agreed", "sharded", "onebit", "default", "no-ef")


def runs_list(value: str) -> list[str]:
    runs = [r.strip() for r in value.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or "dense" not in runs:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(RUNS)} that includes "
                                         f"dense, got {value!r}")
    return runs


def lean_schedule(args: argparse.Namespace, sync: str = "sparse") -> list[str]:
    """``benchmarks.lean_flags`` with this script's ``--lean-*`` flags."""
    refresh = {} if args.lean_refresh_iters is None else {"refresh_iters": args.lean_refresh_iters}
    return lean_flags(args.train_iters, args.lean_density, args.lean_payload, args.lean_dense_wire,
                      args.lean_dense_iters, args.lean_ramp_iters, args.lean_freeze_variance, sync=sync, **refresh)


def also_log(value: str) -> tuple[Path, str]:
    log, _, name = value.partition("=")
    if not name or not Path(log).is_file():
        raise argparse.ArgumentTypeError(f"expected LOG=NAME with LOG an existing JSONL log, got {value!r}")
    return Path(log), name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-iters", type=int, default=9600)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--virtual-dp", type=int, default=None, metavar="P",
                        help="train over P virtual ranks in one process (scripts/virtual_dp.py) instead of --nproc "
                        "real ones; the dense run is Megatron's reduction through the same harness "
                        "(--use-higgs --higgs-compressor none); no peer run")
    parser.add_argument("--density", type=float, default=0.01, help="the ef and no-ef runs' density")
    parser.add_argument("--dense-iters", type=int, default=None, help="ef, no-ef: default a quarter of --train-iters")
    parser.add_argument("--density-warmup-iters", type=int, default=None,
                        help="ef, no-ef: default a third of --train-iters")
    parser.add_argument("--lean-density", type=float, default=0.25)
    parser.add_argument("--lean-payload", choices=PAYLOADS, default="int4")
    parser.add_argument("--lean-dense-wire", choices=("bf16", "int8"), default="int8",
                        help="the dense steps' wire: --higgs-dense-bf16 or --higgs-dense-int8")
    parser.add_argument("--lean-dense-iters", type=int, default=None,
                        help="default: the learning-rate warm-up, a tenth of --train-iters")
    parser.add_argument("--lean-ramp-iters", type=int, default=None, help="default: a twentieth of --train-iters")
    parser.add_argument("--lean-freeze-variance", action="store_true",
                        help="freeze Adam's second moment after the dense stage (--higgs-freeze-adam-variance)")
    parser.add_argument("--lean-refresh-iters", type=int, default=None, help="with --lean-freeze-variance: "
                        "--higgs-variance-refresh-iters (default: benchmarks.lean_flags's; 0: the second moment stays frozen)")
    parser.add_argument("--onebit-dense-iters", type=int, default=None,
                        help="onebit: --higgs-dense-iters (default: the learning-rate warm-up)")
    parser.add_argument("--onebit-refresh-iters", type=int, default=0,
                        help="onebit: --higgs-variance-refresh-iters (default 0: the second moment stays frozen)")
    parser.add_argument("--scale", default=None, metavar="P,P,vP",
                        help="the table by P instead (see scale_table): data-parallel sizes, 'v' for the virtual group "
                             "(e.g. 2,8,v64), each with and without the distributed optimizer")
    parser.add_argument("--out", default=str(REPO / "runs" / "convergence"))
    parser.add_argument("--runs", default="dense,peer,ef,lean", type=runs_list,
                        help=f"comma-separated, from {', '.join(RUNS)} (dense is needed: the ratios are to it)")
    parser.add_argument("--also", action="append", default=[], type=also_log, metavar="LOG=NAME",
                        help="add another run's JSONL log to the table and the plot")
    parser.add_argument("--reuse", action="store_true", help="tabulate the logs already in --out; train nothing")
    parser.add_argument("--keep", action="store_true", help="train only the runs without a finished log in --out "
                        "(one that reached --train-iters): an interrupted benchmark goes on where it stopped")
    parser.add_argument("extra", nargs="*", help="more pretrain flags for every run, after -- (not --higgs-* "
                        "ones: the dense run refuses them; the compressed runs take --density and the schedule flags)")
    return parser


def written_with_pyplot(path: Path, table: str):
    """Write and print ``table``; then matplotlib's pyplot for the PNG, or None (saying so)
    where matplotlib is not installed."""
    path.write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'higgs-megatron[bench]')")
        return None
    return plt


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    if args.lean_refresh_iters is not None and not args.lean_freeze_variance:
        parser.error("--lean-refresh-iters refreshes a frozen second moment: it needs --lean-freeze-variance")
    setup_logging()
    out = Path(args.out)
    if args.scale:
        return scale_table(args, out)
    common = ["--train-iters", str(args.train_iters), "--log-interval", "10",
              "--eval-interval", str(max(1, args.train_iters // 12)), "--eval-iters", "10",
              "--overlap-grad-reduce", "--ddp-bucket-size", "250000", *args.extra]
    higgs = higgs_flags(args.density, args.train_iters, args.dense_iters, args.density_warmup_iters)
    lean = lean_schedule(args)
    onebit = ["--use-higgs", "--higgs-sync", "onebit", "--higgs-variance-refresh-iters", str(args.onebit_refresh_iters)]
    if args.onebit_dense_iters is not None:
        onebit += ["--higgs-dense-iters", str(args.onebit_dense_iters)]
    peer = [flag for flag in common if flag != "--overlap-grad-reduce"]  # torch DDP always overlaps
    configurations = {
        "dense": ("megatron-ddp (dense, fp32)", common, "examples/pretrain_gpt.py"),
        "peer": ("torch DDP + fp16 compression hook", peer + ["--comm-hook", "fp16"], "scripts/peer_torch_ddp.py"),
        "ef": (f"higgs top-k {args.density:g} + error feedback (the first schedule)", common + higgs,
               "examples/pretrain_gpt.py"),
        "lean": (f"higgs top-k {args.lean_density:g}, {args.lean_payload} payload, {args.lean_dense_wire} dense "
                 f"stage{', frozen second moment' if args.lean_freeze_variance else ''} (lean)",
                 common + lean, "examples/pretrain_gpt.py"),
        "agreed": (f"higgs agreed blocks {args.lean_density:g}, {args.lean_payload} values, {args.lean_dense_wire} "
                   "dense stage (the lean schedule, --higgs-sync agreed)",
                   common + lean_schedule(args, sync="agreed"), "examples/pretrain_gpt.py"),
        "sharded": (f"higgs sharded top-k {args.lean_density:g}, {args.lean_payload} payload, {args.lean_dense_wire} "
                    "dense stage (the lean schedule, --higgs-sync sharded)",
                    common + lean_schedule(args, sync="sharded"), "examples/pretrain_gpt.py"),
        "onebit": ("higgs 1-bit Adam (--higgs-sync onebit)", common + onebit, "examples/pretrain_gpt.py"),
        "default": ("--use-higgs (as derived: 1-bit Adam)", common + ["--use-higgs"], "examples/pretrain_gpt.py"),
        "no-ef": (f"higgs top-k {args.density:g}, no error feedback", common + higgs + ["--no-higgs-error-feedback"],
                  "examples/pretrain_gpt.py"),
    }
    if args.virtual_dp is not None:
        if "peer" in args.runs:
            parser.error("--virtual-dp: the peer (PyTorch DDP) does not run in the virtual group; drop it from --runs")
        name, flags, script = configurations["dense"]
        configurations["dense"] = (name, flags + ["--use-higgs", "--higgs-compressor", "none"], script)
    rows, curves = {}, {}
    for key, (name, flags, script) in configurations.items():
        if key not in args.runs:
            continue
        log_json = out / f"{key}.jsonl"
        if args.keep and finished(log_json, args.train_iters):
            log.info(f"{key}: {log_json} is a finished run of {args.train_iters} iterations, kept")
        elif not args.reuse:
            run_pretrain(flags, log_json, args.nproc, quiet=True, script=script, virtual_dp=args.virtual_dp)
        rows[name], curves[name] = summarize(log_json), validation_curve(log_json)
    for also_json, name in args.also:
        rows[name], curves[name] = summarize(also_json), validation_curve(also_json)
    dense = next(iter(rows.values()))
    for row in rows.values():
        row["loss vs dense"] = row["final validation loss"] / dense["final validation loss"]
        row["wire bytes over the run vs dense"] = row["wire bytes over the run"] / dense["wire bytes over the run"]
    table = markdown_table(rows, ["iterations", "final validation loss", "loss vs dense", "wire bytes over the run",
                                  "wire bytes over the run vs dense", "wire bytes per step at the end", "tokens/s"],
                           baseline=configurations["dense"][0])
    table = f"ef: `{' '.join(higgs)}`\n\nlean: `{' '.join(lean)}`\n\nonebit: `{' '.join(onebit)}`\n\n{table}"
    plt = written_with_pyplot(out / "convergence.md", table)
    if plt is None:
        return 0
    fig, (ax, trade) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, curve in curves.items():
        ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", markersize=3, label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    dp = f"virtual DP={args.virtual_dp}" if args.virtual_dp else f"DP={args.nproc}"
    ax.set_title(f"GPT on the Python standard library, {dp}, CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for name, row in rows.items():
        trade.scatter(row["wire bytes over the run vs dense"], row["loss vs dense"])
        trade.annotate(name, (row["wire bytes over the run vs dense"], row["loss vs dense"]), fontsize=6)
    # The goal: a sixteenth of dense's wire bytes at 1.01x of its loss at DP=2 (1.02x beyond)
    trade.axvline(1 / 16, color="grey", linestyle="--", linewidth=0.8)
    trade.axhline(1.01 if (args.virtual_dp or args.nproc) == 2 else 1.02, color="grey", linestyle="--", linewidth=0.8)
    trade.set_xscale("log")
    trade.set_xlabel("wire bytes per rank over the run vs dense (log)")
    trade.set_ylabel("final validation loss vs dense")
    trade.set_title("loss against wire bytes per rank over the run")
    trade.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=120)
    print(f"wrote {out / 'convergence.md'} and {out / 'convergence.png'}")
    return 0


SCALE_RUNS = {  # run -> (row name, its flags): the baseline, the peer a user would pick, the old and the new default
    "dense": ("Megatron's DDP (dense, fp32)", []),
    "peer": ("torch DDP + bf16 hook", ["--comm-hook", "bf16"]),
    "sharded": ("sharded top-k (the lean schedule, --higgs-sync sharded)", None),
    "default": ("--use-higgs (1-bit Adam, as derived)", ["--use-higgs"]),
}


def scale_table(args: argparse.Namespace, out: Path) -> int:
    """One table over the data-parallel sizes of ``--scale`` (real ranks, or 'vP': P virtual
    ranks in one process), each without and with ``--use-distributed-optimizer``: Megatron's
    dense DDP, the bf16 peer (torch DDP: real ranks, no distributed optimizer), the sharded top-k
    form and what ``--use-higgs`` derives, each row against the dense run of its own P and layout:
    final validation loss, wire bytes per rank over the run (every data-parallel collective,
    the parameter all-gather included) and per step at the end. Then the default's wire over the
    same run counted at P = 1,024 on the fake group, and ``scale.png``: loss ratio against wire
    ratio, per P. Each run's samples per rank are ``--micro-batch-size``; give the model in the
    extra flags, without ``--global-batch-size``."""
    from project_wire import projected_ratio

    micro = int(args.extra[args.extra.index("--micro-batch-size") + 1]) if "--micro-batch-size" in args.extra else 4
    common = ["--train-iters", str(args.train_iters), "--log-interval", "10", "--eval-iters", "10",
              "--eval-interval", str(max(1, args.train_iters // 12)), "--overlap-grad-reduce", *args.extra]
    rows, points = [], []
    for spec in args.scale.split(","):
        virtual = spec.startswith("v")
        size = int(spec.lstrip("v"))
        for layout in ("", "distopt"):
            layout_flags = ["--use-distributed-optimizer"] if layout else []
            results = {}
            for run, (name, flags) in SCALE_RUNS.items():
                if run == "peer" and (virtual or layout):
                    continue  # torch DDP: real ranks, and no distributed optimizer
                flags = lean_schedule(args, sync="sharded") if flags is None else flags
                if virtual and run == "dense":
                    flags = ["--use-higgs", "--higgs-compressor", "none"]  # Megatron's reduction, in the harness
                run_flags = (common + ["--global-batch-size", str(micro * size)] + layout_flags + flags
                             + (["--higgs-min-bucket-numel", "0"] if virtual and run != "dense" else []))
                if run == "peer":  # torch DDP always overlaps
                    run_flags = [flag for flag in run_flags if flag != "--overlap-grad-reduce"]
                log_json = out / f"p{spec}{'-' + layout if layout else ''}" / f"{run}.jsonl"
                if args.reuse and not finished(log_json, args.train_iters):
                    log.info(f"P={spec} {layout or 'DDP'} {run}: no finished run in {log_json}, left out")
                    continue
                if not (args.keep and finished(log_json, args.train_iters)) and not args.reuse:
                    run_pretrain(run_flags, log_json, size, quiet=True, virtual_dp=size if virtual else None,
                                 script="scripts/peer_torch_ddp.py" if run == "peer" else "examples/pretrain_gpt.py")
                results[run] = summarize(log_json)
            if "dense" not in results:
                continue
            dense = results["dense"]
            for run, result in results.items():
                loss = result["final validation loss"] / dense["final validation loss"]
                wire = result["wire bytes over the run"] / dense["wire bytes over the run"]
                rows.append(f"| {spec} | {layout or 'DDP'} | {SCALE_RUNS[run][0]} | {result['final validation loss']:.4f} "
                            f"| {loss:.3f}x | {result['wire bytes over the run'] / 1e9:.3f} GB | {wire:.4f}x "
                            f"| {result['wire bytes per step at the end'] / 1e3:,.1f} kB |")
                points.append((spec, layout, run, wire, loss))
    counted = []
    for layout in ("", "distopt"):
        flags = (common + ["--use-higgs"] + (["--use-distributed-optimizer"] if layout else []))
        counted.append(f"{projected_ratio(1024, flags):.4f}x {'with' if layout else 'without'} the distributed "
                       "optimizer")
    table = "\n".join([
        f"Each row against Megatron's dense run at its own P and layout, {args.train_iters:,} iterations, "
        f"{micro} samples a rank; wire bytes per rank over the run, every data-parallel collective (the "
        "distributed optimizer's parameter all-gather included).", "",
        "| P | layout | run | final validation loss | loss vs dense | wire over the run | wire vs dense "
        "| wire a step at the end |", "|---|---|---|---|---|---|---|---|", *rows, "",
        f"--use-higgs at P = 1,024 (counted on the fake group, the same run, the parameter all-gather after "
        f"each step included): {'; '.join(counted)}."])
    out.mkdir(parents=True, exist_ok=True)
    plt = written_with_pyplot(out / "scale.md", table)
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"dense": "s", "peer": "D", "sharded": "^", "default": "o"}
    for spec in dict.fromkeys(point[0] for point in points):
        color = None
        for _, layout, run, wire, loss in (point for point in points if point[0] == spec):
            line = ax.scatter(wire, loss, marker=markers[run], color=color, facecolors="none" if layout else None,
                              label=f"P={spec}" if color is None else None)
            color = line.get_edgecolor()[0] if color is None else color
    ax.axvline(1 / 16, color="grey", linestyle="--", linewidth=0.8)
    ax.axhline(1.02, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes per rank over the run vs dense (log)")
    ax.set_ylabel("final validation loss vs dense")
    ax.set_title("per P: square dense, diamond bf16 peer, triangle sharded top-k, circle --use-higgs; "
                 "hollow: distributed optimizer", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=120)
    print(f"wrote {out / 'scale.md'} and {out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
