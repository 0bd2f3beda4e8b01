"""The fused CPU codec's library: built once per machine from the C source beside this module.

A compiled loop is the way to a codec near memory speed on a CPU: eager torch makes a pass over
memory per operation (a sign, a scale, a pack, a residual), and ``torch.compile`` cannot keep
the reference's summation order (so its bytes would differ from the reference's). Megatron
builds its dataset helpers the same way, at first use with the machine's C compiler.

The library goes to ``$HIGGS_CACHE_DIR`` (else ``$XDG_CACHE_HOME/higgs_megatron`` or
``~/.cache/higgs_megatron``), named by a hash of the source, the flags and the compiler, and
written atomically (a file renamed into place), so ranks that build at once on a shared
directory do not read a half-written file. Where no compiler works the caller falls back to
the reference (``compress.row_codec``) and one warning says why; ``HIGGS_CODEC=reference``
asks for the reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("row_codec.c")
# no fused multiply-add and no fast-math: the loops must round as the reference's torch ops do
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off", "-fno-fast-math")
_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES = {
    "sign_encode": (_P, _P, _I, _P, _I, _I, _I, _I, _P, _P),
    "int8_encode": (_P, _P, _I, _I, _I, _I, _I, _P, _P),
    "rows_decode_sum": (_I, _P, _I, _I, _I, _I, _I, _P),
    "rows_decode_add": (_I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _P),
}
FORMAT_CODES = {"sign": 0, "int8": 1}  # row_codec.c's SIGN, INT8


def cache_dir() -> Path:
    if os.environ.get("HIGGS_CACHE_DIR"):
        return Path(os.environ["HIGGS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "higgs_megatron"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc, *FLAGS, platform.machine())).encode()).hexdigest()[:16]
    library = cache_dir() / f"row_codec-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(handle)
    try:
        subprocess.run([cc, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True, text=True)
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


@lru_cache(maxsize=None)
def codec_library() -> ctypes.CDLL | None:
    """The loaded library, or None (the reference codec runs: one warning says why)."""
    if os.environ.get("HIGGS_CODEC") == "reference":
        return None
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler (cc, gcc or $CC): the sign codec runs as eager torch ops, "
                       "several passes over memory where the fused codec makes one")
        return None
    try:
        library = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("the fused sign codec did not build with %s (%s): the codec runs as eager torch ops",
                       cc, str(detail).strip()[:400])
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return library
