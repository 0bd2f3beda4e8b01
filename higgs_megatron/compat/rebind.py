"""Rebinding a name on someone else's module or class, and putting it back.

Megatron builds what it runs from names it looks up at call time (``training.DDP``, a
class's method): rebinding one changes what it builds without copying its code. Every
rebinding goes through a ``Rebinds``, which keeps the first original of each name, so that
``restore()`` leaves the owners exactly as they were, and ``original`` reaches the function a
wrapper wraps however many times the name was rebound. ``rebound`` is the same for the
duration of a block.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


class Rebinds:
    """The names rebound by one owner of patches (see the module docstring)."""

    def __init__(self) -> None:
        self._originals: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(owner), name) -> (owner, value)

    def rebind(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, the first original kept."""
        self._originals.setdefault((id(owner), name), (owner, getattr(owner, name)))
        setattr(owner, name, value)

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` was before this ``Rebinds`` first rebound it."""
        kept = self._originals.get((id(owner), name))
        return kept[1] if kept is not None else getattr(owner, name)

    def restore(self) -> None:
        """Put every rebound name back, the last rebound first."""
        for (_, name), (owner, value) in reversed(list(self._originals.items())):
            setattr(owner, name, value)
        self._originals.clear()



@contextmanager
def rebound(*bindings: tuple[Any, str, Any]) -> Iterator[Rebinds]:
    """``owner.name = value`` for each ``(owner, name, value)`` for the duration of the block,
    put back after it, whatever ends it."""
    rebinds = Rebinds()
    try:
        for owner, name, value in bindings:
            rebinds.rebind(owner, name, value)
        yield rebinds
    finally:
        rebinds.restore()
