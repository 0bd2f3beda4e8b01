"""The peer a user would pick instead of --use-higgs: PyTorch DDP, optionally with its fp16 or
bf16 gradient-compression hook, on the same megatron-core GPT, data and per-rank batch.

Takes the pretrain script's flags (same model, corpus, batch, learning-rate schedule, log
format: ``--log-json`` records read by ``higgs_megatron_bench.runs``), plus ``--comm-hook
{none,fp16,bf16}``. The optimizer is ``torch.optim.AdamW`` with the same hyper-parameters and
gradient clipping under Megatron's schedule. Data parallel only (TP = PP = 1).

    torchrun --nproc_per_node 2 scripts/peer_torch_ddp.py --comm-hook fp16 --train-iters 50
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from higgs_megatron.reduce.wire import wire_bytes  # noqa: E402
from higgs_megatron.training.arguments import parse_args  # noqa: E402
from higgs_megatron.training.corpus import build_corpus  # noqa: E402
from higgs_megatron.training.data import build_datasets, iteration_batches  # noqa: E402
from higgs_megatron.training.launch import training_environment  # noqa: E402
from higgs_megatron.training.loop import loss_func  # noqa: E402
from higgs_megatron.runtime.metrics import MetricsLogger  # noqa: E402
from higgs_megatron.training.model import build_model, build_scheduler, transformer_config  # noqa: E402
from higgs_megatron.training.parallel import set_seeds  # noqa: E402


def bf16_gloo_compress_hook(process_group, bucket):  # no annotations: torch checks them, and they are strings here
    """torch's ``default_hooks.bf16_compress_hook`` (which refuses, by its name, a backend other than NCCL
    2.10+: gloo on CPU among them): the bucket (a ``dist.GradBucket``) averaged in bf16, then
    cast back; returns the future torch's DDP waits on."""
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer = bucket.buffer()
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


HOOKS = {"fp16": default_hooks.fp16_compress_hook,
         "bf16": default_hooks.bf16_compress_hook if torch.cuda.is_available() else bf16_gloo_compress_hook}


def torch_ddp(hook: str):
    """A ``build_model`` wrapper class: the GPT module under torch's DDP on the DP group."""
    from megatron.core import parallel_state

    def wrap(config, ddp_config, module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel:
        bucket_mb = (ddp_config.bucket_size or 25_000_000 // 4) * 4 / 2**20
        model = torch.nn.parallel.DistributedDataParallel(
            module, process_group=parallel_state.get_data_parallel_group(), bucket_cap_mb=bucket_mb)
        if hook in HOOKS:
            model.register_comm_hook(parallel_state.get_data_parallel_group(), HOOKS[hook])
        return model

    return wrap


def mean_loss(model, batches) -> torch.Tensor:
    """Token-weighted loss over this rank's micro-batches (sum, tokens)."""
    total = torch.zeros(2)
    for batch in batches:
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss, tokens, _ = loss_func(batch["loss_mask"], output)
        total += torch.stack([loss.detach(), tokens.float()])
    return total


def main() -> int:
    peer = argparse.ArgumentParser(add_help=False)
    peer.add_argument("--comm-hook", choices=("none", *HOOKS), default="fp16")
    known, rest = peer.parse_known_args()
    args = parse_args(rest)
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        raise SystemExit("peer_torch_ddp.py: data parallel only (TP = PP = 1)")
    with training_environment(args):
        from megatron.core import parallel_state

        rank, dp_rank, dp_size = dist.get_rank(), parallel_state.get_data_parallel_rank(), \
            parallel_state.get_data_parallel_world_size()
        log = MetricsLogger(is_writer=rank == dist.get_world_size() - 1, log_json=args.log_json)
        corpus = build_corpus(args.data_path, args.data_cache_path)
        datasets = build_datasets(corpus, args.seq_length, args.seed, args.split,
                                  train_samples=args.train_iters * args.global_batch_size,
                                  valid_samples=max(1, args.eval_iters) * args.global_batch_size,
                                  cache_dir=args.data_cache_path)
        set_seeds(args.seed)
        model = build_model(args, transformer_config(args), torch_ddp(known.comm_hook))[0]
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps, weight_decay=args.weight_decay)
        scheduler = build_scheduler(args, optimizer)
        grad_bytes = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sent_bytes = grad_bytes * (2 if known.comm_hook in HOOKS else 4)
        log.event("setup_done", f"peer: torch DDP{f' + {known.comm_hook} hook' if known.comm_hook in HOOKS else ''}, "
                  f"{grad_bytes:,} parameters, DP {dp_size}", parameters=grad_bytes)
        consumed, tokens_per_step = 0, args.global_batch_size * args.seq_length
        window_start, window_steps, excluded = time.perf_counter(), 0, 0.0
        for iteration in range(1, args.train_iters + 1):
            optimizer.zero_grad(set_to_none=True)
            batches = list(iteration_batches(datasets.train, consumed, args.micro_batch_size, dp_rank, dp_size,
                                             args.num_microbatches))
            total = torch.zeros(2)
            for m, batch in enumerate(batches):
                with model.no_sync() if m < len(batches) - 1 else torch.enable_grad():
                    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                   labels=batch["labels"])
                    loss, tokens, _ = loss_func(batch["loss_mask"], output)
                    # Megatron's scaling: the sum over micro-batches, averaged over DP by the all-reduce.
                    (loss / tokens.clamp(min=1) / args.num_microbatches).backward()
                total += torch.stack([loss.detach(), tokens.float()])
            if args.clip_grad > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            optimizer.step()
            scheduler.step(increment=args.global_batch_size)
            consumed += args.global_batch_size
            window_steps += 1
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                elapsed = (time.perf_counter() - window_start - excluded) / window_steps
                log.iteration(iteration, args.train_iters, {
                    "consumed samples": consumed, "elapsed time per iteration (ms)": elapsed * 1e3,
                    "learning rate": optimizer.param_groups[0]["lr"], "global batch size": args.global_batch_size,
                    "lm loss": (total[0] / total[1]).item(), "tokens per second": tokens_per_step / elapsed,
                    "bytes sent": sent_bytes, "dense bytes": grad_bytes * 4,
                    "wire bytes": wire_bytes("all_reduce", sent_bytes, dp_size),
                    "dense wire bytes": wire_bytes("all_reduce", grad_bytes * 4, dp_size)})
                window_start, window_steps, excluded = time.perf_counter(), 0, 0.0
            if args.eval_iters > 0 and (iteration % args.eval_interval == 0 or iteration == args.train_iters):
                paused = time.perf_counter()
                with torch.no_grad():
                    model.eval()
                    valid = sum(mean_loss(model.module, iteration_batches(
                        datasets.valid, step * args.global_batch_size, args.micro_batch_size, dp_rank, dp_size,
                        args.num_microbatches)) for step in range(args.eval_iters))
                    model.train()
                dist.all_reduce(valid, group=parallel_state.get_data_parallel_group())
                value = (valid[0] / valid[1]).item()
                log.event("validation", f" validation loss at iteration {iteration}: {value:.6E}",
                          iteration=iteration, loss=value)
                excluded += time.perf_counter() - paused
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
