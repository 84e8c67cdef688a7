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


#: Where a task status lists its runs (messages, ``status`` answers); a run is named by its
#: ``runId`` (``runs[i]`` has ``runId == i``).
RUNS = ("status", "runs")


def errors(name: str, instance: Any) -> list[str]:
    """Violations of ``queue/v1/<name>.json`` by ``instance``, as :func:`schemas.errors`."""
    distinct = _distinct(_at(instance, RUNS), _run_id)
    check = _compiled(name, RUNS if distinct else None)
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
    check = _compiled(name, (field,)) if _distinct(_at(instance, (field,)), identity) else None
    if check is not None:
        try:
            check(instance)
            return []
        except fastjsonschema.JsonSchemaException:
            pass
    return errors(name, instance)


def _at(instance: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if not isinstance(instance, dict):
            return None
        instance = instance.get(name)
    return instance


def _distinct(items: Any, identity: Callable[[Any], Hashable]) -> bool:
    """Whether ``items`` is a list whose items all have different identities."""
    try:
        return isinstance(items, list) and len({identity(i) for i in items}) == len(items)
    except (TypeError, KeyError, AttributeError):
        return False


def _run_id(run: Any) -> Hashable:
    # A bool is an int to Python and a different value to JSON: such a run is never distinct.
    run_id = run["runId"]
    if isinstance(run_id, bool) or not isinstance(run_id, int):
        raise TypeError("runId is not an integer")
    return run_id


@functools.cache
def _compiled(name: str, distinct: tuple[str, ...] | None = None) -> Callable[[Any], Any] | None:
    """The compiled schema; with ``distinct``, a path of properties to an array, without that
    array's ``uniqueItems`` (when the schema has it)."""
    schema = schemas.validator(name).schema
    try:
        resolver = schemas.registry().resolver(str(schema.get("$id", "")).rstrip("#"))
        inlined = _inline(schema, resolver, 0)
        if distinct is not None:
            node = inlined
            for prop in distinct:
                node = node.get("properties", {}).get(prop, {})
            node.pop("uniqueItems", None)
        return fastjsonschema.compile(inlined)
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
