"""Validation against Taskcluster's saved JSON schemas.

The schemas use `$id`s like ``/schemas/queue/v1/task.json#`` and relative `$ref`s, so they are
loaded into one :mod:`referencing` registry keyed by those ids; nothing is fetched.

A ``pattern`` is an ECMA 262 regular expression, whose ``$`` (without the multiline flag)
matches only at the very end: the queue refuses a taskId with a trailing newline. Python's
``$`` also matches before a final newline, so the patterns are read with ``\\Z`` for ``$``
(``jsonschema-rs``, the fast check of :mod:`coalescer.ingest.validation`, reads them as ECMA
262 does).
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

import jsonschema
from jsonschema import ValidationError
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

_ROOT = resources.files(__name__)
_DOLLAR = re.compile(r"(?<!\\)\$")


@functools.lru_cache(maxsize=256)
def _ecma(pattern: str) -> re.Pattern[str]:
    return re.compile(_DOLLAR.sub(r"\\Z", pattern))


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _ecma(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


_Validator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"pattern": _pattern})


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


def _fill_properties(
    validator: Any, properties: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    """``properties`` that first gives each missing property its ``default``, in place."""
    if validator.is_type(instance, "object"):
        for name, subschema in properties.items():
            if isinstance(subschema, dict) and "default" in subschema and name not in instance:
                instance[name] = copy.deepcopy(subschema["default"])
    yield from _PROPERTIES(validator, properties, instance, schema)


_PROPERTIES = jsonschema.Draft7Validator.VALIDATORS["properties"]
_FillingValidator = jsonschema.validators.extend(_Validator, {"properties": _fill_properties})


@functools.cache
def validator(
    name: str, *, legacy: bool = False, fill_defaults: bool = False
) -> jsonschema.protocols.Validator:
    """A validator for ``queue/v1/<name>.json`` (``legacy`` takes the v39 copy when there is one;
    ``fill_defaults`` makes it fill in defaults, see :func:`errors`)."""
    folder = (
        "queue/v39"
        if legacy and _ROOT.joinpath("queue/v39", f"{name}.json").is_file()
        else "queue/v1"
    )
    doc = json.loads(_ROOT.joinpath(folder, f"{name}.json").read_text())
    doc = {k: v for k, v in doc.items() if k != "$schema"}
    cls = _FillingValidator if fill_defaults else _Validator
    validating: jsonschema.protocols.Validator = cls(
        doc, registry=registry(), format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )
    return validating


def errors(
    name: str, instance: Any, *, legacy: bool = False, fill_defaults: bool = False
) -> list[str]:
    """Human-readable schema violations of ``instance`` (empty when valid).

    With ``fill_defaults`` every missing property whose schema has a ``default`` gets it, in
    ``instance`` itself, as Taskcluster's validator (ajv's ``useDefaults``) does to a request.
    """
    checker = validator(name, legacy=legacy, fill_defaults=fill_defaults)
    found = sorted(checker.iter_errors(instance), key=lambda e: list(e.path))
    return [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in found[:5]]


def load_reference(name: str) -> Any:
    """The queue's ``api.json`` or ``exchanges.json`` reference."""
    return json.loads(_ROOT.joinpath("queue", name).read_text())
