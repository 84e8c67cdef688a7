"""The project's metadata in the form current packaging tools read without warnings."""

from __future__ import annotations

import pathlib
import tomllib

PYPROJECT = pathlib.Path(__file__).parents[2] / "pyproject.toml"


def test_the_license_is_an_spdx_expression_that_setuptools_reads_as_such() -> None:
    doc = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    # A ``{text = ...}`` table is deprecated: setuptools warns on every install.
    assert doc["project"]["license"] == "MPL-2.0"
    # The SPDX string form needs setuptools 77 or later to build.
    (setuptools,) = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools.replace(" ", "") == "setuptools>=77"
