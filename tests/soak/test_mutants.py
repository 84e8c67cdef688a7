"""Every bug of the soak's mutation check still applies to the source as it is: an edit whose
text moved on would make ``make soak-check`` stop before its first soak."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.soak import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_to_the_source_and_changes_it(
    mutant: mutants.Mutant, tmp_path: Path
) -> None:
    for edit in mutant.edits:
        (tmp_path / edit.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(mutants.ROOT / edit.path, tmp_path / edit.path)
    mutants.apply(tmp_path, mutant)
    for edit in mutant.edits:
        assert (tmp_path / edit.path).read_text() != (mutants.ROOT / edit.path).read_text()


def test_mutant_names_are_unique_and_each_names_its_invariant() -> None:
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names)) >= 10
    assert all(m.catches and m.bug and m.edits for m in mutants.MUTANTS)
