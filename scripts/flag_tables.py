"""The flag tables of the docs, generated from the pretrain script's parser: the config dataclasses'
flags (``HiggsConfig``, ``CheckpointConfig``, ``StabilityConfig``, ``ElasticConfig``, ``OffloadConfig``) with
their help and defaults, and the few Megatron-LM flags each table sits beside; the script's
own groups of Megatron-LM flags (model, parallelism, experts, training, data, logging); and the table
of what a flag needs of another (``runtime.run_config.RULES``, ``<!-- flags:rules -->``).

    python scripts/flag_tables.py           # rewrite the tables between the pages' markers
    python scripts/flag_tables.py --check   # exit 1, naming the tables, where a page differs

A table sits between ``<!-- flags:NAME -->`` and ``<!-- /flags -->``. Flag: with its metavar
where it has one. Meaning: the flag's help,
its choices appended; default: what the help says after "default:", else the parser's (on/off
for a switch); a schedule field ``--use-higgs`` derives when not given reads "derived: ...".
``tests/package/test_flag_tables.py`` fails when a page and this differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from higgs_megatron.checkpoint.flags import CheckpointConfig  # noqa: E402
from higgs_megatron.config import HiggsConfig  # noqa: E402
from higgs_megatron.elastic.flags import ElasticConfig  # noqa: E402
from higgs_megatron.field_flags import flag_fields  # noqa: E402
from higgs_megatron.memory import OffloadConfig  # noqa: E402
from higgs_megatron.runtime.run_config import RULES  # noqa: E402
from higgs_megatron.stability.flags import StabilityConfig  # noqa: E402
from higgs_megatron.training.arguments import build_parser  # noqa: E402

FILES = tuple(REPO / page for page in ("docs/compression.md", "docs/pretrain_script.md", "docs/checkpoints.md",
                                       "docs/stability.md", "docs/memory.md"))  # the pages with marked tables
GROUPS = ("model", "parallelism", "experts", "training", "data", "logging")  # the pretrain script's own argument groups


def _flags(config_class: type) -> list[str]:
    return [f.metadata["flag"] for f in flag_fields(config_class)]


TABLES = {
    "compression": ["--use-higgs", *_flags(HiggsConfig), "--check-weight-hash-across-dp-replicas-interval"],
    "checkpoints": ["--save", "--save-interval", "--load", "--keep-last", *_flags(CheckpointConfig)],
    "stability": [*_flags(StabilityConfig), "--exit-signal-handler", "--exit-duration-in-mins", "--exit-interval"],
    "elastic": _flags(ElasticConfig),
    "memory": ["--higgs-offload", *_flags(OffloadConfig), "--higgs-pin-memory-limit-gb", "--higgs-offload-schedule",
               "--higgs-block-allocator"],
}
DERIVED_FLAGS = {f.metadata["flag"] for f in flag_fields(HiggsConfig) if f.metadata.get("derived")}
_DEFAULT_IN_HELP = re.compile(r"^(?P<meaning>.*?)(?: \(default:? (?P<paren>[^()]*)\)|; default:? (?P<semi>[^()]*)\))$")


def row(parser: argparse.ArgumentParser, flag: str) -> str:
    action = parser._option_string_actions[flag]
    meaning, default = (action.help or "").replace("%%", "%"), None  # argparse's escape
    found = _DEFAULT_IN_HELP.match(meaning)
    if found:
        default = found["paren"] or found["semi"]
        meaning = found["meaning"] + (")" if found["semi"] else "")
    if action.choices and not all(str(choice) in meaning for choice in action.choices):
        meaning += f" ({', '.join(str(choice) for choice in action.choices)})"
    if default is None:
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            default = "on"
        else:
            default = "none" if action.default is None else str(action.default)
    if flag in DERIVED_FLAGS:
        default = f"derived: {default}"
    metavar = f" {action.metavar}" if action.metavar else ""
    names = ", ".join(f"`{name}{metavar if action.nargs != 0 else ''}`" for name in action.option_strings)
    return f"| {names} | {meaning.replace('|', '/')} | {default} |"


def group_flags(parser: argparse.ArgumentParser, title: str) -> list[str]:
    group = next(g for g in parser._action_groups if g.title == title)
    return [action.option_strings[0] for action in group._group_actions]


def rules_table() -> str:
    rows = [f"| `{rule.flags}` | {rule.word} `{rule.needs}` | {rule.why or ''} | {', '.join(rule.front_ends)} |"
            for rule in RULES]
    return "\n".join(["| flag | needs | why | front-ends |", "|---|---|---|---|"] + rows)


def table(parser: argparse.ArgumentParser, name: str) -> str:
    if name == "rules":
        return rules_table()
    flags = group_flags(parser, name) if name in GROUPS else TABLES[name]
    return "\n".join(["| flag | meaning | default |", "|---|---|---|"] + [row(parser, flag) for flag in flags])


def rendered(text: str) -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated, and the names of those that changed."""
    parser, changed = build_parser(), []

    def regenerate(found: re.Match) -> str:
        new = table(parser, found["name"])
        if found["body"].strip() != new:
            changed.append(found["name"])
        return f"<!-- flags:{found['name']} -->\n{new}\n<!-- /flags -->"

    text = re.sub(r"<!-- flags:(?P<name>\w+) -->\n(?P<body>.*?)<!-- /flags -->", regenerate, text, flags=re.S)
    return text, changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a page differs")
    args = parser.parse_args()
    stale = 0
    for page in FILES:
        text, changed = rendered(page.read_text())
        if args.check and changed:
            sys.stderr.write(f"{page.relative_to(REPO)}: flag tables out of date: {', '.join(changed)} "
                             "(python scripts/flag_tables.py rewrites them)\n")
            stale += 1
        elif not args.check:
            page.write_text(text)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
