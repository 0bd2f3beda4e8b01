"""Pure tensor code for gradient compression: selection, error feedback, per-bucket plans.

Nothing here imports ``torch.distributed`` or Megatron, so every piece is testable in one
process: ``selection`` picks which coordinates to send, ``error_feedback`` keeps what was
not sent for the next step, ``plan`` says how many coordinates each bucket sends.
"""
