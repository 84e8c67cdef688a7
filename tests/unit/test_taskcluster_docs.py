"""The how-to for the real-Taskcluster tests says true things about them: how many there are,
which, and a kit recipe that reaches the kit's Pulse vhost."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOW_TO = ROOT / "docs" / "how-to" / "real-taskcluster.md"
NUMBERS = {
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
}


def _tests() -> list[str]:
    """``file::name`` of every test in ``tests_taskcluster/``."""
    found = []
    for path in sorted((ROOT / "tests_taskcluster").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and node.name.startswith("test_"):
                found.append(f"{path.name}::{node.name}")
    return found


def test_the_how_to_counts_and_lists_every_real_taskcluster_test() -> None:
    text = HOW_TO.read_text()
    tests = _tests()
    counts = re.findall(r"\bthe (\w+) tests\b", text)
    assert counts, "the how-to no longer says how many tests there are"
    assert all(NUMBERS.get(word) == len(tests) for word in counts), (counts, len(tests))
    listed = re.findall(r"^\| `(test_\w+\.py::test_\w+)` \|", text, re.MULTILINE)
    assert sorted(listed) == sorted(tests)


def test_the_kit_recipe_builds_pulse_url_with_the_kits_vhost() -> None:
    text = HOW_TO.read_text()
    recipe = text[text.index("## Run it against the local kit") :]
    exported = recipe[recipe.index("export PULSE_URL=") :].split("\nmake ", 1)[0]
    assert "$PULSE_VHOST" in exported, exported
