"""Collectives on gradient payloads: the sparse all-gather reduction and its byte accounting.

Knows ``torch.distributed`` and nothing of Megatron: the caller hands it tensors and a
process group.
"""
