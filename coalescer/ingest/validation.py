"""Validating Pulse messages against the queue's saved schemas, fast.

``jsonschema`` interprets a schema for every message: about 0.3 ms for a task message, most of
a consumer's time per event. ``fastjsonschema`` compiles the same schema, with every ``$ref``
inlined, to Python once and checks a message in about 15 µs. It only ever *accepts*: a message
it rejects is checked again by :func:`coalescer.schemas.errors`, which stays the reference (and
says why), so the two can never disagree about what is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import fastjsonschema

from coalescer import schemas

log = logging.getLogger(__name__)

#: Deeper than any of the queue's schemas; a cycle of ``$ref``s stops here (slow path then).
_MAX_DEPTH = 64


def errors(name: str, instance: Any) -> list[str]:
    """Violations of ``queue/v1/<name>.json`` by ``instance``, as :func:`schemas.errors`."""
    check = _compiled(name)
    if check is not None:
        try:
            check(instance)
            return []
        except fastjsonschema.JsonSchemaException:
            pass
    return schemas.errors(name, instance)


def listing_errors(
    name: str, instance: Any, field: str, identity: Callable[[Any], Hashable]
) -> list[str]:
    """:func:`errors` for a listing whose items (``instance[field]``, ``uniqueItems``) each
    name one thing, by ``identity(item)``. Hashing every item (whole task definitions) to check
    ``uniqueItems`` costs more than the rest of the schema; items of distinct identities are
    distinct, so then that check is skipped. Otherwise the full schema decides."""
    items = instance.get(field) if isinstance(instance, dict) else None
    try:
        distinct = isinstance(items, list) and len({identity(i) for i in items}) == len(items)
    except (TypeError, KeyError, AttributeError):
        distinct = False
    check = _compiled(name, field) if distinct else None
    if check is not None:
        try:
            check(instance)
            return []
        except fastjsonschema.JsonSchemaException:
            pass
    return errors(name, instance)


@functools.cache
def _compiled(name: str, distinct: str | None = None) -> Callable[[Any], Any] | None:
    """The compiled schema; with ``distinct``, without ``uniqueItems`` on that property."""
    schema = schemas.validator(name).schema
    if distinct is not None:
        prop = {k: v for k, v in schema["properties"][distinct].items() if k != "uniqueItems"}
        schema = {**schema, "properties": {**schema["properties"], distinct: prop}}
    try:
        resolver = schemas.registry().resolver(str(schema.get("$id", "")).rstrip("#"))
        return fastjsonschema.compile(_inline(schema, resolver, 0))
    except (fastjsonschema.JsonSchemaDefinitionException, LookupError, ValueError) as exc:
        log.warning("schema %s not compiled (%s); validating the slow way", name, exc)
        return None


def _inline(node: Any, resolver: Any, depth: int) -> Any:
    """``node`` with every ``$ref`` replaced by what it points to (draft 7: a ``$ref``'s
    siblings are ignored, so dropping them changes nothing)."""
    if depth > _MAX_DEPTH:
        raise ValueError("$ref nesting too deep (a cycle?)")
    if isinstance(node, dict):
        if "$ref" in node:
            resolved = resolver.lookup(node["$ref"])
            return _inline(resolved.contents, resolved.resolver, depth + 1)
        return {
            key: _inline(value, resolver, depth + 1)
            for key, value in node.items()
            if key not in ("$id", "$schema")
        }
    if isinstance(node, list):
        return [_inline(item, resolver, depth + 1) for item in node]
    return node
