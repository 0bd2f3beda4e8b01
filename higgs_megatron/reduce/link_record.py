"""The link costs a run decided by, recorded, so that the same command decides the same way.

``auto`` picks each bucket's path from timings measured at start-up (``reduce.link_probe``),
and a timing taken under another load can move a bucket across the line between two paths:
the same command on the same machines then chose dense in one run and int8 in the next. So
the timings are recorded per setting (the data-parallel group's hosts and size, the device,
the largest bucket's plan, the flags the probe reads), and a later run with the same setting,
a resume included, decides by the recorded ones while each timing it measures is within
``MARGIN`` of its record (the codec's, and the collectives' at the large probe size: their
latency at the small size moves several times over between two runs on one machine, and
follows the record): it re-records, and says which timings moved, only when one is not.

Records are small JSON files under ``$HIGGS_CACHE_DIR/links`` (``compress.native.cache_dir``),
written by the group's first rank, atomically (renamed into place); every rank decides by
what that rank broadcasts. Pure but for the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..compress.native import cache_dir

logger = logging.getLogger(__name__)

MARGIN = 4.0  # a recorded timing stands while the measured one is within this factor of it (a link 4x
# faster or slower is another link; a busy machine moves the small probes by 2-3x)


def settled(measured: list[float], recorded: list[float] | None, margin: float = MARGIN,
            checked: list[bool] | None = None) -> tuple[list[float], list[int]]:
    """(the timings to decide by, the indices of those that moved past ``margin``): the record
    while every ``checked`` timing (all, by default) is within ``margin`` of it (a zero only
    matches a zero), else the measured ones; with no record (or one of another length), the
    measured ones and no moves."""
    if recorded is None or len(recorded) != len(measured):
        return list(measured), []
    checked = checked or [True] * len(measured)
    moved = [i for i, (new, old) in enumerate(zip(measured, recorded))
             if checked[i] and ((new == 0) != (old == 0) or (old and not 1 / margin <= new / old <= margin))]
    return (list(measured) if moved else list(recorded)), moved


def record_path(setting: dict[str, Any]) -> Path:
    key = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "links" / f"{key}.json"


def decide(measured: list[float], names: list[str], setting: dict[str, Any],
           checked: list[bool] | None = None) -> list[float]:
    """The timings to decide by for ``setting`` (see the module docstring); the first rank's call.
    ``checked``: the timings compared with the record (the others follow it: the collectives'
    small probes, a latency that moves several times over between runs on one machine). A
    record that cannot be read or written is not a failure: the measured timings stand."""
    path = record_path(setting)
    recorded = None
    try:
        recorded = json.loads(path.read_text())["timings"] if path.exists() else None
    except (OSError, ValueError, KeyError) as error:
        logger.warning("link costs: the record %s could not be read (%s): deciding by this run's timings", path, error)
    timings, moved = settled(measured, recorded, checked=checked)
    if recorded is not None and not moved:
        logger.info("link costs: deciding by the timings recorded in %s (each within %gx of this run's)", path, MARGIN)
        return timings
    if moved:
        changes = ", ".join(f"{names[i]} {recorded[i]:.3g} -> {measured[i]:.3g}" for i in moved)
        logger.warning("link costs: %s moved by more than %gx since %s was recorded: deciding by this run's, "
                       "recorded again (auto's choices may change)", changes, MARGIN, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            json.dump({"setting": setting, "names": names, "timings": timings}, out, indent=1)
        os.replace(partial, path)
    except OSError as error:
        logger.warning("link costs: could not record them in %s (%s)", path, error)
    return timings
