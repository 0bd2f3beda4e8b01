"""One bucket's accumulated gradient -> the fixed-size sparse payload it sends.

``compress(acc, plan, density, selector, key)`` returns a ``SparseGrad``:

* ``always``: the values of ``plan.always_positions`` (small parameters, sent in full; their
  positions are known to every peer from the plan, so they are not sent);
* ``positions`` / ``values``: the selected coordinates of the other parts, a fixed number of
  them (padding slots, if the selector came up short, repeat a real position and carry 0);
* ``sent``: every real position sent, for the error-feedback residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .plan import BucketPlan
from .selection import Selector


@dataclass
class SparseGrad:
    always: torch.Tensor  # [n_always], acc's dtype, at plan.always_positions
    positions: torch.Tensor  # int64 [k_selected]
    values: torch.Tensor  # [k_selected], acc's dtype
    sent: torch.Tensor  # int64, the real positions sent (always + real selections)


def compress(acc: torch.Tensor, plan: BucketPlan, density: float, selector: Selector,
             key: object = None) -> SparseGrad:
    parts, real = [], [plan.always_positions]
    padded = False
    for unit in plan.units:
        k = plan.k_unit(unit, density)
        chosen, valid = selector.select(acc[unit.start:unit.end].abs(), k, key=(key, unit.start))
        chosen = chosen + unit.start
        parts.append(chosen)
        real.append(chosen[:valid])
        padded |= valid < k
    positions = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=acc.device)
    values = acc[positions]
    if padded:  # zero the padding slots
        offset = 0
        for part, got in zip(parts, real[1:]):
            values[offset + got.numel():offset + part.numel()] = 0
            offset += part.numel()
    return SparseGrad(always=acc[plan.always_positions], positions=positions, values=values, sent=torch.cat(real))
