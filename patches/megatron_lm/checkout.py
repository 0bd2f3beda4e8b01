"""Which Megatron-LM checkout the patches may run against, and how it is put to use.

The patches rebind names inside ``megatron.training`` (see ``install.py``); a checkout whose
training code differs from the tested one could take those names in another meaning and
train wrongly without failing. So a checkout is checked before anything is imported from
it: it must be a Megatron-LM tree (``pretrain_gpt.py``, ``megatron/training/``), and its
``megatron/core/package_info.py`` must carry the tested version, which is also the
megatron-core this package pins (the checkout's training code runs on the installed
megatron-core). Another version is refused unless the user asks to try it anyway
(``--higgs-allow-untested-megatron-lm`` or ``HIGGS_ALLOW_UNTESTED_MEGATRON_LM=1``), and then
a warning says so.

``use_checkout`` then puts the checkout on ``sys.path`` *after* the installed packages, so
``megatron.training`` and the scripts' helper modules come from the checkout while
``megatron.core`` stays the installed, pinned megatron-core. That package ships its dataset
helper compiled (and no Makefile), so Megatron-LM's start-up build of it is skipped when the
compiled helper imports.
"""

from __future__ import annotations

import importlib
import re
from importlib import metadata
import sys
import warnings
from pathlib import Path

TESTED_TAG = "core_v0.16.1"
TESTED_VERSION = "0.16.1"


class CheckoutError(RuntimeError):
    """The Megatron-LM checkout is missing, not a checkout, or not the tested version."""


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


def check_checkout(path: str | Path | None, allow_untested: bool = False) -> Path:
    """Return the checkout's resolved path, or raise ``CheckoutError`` saying what is wrong."""
    if not path:
        raise CheckoutError("no Megatron-LM checkout given: pass --megatron-lm-path DIR or set MEGATRON_LM_PATH "
                            f"(a clone of https://github.com/NVIDIA/Megatron-LM at tag {TESTED_TAG})")
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise CheckoutError(f"Megatron-LM checkout {path}: no such directory")
    for needed in ("pretrain_gpt.py", "megatron/training/training.py"):
        if not (path / needed).is_file():
            raise CheckoutError(f"Megatron-LM checkout {path}: {needed} is missing; is this a Megatron-LM checkout?")
    installed = metadata.version("megatron-core").split("+")[0]  # not through higgs_megatron: it imports megatron
    if installed != TESTED_VERSION and not allow_untested:
        raise CheckoutError(f"the installed megatron-core is {installed}; the Megatron-LM patches run on megatron-core "
                            f"{TESTED_VERSION} (Python 3.11) with a checkout at {TESTED_TAG}; under megatron-core "
                            f"{installed} Megatron-LM's front-end is not supported yet (docs/megatron_compat.md)")
    version = checkout_version(path)
    if version != TESTED_VERSION:
        message = (f"Megatron-LM checkout {path} is version {version}; these patches are tested with "
                   f"{TESTED_VERSION} (tag {TESTED_TAG})")
        if not allow_untested:
            raise CheckoutError(f"{message}. Check out {TESTED_TAG}, or pass --higgs-allow-untested-megatron-lm "
                                "(or set HIGGS_ALLOW_UNTESTED_MEGATRON_LM=1) to try anyway")
        warnings.warn(f"{message}; running anyway (--higgs-allow-untested-megatron-lm)", stacklevel=2)
    return path


def use_checkout(path: Path) -> None:
    """Make the checkout's modules importable on top of the installed megatron-core."""
    if str(path) not in sys.path:
        sys.path.append(str(path))
    import megatron.core.datasets.utils as dataset_utils

    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return  # not compiled: let Megatron-LM build it as it always does
    dataset_utils.compile_helpers = lambda: None
