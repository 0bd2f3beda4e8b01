#!/usr/bin/env bash
# "Nodes" on one machine, each behind a shaped link: Megatron's DDP, PyTorch DDP with its fp16
# hook, and --use-higgs alone, at 1 Gbit/s, 10 Gbit/s and unshaped, plus the floor (one rank,
# no gradient traffic). Prints one table, writes it as markdown and a PNG under
# runs/two_nodes/ (or --out).
#
#   sudo scripts/bench_two_nodes.sh [--quick] [--train-iters N] [--bandwidths 1gbit unshaped] [--nodes 2 4]
#
# Needs root (network namespaces), ip and tc (iproute2). Creates a namespace per node and one
# for the bridge between them, on private addresses (10.231.0.0/24), and always removes them,
# also when interrupted. Options go to scripts/bench_two_nodes.py (--help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "bench_two_nodes.sh: must run as root (it creates network namespaces and shapes a link with tc)" >&2
  exit 2
fi
for tool in ip tc; do
  if ! command -v "$tool" >/dev/null; then
    echo "bench_two_nodes.sh: '$tool' not found: install iproute2 (Debian: apt-get install iproute2)" >&2
    exit 2
  fi
done

EXTRAS=bench scripts/setup.sh >/dev/null

export HIGGS_BENCH_NS="hb$$"
cleanup() {
  for ns in $(ip netns list | awk '{print $1}' | grep "^${HIGGS_BENCH_NS}[sn]" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM

export OMP_NUM_THREADS=1
.venv/bin/python scripts/bench_two_nodes.py "$@"
