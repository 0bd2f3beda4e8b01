"""The layers' import rule, read from the sources (every import, at any depth in a file):

* ``compress/`` is pure tensor code: it imports only itself (no ``torch.distributed``, no Megatron);
* ``reduce/`` holds the collectives: compress, the cost model and the topology below it, no
  Megatron and none of the glue above it (``ddp``, ``sync_plan``, ``grad_paths``);
* ``runtime/`` is what both front-ends run under: it imports neither front-end;
* the Megatron-LM patches import nothing from our pretrain script's front-end (``training/``);
* the installed package imports nothing of the test and benchmark kit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from higgs_megatron_bench.ranks import REPO_ROOT

PACKAGE = REPO_ROOT / "higgs_megatron"


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, relative imports resolved against ``package``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # a submodule imported by name
    return found


def _modules(folder: Path, package: str) -> dict[Path, set[str]]:
    return {path: imported_modules(path, package + "".join("." + part for part in path.relative_to(folder).parent.parts))
            for path in sorted(folder.rglob("*.py"))}


def _breaking(imports: dict[Path, set[str]], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path} imports {module}"
            for path, modules in imports.items()
            for module in sorted(modules) if any(module == f or module.startswith(f + ".") for f in forbidden)]


RULES = {
    "compress": ("torch.distributed", "megatron", "higgs_megatron.reduce", "higgs_megatron.ddp",
                 "higgs_megatron.sync_plan", "higgs_megatron.grad_paths", "higgs_megatron.cost_model",
                 "higgs_megatron.training", "higgs_megatron.runtime", "higgs_megatron.checkpoint",
                 "higgs_megatron.stability", "higgs_megatron.memory", "higgs_megatron.config"),
    "reduce": ("megatron", "higgs_megatron.ddp", "higgs_megatron.sync_plan", "higgs_megatron.grad_paths",
               "higgs_megatron.training", "higgs_megatron.runtime", "higgs_megatron.optimizer"),
    "runtime": ("higgs_megatron.training", "higgs_megatron_patches", "megatron_lm", "megatron.training"),
}


@pytest.mark.parametrize("room", sorted(RULES))
def test_each_layer_imports_only_what_lies_below_it(room):
    assert _breaking(_modules(PACKAGE / room, f"higgs_megatron.{room}"), RULES[room]) == []


def test_the_megatron_lm_patches_import_nothing_of_our_front_end():
    imports = _modules(REPO_ROOT / "patches", "higgs_megatron_patches")
    assert _breaking(imports, ("higgs_megatron.training",)) == []


def test_the_installed_package_imports_nothing_of_the_kit():
    imports = _modules(PACKAGE, "higgs_megatron")
    assert _breaking(imports, ("higgs_megatron_bench", "tests", "scripts")) == []


def test_the_rule_reader_sees_relative_and_nested_imports(tmp_path):
    """The reader itself: a relative import two levels up, and one inside a function."""
    source = tmp_path / "module.py"
    source.write_text("from ..training import loop\n\ndef f():\n    import megatron.training.training\n")
    found = imported_modules(source, "higgs_megatron.runtime")
    assert {"higgs_megatron.training", "higgs_megatron.training.loop", "megatron.training.training"} <= found
    assert [line.split(" imports ")[1] for line in _breaking({source: found}, RULES["runtime"])] == [
        "higgs_megatron.training", "higgs_megatron.training.loop", "megatron.training.training"]
