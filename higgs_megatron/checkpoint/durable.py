"""The filesystem steps of a commit, each durable before the next depends on it.

A rename is atomic but not durable: after a power loss, a renamed directory can name files
whose bytes never reached the disk, unless the files were fsynced before, and the rename
itself is durable only once its parent directory is fsynced. ``save.commit`` runs these steps
in the order ``docs/checkpoints.md`` gives; every file operation of a commit goes through this
module, so a test can record their order (``tests/checkpoint/test_durable.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
from pathlib import Path

def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (names created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably: a temporary file, fsynced, renamed
    over it, then the directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    rename(tmp, path)
    fsync_dir(path.parent)


def rename(source: Path, target: Path) -> None:
    """``os.replace``: atomic, durable once the parent directory is fsynced."""
    os.replace(source, target)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_libc = None


def exchange(first: Path, second: Path) -> bool:
    """Swap two directories' names in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``). False where the kernel, the C library or the filesystem does not
    offer it (NFS, for one), with nothing changed."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2({first}, {second}, RENAME_EXCHANGE): {os.strerror(code)}")


def replace_dir(new: Path, final: Path, aside: Path) -> None:
    """Put directory ``new`` at ``final``, replacing what is there, and make it durable.

    Where ``final`` exists, the two are swapped in one step (``exchange``), so ``final`` always
    names a whole checkpoint, the old one or the new one; the old one, now at ``new``, is
    removed after the parent directory is fsynced. Without an exchange (NFS), the old one is
    renamed to ``aside`` first: a crash between the two renames leaves ``final`` absent (the
    load then falls back to the previous checkpoint) and the old one whole at ``aside``."""
    parent = final.parent
    if not final.exists():
        rename(new, final)
        fsync_dir(parent)
        return
    if exchange(new, final):
        fsync_dir(parent)
        remove_tree(new)
        return
    rename(final, aside)
    rename(new, final)
    fsync_dir(parent)
    remove_tree(aside)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
