"""The layers' import rule, read from the sources (every import, at any depth in a file):

* ``compress/`` is pure tensor code: it imports only itself (no ``torch.distributed``, no Megatron);
* ``reduce/`` holds the collectives: compress, the cost model and the topology below it, no
  Megatron and none of the glue above it (``ddp``, ``sync_plan``, ``grad_paths``);
* ``cost_model.py`` is pure arithmetic;
* nothing below the runtime (the glue, the collectives, the tensor code) imports it or a front-end;
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
    def package_of(path: Path) -> str:
        return ".".join([package, *path.relative_to(folder).parent.parts])
    return {path: imported_modules(path, package_of(path)) for path in sorted(folder.rglob("*.py"))}


def _breaking(imports: dict[Path, set[str]], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path} imports {module}"
            for path, modules in imports.items()
            for module in sorted(modules) if any(module == f or module.startswith(f + ".") for f in forbidden)]


# Per room: the rooms of ours it may import (anything else of ours breaks the rule), and what
# else it may not import.
ALLOWED = {
    "compress": ("higgs_megatron.compress",),
    "reduce": ("higgs_megatron.compress", "higgs_megatron.reduce", "higgs_megatron.cost_model",
               "higgs_megatron.topology"),
    "cost_model": (),
}
FORBIDDEN = {"compress": ("torch.distributed", "megatron"), "reduce": ("megatron",),
             "cost_model": ("torch", "megatron")}
OURS = ("higgs_megatron", "higgs_megatron_patches", "higgs_megatron_bench")


def _outside(imports: dict[Path, set[str]], allowed: tuple[str, ...]) -> list[str]:
    """Imports of ours that are not under an allowed room."""
    ours = {path: {m for m in modules if any(m == o or m.startswith(o + ".") for o in OURS)
                   and not any(m == a or m.startswith(a + ".") for a in allowed)}
            for path, modules in imports.items()}
    return _breaking(ours, OURS)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_the_lower_layers_import_only_what_lies_below_them(room):
    """compress: itself; reduce: compress, the cost model, the topology, itself; the cost
    model: nothing (pure arithmetic); none of them Megatron."""
    path = PACKAGE / room
    imports = _modules(path, f"higgs_megatron.{room}") if path.is_dir() else {
        path.with_suffix(".py"): imported_modules(path.with_suffix(".py"), "higgs_megatron")}
    assert _outside(imports, ALLOWED[room]) + _breaking(imports, FORBIDDEN[room]) == []


ABOVE_THE_GLUE = ("runtime", "training", "cli.py", "__init__.py")  # the runtime, the front-ends, the package's face


@pytest.mark.parametrize("room", sorted(p.name for p in PACKAGE.iterdir() if p.name not in ABOVE_THE_GLUE
                                        and (p.suffix == ".py" or (p / "__init__.py").exists())))
def test_nothing_below_the_runtime_imports_it_or_a_front_end(room):
    path = PACKAGE / room
    imports = (_modules(path, f"higgs_megatron.{room}") if path.is_dir()
               else {path: imported_modules(path, "higgs_megatron")})
    assert _breaking(imports, ("higgs_megatron.runtime", "higgs_megatron.training", "higgs_megatron_patches")) == []


def test_the_runtime_imports_no_front_end():
    imports = _modules(PACKAGE / "runtime", "higgs_megatron.runtime")
    assert _breaking(imports, ("higgs_megatron.training", "higgs_megatron_patches", "megatron_lm",
                               "megatron.training")) == []


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
    broken = _breaking({source: found}, ("higgs_megatron.training", "megatron.training"))
    assert [line.split(" imports ")[1] for line in broken] == [
        "higgs_megatron.training", "higgs_megatron.training.loop", "megatron.training.training"]
