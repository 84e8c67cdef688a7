"""Validating Pulse messages against the queue's saved schemas, fast.

``jsonschema`` interprets a schema for every message: about 0.3 ms for a task message, most of
a consumer's time per event. ``jsonschema-rs`` compiles the same schema, with every ``$ref``
inlined, once, and checks a message in a few microseconds (in Rust: five times faster than
``fastjsonschema``'s generated Python, which this module used before). It only ever *accepts*:
a message it refuses is checked again by :func:`coalescer.schemas.errors`, which stays the
reference (and says why), so the two can never disagree about what is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import jsonschema_rs

from coalescer import schemas

log = logging.getLogger(__name__)

#: Deeper than any of the queue's schemas; a cycle of ``$ref``s stops here (slow path then).
_MAX_DEPTH = 64


def errors(name: str, instance: Any) -> list[str]:
    """Violations of ``queue/v1/<name>.json`` by ``instance``, as :func:`schemas.errors`."""
    if _accepts(_compiled(name), instance):
        return []
    return schemas.errors(name, instance)


def listing_errors(
    name: str, instance: Any, field: str, identity: Callable[[Any], Hashable]
) -> list[str]:
    """:func:`errors` for a listing whose items (``instance[field]``, ``uniqueItems``) each
    name one thing, by ``identity(item)``. Hashing every item (whole task definitions) to check
    ``uniqueItems`` costs more than the rest of the schema; items of distinct identities are
    distinct, so then that check is skipped. Otherwise the full schema decides."""
    items = instance.get(field) if isinstance(instance, dict) else None
    if _distinct(items, identity) and _accepts(_compiled(name, field), instance):
        return []
    return errors(name, instance)


def _accepts(check: Callable[[Any], bool] | None, instance: Any) -> bool:
    if check is None:
        return False
    try:
        return check(instance)
    except (ValueError, OverflowError):  # not JSON data (the reference says why)
        return False


def _distinct(items: Any, identity: Callable[[Any], Hashable]) -> bool:
    """Whether ``items`` is a list whose items all have different identities."""
    try:
        return isinstance(items, list) and len({identity(i) for i in items}) == len(items)
    except (TypeError, KeyError, AttributeError):
        return False


@functools.cache
def _compiled(name: str, distinct: str | None = None) -> Callable[[Any], bool] | None:
    """The compiled schema's check; with ``distinct``, without ``uniqueItems`` on that
    property."""
    schema = schemas.validator(name).schema
    try:
        resolver = schemas.registry().resolver(str(schema.get("$id", "")).rstrip("#"))
        inlined = _inline(schema, resolver, 0)
        if distinct is not None:
            inlined["properties"][distinct].pop("uniqueItems", None)
        validator = jsonschema_rs.Draft7Validator(
            inlined,
            validate_formats=True,
            # The queue's patterns are plain (no look-around, no back-references): the
            # ``regex`` engine matches them faster than the default ``fancy-regex``.
            pattern_options=jsonschema_rs.RegexOptions(),
        )
    except (LookupError, ValueError) as exc:
        log.warning("schema %s not compiled (%s); validating the slow way", name, exc)
        return None
    return validator.is_valid


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
