"""The store's seam is public (docs/architecture.md): no module but ``store/redis.py`` reaches a
private member of a store, such as ``store._pipeline``. The modules beside it go through
``Store.pipeline``, ``Store.eval`` and ``Store.send_in_order`` (``store/base.py``)."""

from __future__ import annotations

import ast
import pathlib

import coalescer

ROOT = pathlib.Path(coalescer.__file__).parent


def private_reaches(source: str) -> list[tuple[int, str]]:
    """``(line, "store._name")`` for each private attribute read through something called
    ``store`` (a name, or an attribute such as ``self.store`` or ``app.state.store``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if name == "store":
            found.append((node.lineno, f"store.{node.attr}"))
    return sorted(found)


def test_the_check_finds_a_private_reach() -> None:
    source = "async def f(store, app):\n    await store._pipeline(None)\n    app.state.store._sha\n"
    assert private_reaches(source) == [(2, "store._pipeline"), (3, "store._sha")]
    assert private_reaches("store.pipeline, store.__class__, self._store") == []


def test_no_module_but_the_store_itself_reaches_a_private_member_of_a_store() -> None:
    found = [
        f"{path.relative_to(ROOT.parent)}:{line}: {reach}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "store" / "redis.py"
        for line, reach in private_reaches(path.read_text(encoding="utf-8"))
    ]
    assert found == []
