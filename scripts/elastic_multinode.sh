#!/usr/bin/env bash
# Elastic data-parallel replicas of the pretrain script across nodes: each node is one replica
# (its TP x PP ranks, one torchrun restarting them), kept together by one torchft Lighthouse.
# A node that dies or stalls leaves the others training; when it (or its torchrun) comes back,
# it heals from a live peer (docs/stability.md, "Elastic replicas").
#
# Under Slurm (one task per node):
#   sbatch --nodes 8 --ntasks-per-node 1 --gpus-per-node 8 scripts/elastic_multinode.sh <pretrain flags>
# By hand, on every node (REPLICA 0..REPLICAS-1; LIGHTHOUSE_HOST = the node that runs it):
#   REPLICAS=8 REPLICA=3 LIGHTHOUSE_HOST=10.0.0.1 scripts/elastic_multinode.sh <pretrain flags>
#
# The Lighthouse runs on the first node unless LIGHTHOUSE=http://HOST:PORT names one already
# running: put it on a node that is not a replica (the job's head node), or the loss of the
# first node stops the quorum. Everything after the script name goes to examples/pretrain_gpt.py,
# e.g. --use-higgs --higgs-compression-ratio 0.01 --higgs-step-timeout 30 --save /ckpt
# --save-interval 500 --auto-resume (every replica resumes from the one --save directory).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
REPLICAS=${REPLICAS:-${SLURM_NNODES:-1}}
REPLICA=${REPLICA:-${SLURM_NODEID:-0}}
if [[ -z "${LIGHTHOUSE_HOST:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    LIGHTHOUSE_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
LIGHTHOUSE_HOST=${LIGHTHOUSE_HOST:-127.0.0.1}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}
MAX_RESTARTS=${MAX_RESTARTS:-100}
PYTHON=${PYTHON:-python}

if [[ -z "${LIGHTHOUSE:-}" ]]; then
    LIGHTHOUSE=http://$LIGHTHOUSE_HOST:$LIGHTHOUSE_PORT
    if [[ "$REPLICA" == 0 ]]; then
        # a replica silent for 5 s is left out of the next quorum; a quorum waits 1 s for late ones
        torchft_lighthouse --bind "[::]:$LIGHTHOUSE_PORT" --min_replicas 1 --join_timeout_ms 1000 \
            --heartbeat_timeout_ms 5000 &
        trap 'kill %1 2>/dev/null || true' EXIT
    fi
fi
"$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" \
    "$here/examples/pretrain_gpt.py" "$@" \
    --higgs-replicas "$REPLICAS" --higgs-replica-id "$REPLICA" --higgs-lighthouse "$LIGHTHOUSE"
