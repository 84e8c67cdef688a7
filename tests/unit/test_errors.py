"""errors.py draws the exception tree: every class of it, under its parent."""

from __future__ import annotations

import importlib
import pkgutil
import re

import coalescer
from coalescer import errors


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_the_drawn_tree_has_every_error_class_under_its_parent() -> None:
    for module in pkgutil.walk_packages(coalescer.__path__, "coalescer."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    drawing = errors.__doc__ or ""
    rows = {}  # name as drawn -> its depth in the tree
    for line in drawing.splitlines():
        if match := re.match(r"^    ([│ ]*)(├── |└── )?([\w.]+)", line):
            indent, branch, name = match.groups()
            rows[name] = len(indent) // 4 + (1 if branch else 0)
    classes = _subclasses(errors.CoalescerError)
    assert len(classes) >= 8  # the walk works
    missing = []
    for cls in classes:
        name = cls.__module__.removeprefix("coalescer.") + "." + cls.__qualname__
        name = cls.__qualname__ if cls.__module__ == "coalescer.errors" else name
        parent = cls.__mro__[1]
        drawn_parent = (
            parent.__qualname__
            if parent.__module__ == "coalescer.errors"
            else parent.__module__.removeprefix("coalescer.") + "." + parent.__qualname__
        )
        if name not in rows or rows.get(drawn_parent, -9) != rows[name] - 1:
            missing.append(f"{name} (under {drawn_parent})")
    assert not missing, f"draw these in errors.py's tree: {missing}"
