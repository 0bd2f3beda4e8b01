"""What every flag group needs: which of its flags a run was actually given.

A flag whose feature is off would be silently ignored; the pretrain script and the
Megatron-LM patches refuse it instead, naming it. "Given" is read off the parser itself (a
value that differs from what the parser makes of no flags at all), so a flag added to a
group is covered without a second list to keep in step. A flag given at its default value
is indistinguishable from one not given, and passes.
"""

from __future__ import annotations

import argparse
import math


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def flags_given(args: argparse.Namespace, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of ``parser`` whose value in ``args`` differs from the parser's own result for
    no flags, in the parser's order, each destination once (destinations in ``skip`` aside),
    named by the first flag of that destination."""
    baseline = parser.parse_known_args([])[0]
    given, seen = [], set(skip) | {"help"}
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in seen:
            continue
        seen.add(dest)
        if not _same(getattr(args, dest, getattr(baseline, dest, None)), getattr(baseline, dest, None)):
            given.append(action.option_strings[0])
    return given
