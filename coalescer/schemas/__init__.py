"""Validation against Taskcluster's saved JSON schemas.

The schemas use `$id`s like ``/schemas/queue/v1/task.json#`` and relative `$ref`s, so they are
loaded into one :mod:`referencing` registry keyed by those ids; nothing is fetched.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

_ROOT = resources.files(__name__)


@functools.cache
def registry() -> Registry[Any]:
    """Every saved schema, by its `$id`, for resolving `$ref`s offline."""
    resources_: list[tuple[str, Resource[Any]]] = []
    for folder in ("queue/v1", "common"):
        for entry in _ROOT.joinpath(folder).iterdir():
            if entry.name.endswith(".json"):
                doc = json.loads(entry.read_text())
                uri = doc.get("$id", "").rstrip("#")
                resources_.append((uri, Resource.from_contents(doc, default_specification=DRAFT7)))
    return Registry().with_resources(resources_)


@functools.cache
def validator(name: str, *, legacy: bool = False) -> jsonschema.Draft7Validator:
    """A validator for ``queue/v1/<name>.json`` (``legacy`` takes the v39 copy when there is one)."""
    folder = (
        "queue/v39"
        if legacy and _ROOT.joinpath("queue/v39", f"{name}.json").is_file()
        else "queue/v1"
    )
    doc = json.loads(_ROOT.joinpath(folder, f"{name}.json").read_text())
    doc = {k: v for k, v in doc.items() if k != "$schema"}
    return jsonschema.Draft7Validator(
        doc, registry=registry(), format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )


def errors(name: str, instance: Any, *, legacy: bool = False) -> list[str]:
    """Human-readable schema violations of ``instance`` (empty when valid)."""
    found = sorted(validator(name, legacy=legacy).iter_errors(instance), key=lambda e: list(e.path))
    return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in found[:5]]


def load_reference(name: str) -> Any:
    """The queue's ``api.json`` or ``exchanges.json`` reference."""
    return json.loads(_ROOT.joinpath("queue", name).read_text())
