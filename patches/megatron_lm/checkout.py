"""Which Megatron-LM training code the patches run against, and how it is put to use.

The patches rebind names inside ``megatron.training`` (see ``install.py``); training code
that differs from the tested one could take those names in another meaning and train wrongly
without failing. Where it comes from depends on the installed megatron-core:

* **0.16.1** (Python 3.11): the wheel ships only ``megatron.core``; ``megatron.training`` and
  ``pretrain_gpt.py`` come from a Megatron-LM checkout at tag core_v0.16.1, required.
* **0.19.x** (Python 3.12): the wheel ships ``megatron.training`` itself, the training code
  the patches are tested against. A checkout is optional: it provides only the scripts
  (``pretrain_gpt.py`` and its ``gpt_builders.py``, ``model_provider.py``), which then run on
  the wheel's training code. Without one the launcher runs ``gpt_entry``, the script's GPT
  path as the wheel can run it.

A checkout is checked before anything is imported from it: it must be a Megatron-LM tree
(``pretrain_gpt.py``, ``megatron/training/``), and its ``megatron/core/package_info.py`` must
carry the installed release's series (0.16.1 exactly; any 0.19.x with 0.19.x). Another
version, or an installed megatron-core the patches are not tested with, is refused unless the
user asks to try it anyway (``--higgs-allow-untested-megatron-lm`` or
``HIGGS_ALLOW_UNTESTED_MEGATRON_LM=1``), and then a warning says so.

``use_checkout`` then puts the checkout on ``sys.path`` *after* the installed packages, so
the scripts' helper modules come from the checkout while ``megatron.core`` stays the
installed one (and, on 0.19, ``megatron.training`` the wheel's). That package ships its
dataset helper compiled (and no Makefile), so Megatron-LM's start-up build of it is skipped
when the compiled helper imports.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
import sys
import warnings
from pathlib import Path

# megatron-core series -> (the Megatron-LM tag tested with it, the checkout versions accepted)
TESTED = {"0.16": ("core_v0.16.1", ("0.16.1",)), "0.19": ("core_v0.19.0", ("0.19.",))}
ALLOW_FLAG = "--higgs-allow-untested-megatron-lm"


class CheckoutError(RuntimeError):
    """The Megatron-LM checkout is missing, not a checkout, or not the tested version."""


def installed_release() -> str:
    """The installed megatron-core's release (package metadata: importing megatron here would
    import it before a checkout is on the path)."""
    return metadata.version("megatron-core").split("+")[0]


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def wheel_ships_training(installed: str | None = None) -> bool:
    """Whether the installed megatron-core carries Megatron-LM's training code (0.18 on)."""
    major, minor = (int(part) for part in _series(installed or installed_release()).split("."))
    return (major, minor) >= (0, 18)


def checkout_version(path: Path) -> str:
    """The megatron-core version a Megatron-LM checkout carries (``MAJOR.MINOR.PATCH[PRE]``)."""
    info = path / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise CheckoutError(f"{path}: no megatron/core/package_info.py; is this a Megatron-LM checkout?")
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([^'\"\s#]*)['\"]?", info.read_text(),
                             re.MULTILINE))
    try:
        return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"
    except KeyError:
        raise CheckoutError(f"{info}: cannot read MAJOR/MINOR/PATCH") from None


def _untested(message: str, allow_untested: bool, advice: str) -> None:
    if not allow_untested:
        raise CheckoutError(f"{message}. {advice}, or pass {ALLOW_FLAG} (or set HIGGS_ALLOW_UNTESTED_MEGATRON_LM=1) "
                            "to try anyway")
    warnings.warn(f"{message}; running anyway ({ALLOW_FLAG})", stacklevel=3)


def check_checkout(path: str | Path | None, allow_untested: bool = False) -> Path | None:
    """The checkout's resolved path; None where the installed megatron-core's own training code
    runs without one (0.19); else ``CheckoutError`` saying what is wrong."""
    installed = installed_release()
    tested = TESTED.get(_series(installed))
    if tested is None:
        _untested(f"the installed megatron-core is {installed}; the Megatron-LM patches are tested with megatron-core "
                  f"{' and '.join(f'{series} (tag {tag})' for series, (tag, _) in TESTED.items())}", allow_untested,
                  "Install a tested release (pip install -e . picks the one for this Python)")
    tag = tested[0] if tested else f"core_v{installed}"
    if not path:
        if wheel_ships_training(installed):
            return None
        raise CheckoutError("no Megatron-LM checkout given: pass --megatron-lm-path DIR or set MEGATRON_LM_PATH "
                            f"(a clone of https://github.com/NVIDIA/Megatron-LM at tag {tag}; megatron-core "
                            f"{installed} does not ship Megatron-LM's training code)")
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise CheckoutError(f"Megatron-LM checkout {path}: no such directory")
    for needed in ("pretrain_gpt.py", "megatron/training/training.py"):
        if not (path / needed).is_file():
            raise CheckoutError(f"Megatron-LM checkout {path}: {needed} is missing; is this a Megatron-LM checkout?")
    version = checkout_version(path)
    if tested is not None and not any(version == accepted or (accepted.endswith(".") and version.startswith(accepted))
                                      for accepted in tested[1]):
        _untested(f"Megatron-LM checkout {path} is version {version}; with megatron-core {installed} these patches "
                  f"are tested with a checkout at {tag}", allow_untested, f"Check out {tag}")
    return path


def use_checkout(path: Path | None) -> None:
    """Make the checkout's modules (if any) importable on top of the installed megatron-core."""
    if path is not None and str(path) not in sys.path:
        sys.path.append(str(path))
    import megatron.core.datasets.utils as dataset_utils

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return  # not compiled: let Megatron-LM build it as it always does
    dataset_utils.compile_helpers = lambda: None
