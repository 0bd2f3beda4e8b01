"""What every flag group needs: which of its flags a run was actually given.

A flag whose feature is off would be silently ignored; the pretrain script and the
Megatron-LM patches refuse it instead, naming it. "Given" is read off the parser itself (a
value that differs from the flag's default), so a flag added to a group is covered without
a second list to keep in step.
"""

from __future__ import annotations

import argparse


def flags_given(args: argparse.Namespace, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of ``parser`` whose value in ``args`` differs from their default, named as a
    user writes them, in the parser's order (destinations in ``skip`` aside)."""
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and action.dest not in ("help", *skip)
            and getattr(args, action.dest, action.default) != action.default]
