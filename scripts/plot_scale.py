"""Loss against wire bytes per rank at several data-parallel sizes, from benchmark directories.

Each directory is one ``scripts/bench_convergence.py --out DIR`` (real ranks or ``--virtual-dp
P``) holding ``dense.jsonl`` and the compressed runs' logs; its P is read from the logs'
``setup_done`` event. For every compressed run, its final validation loss over the directory's
dense run against its wire bytes per rank over the run over dense's, one line per
configuration through the sizes, with the goals drawn in (a sixteenth of dense's wire bytes per rank at that P; 1.01x
of its loss at P = 2, 1.02x beyond). Prints the points as a markdown table too.

    python scripts/plot_scale.py runs/virtual/p8 runs/virtual/p16 ... runs/virtual/distopt_p16@distopt
                                 [--out docs/img/scale.png]

Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron_bench.runs import summarize  # noqa: E402
from higgs_megatron.logs import get_logger, setup_logging  # noqa: E402

log = get_logger("plot_scale")


def data_parallel_size(log_json: Path) -> int:
    for line in log_json.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "setup_done":
            return int(record["data_parallel_size"])
    raise ValueError(f"{log_json}: no setup_done event (not a pretrain log?)")


def points(directories: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """{run name: [(P, loss vs dense, wire vs dense), ...]} over the directories (``DIR``,
    ``DIR=P`` for logs without their P, and ``...@LABEL`` to tell its runs apart from other
    directories' runs of the same name), by P."""
    by_run: dict[str, list[tuple[int, float, float]]] = {}
    for spec in directories:
        spec, _, label = spec.partition("@")
        path, _, given = spec.partition("=")
        directory = Path(path)
        dense = summarize(directory / "dense.jsonl")
        size = int(given) if given else data_parallel_size(directory / "dense.jsonl")
        for log_json in sorted(directory.glob("*.jsonl")):
            if log_json.stem == "dense":
                continue
            row = summarize(log_json)
            by_run.setdefault(f"{log_json.stem} ({label})" if label else log_json.stem, []).append(
                (size, row["final validation loss"] / dense["final validation loss"], row["wire over the run vs dense"]))
    return {name: sorted(values) for name, values in by_run.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directories", nargs="+", help="DIR, DIR=P where its logs do not say P, and @LABEL after "
                        "either to name its runs apart")
    parser.add_argument("--out", type=Path, default=Path("runs/scale.png"))
    args = parser.parse_args()
    setup_logging()
    by_run = points(args.directories)
    lines = ["| run | P | loss vs dense | wire over the run vs dense |", "|---|---|---|---|"]
    lines += [f"| {name} | {size} | {loss:.3f}x | {wire:.3f}x |"
              for name, values in by_run.items() for size, loss, wire in values]
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in by_run.items():
        ax.plot([v[2] for v in values], [v[1] for v in values], marker="o", label=name)
        for size, loss, wire in values:
            ax.annotate(f"P={size}", (wire, loss), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(1 / 16, color="grey", linestyle="--", linewidth=0.8)
    ax.axhline(1.02, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("wire bytes per rank over the run vs dense (log)")
    ax.set_ylabel("final validation loss vs dense")
    ax.set_title("loss against wire bytes, per data-parallel size")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    log.info(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
