"""The megatron-core releases this package is tested with, and the check made at start.

Two are supported, one per Python: 0.16.1, the last release for Python 3.11, and the 0.19
series, which needs Python 3.12 (pyproject.toml installs the one that fits). Our bucket group
overrides megatron-core's private reduction, and checkpoints restore through its private
optimizer methods, so a release we have not run can train wrongly without failing: another
one is refused unless the user asks to try it (``--higgs-allow-untested-megatron``), and then
a warning says so. So is a release of a supported series whose bodies of the methods we
re-implement differ from those we read (``forks``). The symbols we touch are checked either way
(``symbols``).
"""

from __future__ import annotations

import logging
from importlib import metadata

from .forks import fork_problems

log = logging.getLogger(__name__)

SUPPORTED = ("0.16.1", "0.19")  # an exact release, or a series: "0.19" is any 0.19.x
ALLOW_FLAG = "--higgs-allow-untested-megatron"


class UntestedMegatron(RuntimeError):
    """The installed megatron-core is not one of ``SUPPORTED``."""


def megatron_core_version() -> str:
    """The installed megatron-core's release, as its package metadata says (no local suffix)."""
    return metadata.version("megatron-core").split("+")[0]


MEGATRON_CORE_VERSION = megatron_core_version()  # read once: what a save records, what a load compares with


def series(version: str) -> str:
    """``MAJOR.MINOR`` of a release."""
    return ".".join(version.split(".")[:2])


def supported(version: str) -> bool:
    return any(version == entry or (entry.count(".") == 1 and series(version) == entry) for entry in SUPPORTED)


def check_megatron_core(allow_untested: bool = False, version: str | None = None) -> str:
    """The installed release, when supported and the bodies of the methods we re-implement are
    ones we read (``forks``); else ``UntestedMegatron`` naming what is not, or with
    ``allow_untested`` a warning."""
    version = version or megatron_core_version()
    problems = [] if supported(version) else [
        f"megatron-core {version} is installed; higgs-megatron is tested with megatron-core "
        f"{' and '.join(entry if entry.count('.') == 2 else entry + '.x' for entry in SUPPORTED)}"]
    problems += fork_problems()
    if not problems:
        return version
    message = "; ".join(problems)
    if not allow_untested:
        raise UntestedMegatron(f"{message}: install a tested release (pip install -e . picks the one for this "
                               f"Python), or pass {ALLOW_FLAG} to try this one")
    log.warning(f" WARNING: {message}; running anyway ({ALLOW_FLAG})")
    return version
