"""Which optimizer-state units should be away from the device, given one memory reading.

Pure arithmetic, no tensors. Units are the optimizer's parameter groups (the moments and
fp32 main parameters of each), biggest first, with their sizes in bytes; the reading is the
peak device use of the step that just ran, which counts the units then resident.

* Above ``threshold``: send units away, biggest first among those resident, until the
  bytes sent cover the excess (``used - threshold x total``), or none is left.
* Below ``threshold - hysteresis``: bring units back, smallest first among those away,
  while the reading plus what comes back stays below ``threshold - hysteresis``.
* In between: change nothing. The band is what keeps state from bouncing when use hovers
  at the threshold.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    away: frozenset[int]       # the units to keep away after this step
    sent: tuple[int, ...]      # newly sent away, in order
    returned: tuple[int, ...]  # newly brought back, in order
    reason: str


def decide(used: int, total: int, unit_bytes: list[int], away: frozenset[int], threshold: float,
           hysteresis: float) -> Decision:
    high, low = threshold * total, (threshold - hysteresis) * total
    fraction = used / total if total else 0.0
    if used > high:
        excess, sent = used - high, []
        for unit in sorted(set(range(len(unit_bytes))) - away, key=lambda u: (-unit_bytes[u], u)):
            if excess <= 0:
                break
            sent.append(unit)
            excess -= unit_bytes[unit]
        return Decision(away | frozenset(sent), tuple(sent), (),
                        f"peak use {fraction:.1%} above the threshold {threshold:.0%}")
    if used < low and away:
        room, returned = low - used, []
        for unit in sorted(away, key=lambda u: (unit_bytes[u], u)):
            if unit_bytes[unit] > room:
                break
            returned.append(unit)
            room -= unit_bytes[unit]
        return Decision(away - frozenset(returned), (), tuple(returned),
                        f"peak use {fraction:.1%} below {threshold - hysteresis:.0%} (threshold - hysteresis)")
    return Decision(away, (), (), "")
