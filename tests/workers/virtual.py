"""Process functions for tests/sync/drill_virtual_dp.py: the virtual data-parallel group of
``scripts/virtual_dp.py``, in a process of its own (its fake group is the default group)."""

from __future__ import annotations


def load_virtual_dp():
    """The module ``scripts/virtual_dp.py``."""
    import importlib.util
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[2] / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location("virtual_dp", scripts / "virtual_dp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def virtual_losses(world_size: int, argv: list[str]) -> dict:
    """``scripts/virtual_dp.py``'s run of ``argv`` over ``world_size`` virtual ranks."""
    return load_virtual_dp().run_virtual(world_size, argv)
