"""One bucket's accumulated gradient -> the fixed-size sparse payload it sends.

``compress(acc, plan, density, selector, key)`` returns a ``SparseGrad``:

* ``always``: the values of ``plan.always_positions`` (small parameters, sent in full; their
  positions are known to every peer from the plan, so they are not sent);
* ``positions`` / ``values``: the selected coordinates of the other parts, a fixed number of
  them; a padding slot (the selector came up short) carries value 0, so adding the payload
  at its positions is right whatever position the slot names.

``compress_with_feedback`` wraps it in error feedback: ``acc = grad + residual`` before,
``residual' = acc - sent`` after. Shapes depend only on the plan and the density: nothing
here reads a device value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .error_feedback import ResidualBuffer
from .plan import BucketPlan
from .selection import Selector


@dataclass
class SparseGrad:
    always: torch.Tensor  # [n_always], acc's dtype, at always_positions
    always_positions: torch.Tensor  # int64 [n_always], the plan's
    positions: torch.Tensor  # int64 [k_selected]
    values: torch.Tensor  # [k_selected], acc's dtype; 0 at padding slots


def compress(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
             key: object = None) -> SparseGrad:
    selections = [selector.select(acc.narrow(0, unit.start, unit.numel).abs(), plan.k_unit(unit, density), key=(key, unit.start))
                  for unit in plan.units]
    if not selections:
        empty = torch.empty(0, dtype=torch.long, device=acc.device)
        return SparseGrad(acc.index_select(0, plan.always_positions), plan.always_positions, empty,
                          acc.index_select(0, empty))
    positions = torch.cat([s.positions + unit.start for s, unit in zip(selections, plan.units)])
    values = acc.index_select(0, positions)
    if any(s.valid is not None for s in selections):  # zero the padding slots
        valid = torch.cat([torch.ones_like(s.positions, dtype=torch.bool) if s.valid is None else s.valid
                           for s in selections])
        values = torch.where(valid, values, 0)
    return SparseGrad(acc.index_select(0, plan.always_positions), plan.always_positions, positions, values)


def compress_with_feedback(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
                           residual: ResidualBuffer | None, key: object = None) -> SparseGrad:
    """``acc`` (the gradient, in place) += residual; compress; stage the new residual."""
    if residual is not None:
        residual.accumulate(acc)
    sparse = compress(acc, plan, density, selector, key=key)
    if residual is not None:
        residual.stage(acc, sparse)
    return sparse
