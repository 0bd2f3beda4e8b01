"""Error feedback: what a rank did not send this step is added to its next step's gradient.

Per bucket, per step:  ``acc = grad + residual``;  send ``acc`` at the selected positions;
``residual' = acc - sent``: zero at every position sent (``x - x`` is exactly 0), ``acc``
elsewhere. So ``sent + residual' == acc`` exactly, which is what keeps top-k converging
(Stich et al. 2018). The subtraction is written as an ``index_add_`` of the sent values:
padding slots carry 0 and add nothing, so the payload's shape never depends on the data.

The new residual is *staged*, not committed: if every rank then agrees to skip the step
(non-finite gradients somewhere, or an abandoned sync), ``rollback()`` drops it and the
residual is as it was before the step. A staged residual commits when the next step
begins (``accumulate``), or explicitly; ``current`` is what a checkpoint must save. The
price is a second buffer the size of the bucket.
"""

from __future__ import annotations

import torch


class ResidualBuffer:
    """The committed residual of one bucket plus the one staged by the step in flight.

    A residual known to be zero (never set, or after a dense step) is only flagged, not
    written or added: a bucket that goes dense costs no passes over its residual."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.committed = torch.zeros(numel, dtype=dtype, device=device)
        self.staged = torch.zeros(numel, dtype=dtype, device=device)
        self.has_staged = False
        self.committed_zero = self.staged_zero = True

    def commit(self) -> None:
        if self.has_staged:
            self.committed, self.staged = self.staged, self.committed
            self.committed_zero, self.staged_zero = self.staged_zero, self.committed_zero
            self.has_staged = False

    def rollback(self) -> None:
        self.has_staged = False

    @property
    def current(self) -> torch.Tensor:
        """The residual a resumed run must start from: staged if the step went through."""
        if self.has_staged:
            if self.staged_zero:
                self.staged.zero_()
            return self.staged
        if self.committed_zero:
            self.committed.zero_()
        return self.committed

    def load(self, value: torch.Tensor) -> None:
        self.committed.copy_(value.reshape(-1))
        self.committed_zero = False
        self.has_staged = False

    def accumulate(self, grad: torch.Tensor) -> None:
        """``grad += residual`` in place (grad becomes acc), after committing the last step.
        ``grad`` may be shorter than the buffer when the buffer's tail is padding (always 0)."""
        self.commit()
        if not self.committed_zero:
            grad.add_(self.committed.narrow(0, 0, grad.numel()))

    def stage(self, acc: torch.Tensor, sent) -> None:
        """Residual after sending ``sent`` (a ``compressor.SparseGrad``) out of ``acc``."""
        self.staged.copy_(acc)
        if sent.always.numel():
            self.staged.index_add_(0, sent.always_positions, sent.always, alpha=-1)
        self.staged.index_add_(0, sent.positions, sent.values, alpha=-1)
        self.staged_zero = False
        self.has_staged = True

    def stage_all_sent(self) -> None:
        """The whole of ``acc`` went out (a dense step): nothing remains."""
        self.staged_zero = True
        self.has_staged = True
