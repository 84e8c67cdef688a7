"""The package's modules import each other one way: no import circle, not even one hidden under
``if TYPE_CHECKING:`` or inside a function (it still ties the two modules together)."""

from __future__ import annotations

import ast
import graphlib
import pathlib

import coalescer

ROOT = pathlib.Path(coalescer.__file__).parent


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its file. A package's
    ``__init__`` only re-exports, so ``from pkg import mod`` counts as importing ``pkg.mod``
    and packages themselves are left out, as the import-circles tool does."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n in modules and n != name and modules[n].name != "__init__.py"}


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 50  # the walk found the package
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import circle: {' -> '.join(exc.args[1])}") from None


def test_an_import_under_type_checking_counts(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import thing\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError:
        pass
    else:
        raise AssertionError("the circle pkg.a <-> pkg.b went unnoticed")
