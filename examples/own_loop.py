"""HiggsDDP in your own training loop: three calls, on megatron-core's own pieces.

    torchrun --nproc_per_node 2 examples/own_loop.py

Trains a small GPTModel on this file's own bytes for 30 steps, DP=2, and prints the loss and
the bytes each step handed to collectives against Megatron's dense all-reduce.
"""

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from higgs_megatron import HiggsConfig, HiggsDDP, wrap_optimizer
from higgs_megatron.cpu import cpu_megatron

SEQ, BATCH = 64, 4


def main() -> None:
    on_cpu = not torch.cuda.is_available()
    if not on_cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # before anything lands on GPU 0
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    with cpu_megatron() if on_cpu else contextlib.nullcontext():
        dist.init_process_group("gloo" if on_cpu else "nccl")
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, use_cpu_initialization=on_cpu,
                                   hidden_dropout=0.0, attention_dropout=0.0)
        gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                       max_sequence_length=SEQ).to(device)

        # sync="sparse": on one host the links are fast and the default "auto" would stay dense
        higgs = HiggsConfig(compression_ratio=0.01, sync="sparse")                       # 1
        model = HiggsDDP(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100_000),
                         gpt, higgs_config=higgs)                                        # 2
        optimizer = wrap_optimizer(get_megatron_optimizer(OptimizerConfig(lr=3e-3), [model]), [model])  # 3

        text = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long)
        positions = torch.arange(SEQ, device=device).expand(BATCH, SEQ)
        mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device).triu(1)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for step in range(1, 31):
            starts = torch.randint(0, text.numel() - SEQ - 1, (BATCH,), generator=generator)
            tokens = torch.stack([text[s:s + SEQ] for s in starts]).to(device, non_blocking=True)
            labels = torch.stack([text[s + 1:s + SEQ + 1] for s in starts]).to(device, non_blocking=True)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            loss = model(tokens, positions, mask, labels=labels).float().mean()
            loss.backward()
            finalize_model_grads([model])  # waits for the compressed sync
            optimizer.step()
            stats = model.take_stats()
            if dist.get_rank() == 0 and step % 10 == 0:
                print(f"step {step:3d} | loss {loss.item():.3f} | bytes sent {stats.bytes_sent:,} "
                      f"of {stats.dense_bytes:,} dense ({stats.bytes_sent / stats.dense_bytes:.1%})", flush=True)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
