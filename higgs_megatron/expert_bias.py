"""The routers' expert bias, moved once per step the optimizer takes.

With ``moe_router_enable_expert_bias``, Megatron moves each router's ``expert_bias`` in
``finalize_model_grads``, after the gradient sync, from the tokens the iteration routed:
whether or not the optimizer then takes the step. An iteration run twice (Megatron-LM's rerun
state machine, or a step every rank dropped and the progress alignment runs again) would move
the bias twice, and its second forward would route with the bias already moved, so the rerun
would not reproduce the first attempt. ``KeptExpertBias`` keeps the bias as of the last step
taken: it copies it as the chunk's sync finishes (before Megatron's update), and at the next
forward puts the copy back unless the optimizer took a step in between (the ``StepLedger``'s
count): the rule the error-feedback residuals follow (``ddp``).

Only device copies: nothing here reads a value on the host.
"""

from __future__ import annotations

import torch


class KeptExpertBias:
    """The expert biases of one model chunk, and their values as of the last step taken."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.biases = [bias for m in module.modules()
                       if isinstance(bias := getattr(m, "expert_bias", None), torch.Tensor)]
        self.kept: list[torch.Tensor] = []
        self.pending: int | None = None  # the ledger's count when the last update was staged

    @torch.no_grad()
    def stage(self, taken: int) -> None:
        """The sync finished and Megatron is about to move the biases: keep their values
        (``taken``: the steps the optimizer has taken so far). Called once per sync."""
        if not self.biases:
            return
        self.settle(taken)
        # A clone, not a preallocated copy: the router keeps the bias in fp32 by swapping its
        # .data, so its dtype may change after the model is built.
        self.kept = [bias.detach().clone() for bias in self.biases]
        self.pending = taken

    @torch.no_grad()
    def settle(self, taken: int) -> None:
        """At a forward: if the optimizer has not taken a step since the last ``stage``, the
        update Megatron made then belongs to an iteration that is running again (or whose step
        was skipped): put the biases back."""
        if self.pending is None:
            return
        if taken == self.pending:
            for bias, kept in zip(self.biases, self.kept):
                bias.copy_(kept)
        self.pending, self.kept = None, []
