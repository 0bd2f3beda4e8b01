"""Pretrain a megatron-core GPT model on CPU (gloo) or GPUs (NCCL).

    torchrun --nproc_per_node 2 examples/pretrain_gpt.py --tensor-model-parallel-size 2 --train-iters 50

Flags carry Megatron-LM's names; ``--help`` lists them. The loop is in
``higgs_megatron.training.loop`` and the launch in ``higgs_megatron.training.launch``; this file
is only the entry point.
"""

import sys

from higgs_megatron.training.launch import main

if __name__ == "__main__":
    sys.exit(main())
