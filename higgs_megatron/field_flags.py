"""Command-line flags generated from dataclass fields.

A config dataclass declares each field's flag in the field's metadata (``flag_metadata``): its
name, help, and what argparse needs beyond the type and the default. ``add_field_flags`` adds
one flag per such field, with the field's default, so our pretrain script and the Megatron-LM
patches get the same flags with the same defaults from one source; ``field_values`` reads them
back (``config_flags`` the other way: a config as the flags that make it), and ``field_flag``
names the flag of a field, so an error about a field can name its flag.
A field's argparse destination is its flag without dashes (``--no-higgs-pin-memory`` stores
``higgs_pin_memory``).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any


def flag_metadata(name: str, help: str, derived: bool = False, **argparse_kwargs: Any) -> dict:
    """Field metadata: the flag, its help, and what argparse needs beyond type and default.
    ``derived``: the flag's default is None (not given), the value a run derives then."""
    return {"flag": name, "help": help, "derived": derived, "argparse": argparse_kwargs}


def flag_dest(flag: str) -> str:
    """The argparse destination of a flag: ``--no-higgs-x-y`` and ``--higgs-x-y`` store ``higgs_x_y``."""
    return flag.lstrip("-").removeprefix("no-").replace("-", "_")


def flag_fields(config_class: type) -> list:
    return [f for f in fields(config_class) if "flag" in f.metadata]


def add_field_flags(group: argparse._ActionsContainer, config_class: type) -> None:
    """Add one flag per field of ``config_class`` that declares one, with the field's default."""
    for config_field in flag_fields(config_class):
        meta = config_field.metadata
        default = None if config_field.default is MISSING or meta.get("derived") else config_field.default
        group.add_argument(meta["flag"], dest=flag_dest(meta["flag"]), default=default, help=meta["help"],
                           **meta["argparse"])


def field_values(args: argparse.Namespace, config_class: type) -> dict[str, Any]:
    """The values ``args`` holds for the flagged fields of ``config_class``, by field name."""
    return {f.name: getattr(args, flag_dest(f.metadata["flag"])) for f in flag_fields(config_class)}


def field_flag(config_class: type, field_name: str) -> str:
    """The command-line flag of a field of ``config_class``."""
    return next(f.metadata["flag"] for f in flag_fields(config_class) if f.name == field_name)


def config_flags(config: Any) -> list[str]:
    """The flags that make ``config`` (a dataclass instance of flagged fields) from a parser's
    defaults: each flagged field whose value differs from its flag's default (a ``derived``
    field's default is None: its value is always written)."""
    flags: list[str] = []
    for config_field in flag_fields(type(config)):
        meta, value = config_field.metadata, getattr(config, config_field.name)
        default = None if config_field.default is MISSING or meta.get("derived") else config_field.default
        if value == default:
            continue
        flag, action = meta["flag"], meta["argparse"].get("action")
        if action is argparse.BooleanOptionalAction:
            flags.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif action in ("store_true", "store_false"):
            flags.append(flag)  # differs from the default: the switch is given
        elif action == "append":
            for item in value:
                flags += [flag, str(item)]
        else:
            flags += [flag, repr(value) if isinstance(value, float) else str(value)]  # repr: every digit
    return flags
