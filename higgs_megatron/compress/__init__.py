"""Pure tensor code for gradient compression: selection, per-bucket plans, error feedback.

Nothing here imports ``torch.distributed`` or Megatron, so every piece is testable in one
process: ``selection`` picks which coordinates to send; ``compressor`` holds the bucket's
plan (how many coordinates each part sends), the compression itself, and the error feedback
that keeps what was not sent for the next step.
"""
