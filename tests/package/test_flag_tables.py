"""The flag tables of the docs are what the parsers say (``scripts/flag_tables.py`` writes them)."""

import importlib.util

from higgs_megatron_bench.ranks import REPO_ROOT


def _flag_tables():
    spec = importlib.util.spec_from_file_location("flag_tables", REPO_ROOT / "scripts" / "flag_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flag_tables_are_generated_from_the_parsers():
    tables = _flag_tables()
    for page in tables.FILES:
        _, changed = tables.rendered(page.read_text())
        assert changed == [], f"{page.name}: flag tables differ from the parsers: {changed} (scripts/flag_tables.py)"
    pages = "".join(page.read_text() for page in tables.FILES)
    assert all(f"<!-- flags:{name} -->" in pages for name in tables.TABLES)  # every table is on a page


def test_a_changed_help_shows_as_a_changed_table():
    tables = _flag_tables()
    page = (REPO_ROOT / "docs" / "checkpoints.md").read_text().replace("keep only the newest N checkpoints",
                                                                         "keep them all")
    assert tables.rendered(page)[1] == ["checkpoints"]
