"""Megatron-LM's GPT pretraining entry, for a megatron-core wheel that ships ``megatron.training``.

From 0.18 on, the megatron-core wheel ships Megatron-LM's training loop (``megatron.training``)
but not its scripts (``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``). With no
checkout, the launcher runs this module in their place. It is ``pretrain_gpt.py``'s GPT path
at the release's tag (core_v0.19.0), read there, not rewritten:

* the flags are parsed and validated by ``arguments.parse_and_validate_args``, the model is
  described by ``argument_utils.gpt_config_from_args`` and built by ``pretrain()`` through
  the model builder, as the script does;
* ``get_batch``, ``loss_func`` and ``forward_step`` are the script's, without the paths that
  need more than the wheel (ModelOpt, cached-logits distillation) or packed sequences;
* the datasets are the script's mock or indexed GPT datasets.

What the script does and this entry does not (``--sft``, ``--fim-data``, ``--logits-load-dir``,
``--hybrid-context-parallel``, ``--dataloader-inter-document-masking``) is refused with exit 2,
naming the flag: run the checkout's own script for those (``--megatron-lm-path``).
``tests/megatron_lm`` runs both on the same flags and compares their losses.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.parallel_state import get_context_parallel_group
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank as mtp_on_this_rank_func
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from higgs_megatron.runtime.exits import UsageError

# pretrain_gpt.py's names for the fields of a batch, in the order it unpacks them
BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]
SPIKY_LOSS_FACTOR = 10  # pretrain_gpt.py's: a loss ten times the largest seen is spiky
# (flag, argparse dest): what pretrain_gpt.py offers beyond this entry
SCRIPT_ONLY = (("--sft", "sft"), ("--fim-data", "fim_data"), ("--logits-load-dir", "logits_load_dir"),
               ("--hybrid-context-parallel", "hybrid_context_parallel"),
               ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"))


def script_only_flags(args: Any) -> list[str]:
    """The flags given that only Megatron-LM's own pretrain_gpt.py handles."""
    return [flag for flag, dest in SCRIPT_ONLY if getattr(args, dest, None)]


def _mtp_on_this_rank(config: Any, vp_stage: int | None) -> bool:
    return mtp_on_this_rank_func(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                                 ignore_virtual=False, vp_stage=vp_stage)


def get_batch(data_iterator: Any, vp_stage: int | None = None) -> list:
    """The micro-batch on this rank: read on tensor-parallel rank 0 and broadcast to the others,
    then split over the context-parallel ranks (pretrain_gpt.py's ``get_batch``)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    mtp_on_this_rank = _mtp_on_this_rank(config, vp_stage)
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_on_this_rank:
        return [None for _ in BATCH_KEYS]
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            batch[key] = batch[key].cuda(non_blocking=True) if batch.get(key) is not None else None
    batch = get_batch_on_this_tp_rank(
        batch, broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=mtp_on_this_rank,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=get_context_parallel_group())
    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Any = None) -> tuple:
    """The summed loss over the unmasked tokens, their count, and the report Megatron-LM logs
    as "lm loss"; with ``--check-for-nan-in-loss-and-grad`` a NaN or Inf loss, and with
    ``--check-for-spiky-loss`` a spiky one, goes to the rerun state machine (pretrain_gpt.py's
    ``loss_func``)."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for rejection, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(result=loss, rejection_func=rejection,
                                                message=f"found {what} in local forward loss calculation",
                                                tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        spiky = partial(rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss")
        rerun_state_machine.validate_result(result=loss, rejection_func=spiky, message="Spiky loss", tolerance=0.0,
                                            fatal=False)
    return loss, num_tokens, report


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple:
    """One micro-batch forward, and the loss function of its output (pretrain_gpt.py's)."""
    if return_schedule_plan:
        raise UsageError("--overlap-moe-expert-parallel-comm: run Megatron-LM's own pretrain_gpt.py "
                         "(--megatron-lm-path) for its schedule plans")
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = dict(zip(BATCH_KEYS, get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))))
    timers("batch-generator").stop()
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"], model=model)


def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    args = get_args()
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    config = core_transformer_config_from_args(args)
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_on_this_rank(config, vp_stage)


def core_gpt_dataset_config_from_args(args: Any) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap, context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel)


def train_valid_test_datasets_provider(train_val_test_num_samples: list, vp_stage: int | None = None) -> tuple:
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                             partial(is_dataset_built_on_rank, vp_stage=vp_stage),
                                             core_gpt_dataset_config_from_args(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # as pretrain_gpt.py marks it


def main() -> None:
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    refused = script_only_flags(args)
    if refused:
        raise UsageError(f"{', '.join(refused)}: run Megatron-LM's own pretrain_gpt.py for this (--megatron-lm-path "
                         "DIR, a checkout at the installed release's tag)")
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
