#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py, unmodified, with higgs-megatron underneath, on several nodes.
#
# Under Slurm (one task per node; torchrun starts the ranks of its node):
#   sbatch --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 scripts/megatron_lm_multinode.sh <pretrain_gpt.py flags>
# By hand, on every node (NODE_RANK 0..NNODES-1, MASTER_ADDR = node 0's address):
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/megatron_lm_multinode.sh <pretrain_gpt.py flags>
#
# MEGATRON_LM_PATH: a checkout of https://github.com/NVIDIA/Megatron-LM at tag core_v0.16.1, needed
# with megatron-core 0.16.1; with 0.19 (which ships Megatron-LM's training code) optional, core_v0.19.0.
# For a save bigger than torchrun's 30 s grace after a SIGTERM, ask Slurm for an earlier signal:
#   sbatch --signal=USR1@300 ... scripts/megatron_lm_multinode.sh ... --exit-signal-handler --exit-signal SIGUSR1
# Everything after the script name goes to pretrain_gpt.py, e.g.
#   --use-higgs --higgs-compression-ratio 0.01 --save /ckpt --load /ckpt --async-checkpoint ...
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c 'import torch; print(max(1, torch.cuda.device_count()))')}
PYTHON=${PYTHON:-python}

export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron-LM's requirement for overlapping TP communication
# Slurm's --signal=USR1@LEAD reaches every process of the step, torchrun included, whose default
# for SIGUSR1 is to die (taking the step down mid-save): torchrun ignores it, and the ranks, given
# --exit-signal-handler --exit-signal SIGUSR1, save and exit 0 before the time limit's SIGTERM.
trap '' USR1
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$here/patches/run_pretrain_gpt.py" ${MEGATRON_LM_PATH:+--megatron-lm-path "$MEGATRON_LM_PATH"} "$@"
