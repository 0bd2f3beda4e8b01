"""Model, data-parallel wrapper, optimizer and LR schedule: megatron-core's own, configured from flags.

``build_model`` returns the list of model chunks (one per pipeline stage held by this rank),
each a megatron-core ``GPTModel`` wrapped by the DDP class it is given: Megatron's own
``DistributedDataParallel`` for the dense baseline, or a subclass of it. The layer spec is
Transformer Engine's when ``--transformer-impl transformer_engine``, else the local one.
"""

from __future__ import annotations

import argparse
from typing import Type

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from ..checkpoint.load import padded_rows
from ..compat.moe import define_absent_te_gemm
from .corpus import ByteTokenizer


def padded_vocab_size(args: argparse.Namespace) -> int:
    """Megatron-LM's rule: pad the vocabulary to a multiple of divisible-by x TP."""
    return padded_rows(ByteTokenizer().vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        **_moe_config(args),
    )


def _moe_config(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of a mixture-of-experts model (none for a dense one)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
    )


def _layer_spec(args: argparse.Namespace):
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=args.num_experts)
    return get_gpt_layer_local_spec(num_experts=args.num_experts)


def ddp_config(args: argparse.Namespace) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        bucket_size=args.ddp_bucket_size,
    )


def build_model(args: argparse.Namespace, config: TransformerConfig,
                ddp_class: Type[DistributedDataParallel] = DistributedDataParallel,
                **ddp_kwargs) -> list[DistributedDataParallel]:
    """This rank's model chunks, each wrapped in ``ddp_class`` (Megatron DDP or a subclass)."""
    if args.num_experts is not None:
        define_absent_te_gemm()
    model = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args),
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    module = Float16Module(config, model) if args.bf16 else model
    return [ddp_class(config, ddp_config(args), module, **ddp_kwargs)]


def build_optimizer(args: argparse.Namespace, model: list[DistributedDataParallel]) -> MegatronOptimizer:
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model)


def build_scheduler(args: argparse.Namespace, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron-LM's schedule, counted in samples (it steps by the global batch size)."""
    samples = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters > 0 else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples,
        lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style="constant",
    )


def num_parameters(model: list[DistributedDataParallel]) -> int:
    """Parameters held by this rank (its TP shard of its PP stage)."""
    return sum(p.numel() for chunk in model for p in chunk.parameters())
