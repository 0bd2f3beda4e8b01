"""The megatron-core releases this package is tested with, and the check made at start.

Two are supported, one per Python: 0.16.1, the last release for Python 3.11, and the 0.19
series, which needs Python 3.12 (pyproject.toml installs the one that fits). Our bucket group
overrides megatron-core's private reduction, and checkpoints restore through its private
optimizer methods, so a release we have not run can train wrongly without failing: another
one is refused unless the user asks to try it (``--higgs-allow-untested-megatron``), and then
a warning says so. The symbols we touch are checked either way (``symbols``).
"""

from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger(__name__)

SUPPORTED = ("0.16.1", "0.19")  # an exact release, or a series: "0.19" is any 0.19.x
ALLOW_FLAG = "--higgs-allow-untested-megatron"


class UntestedMegatron(RuntimeError):
    """The installed megatron-core is not one of ``SUPPORTED``."""


def megatron_core_version() -> str:
    """The installed megatron-core's release, as its package metadata says (no local suffix)."""
    return metadata.version("megatron-core").split("+")[0]


def series(version: str) -> str:
    """``MAJOR.MINOR`` of a release."""
    return ".".join(version.split(".")[:2])


def supported(version: str) -> bool:
    return any(version == entry or (entry.count(".") == 1 and series(version) == entry) for entry in SUPPORTED)


def check_megatron_core(allow_untested: bool = False, version: str | None = None) -> str:
    """The installed release, when supported; else ``UntestedMegatron`` naming it, or with
    ``allow_untested`` a warning."""
    version = version or megatron_core_version()
    if supported(version):
        return version
    message = (f"megatron-core {version} is installed; higgs-megatron is tested with megatron-core "
               f"{' and '.join(entry if entry.count('.') == 2 else entry + '.x' for entry in SUPPORTED)}")
    if not allow_untested:
        raise UntestedMegatron(f"{message}: install a tested release (pip install -e . picks the one for this "
                               f"Python), or pass {ALLOW_FLAG} to try this one")
    log.warning(f" WARNING: {message}; running anyway ({ALLOW_FLAG})")
    return version


def unreadable_checkpoint(written_by: str, running: str | None = None) -> str | None:
    """Why a checkpoint written under megatron-core ``written_by`` cannot be loaded under the
    installed release (None: it can). Releases read their elders' checkpoints, not newer ones:
    from 0.17 the common state is no longer a ``common.pt`` of its own, which 0.16 looks for."""
    running = running or megatron_core_version()
    newer = tuple(int(part) for part in series(written_by.split("+")[0]).split(".")) > \
        tuple(int(part) for part in series(running).split("."))
    if newer:
        return (f"it was written under megatron-core {written_by}, newer than this run's {running}, which "
                f"cannot read it: resume with megatron-core {series(written_by)} (Python 3.12 for 0.19)")
    return None
