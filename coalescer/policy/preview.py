"""What a policy would do with a generated task graph, before it is deployed. Pure but for
reading the file in :func:`load_graph`.

``coalescer policy check POLICY --taskgraph full.json`` reads ``taskgraph full --json`` output
(a mapping of label to ``{kind, label, attributes, task}``), finds each task's coalescing keys
in its routes, and says per key which rule governs it and what follows: superseded on arrival
(a rule that decides), superseded when a worker that follows ``supersederUrl`` claims one, or
never superseded (neither).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from coalescer.errors import ConfigError
from coalescer.model import keys_from_routes
from coalescer.policy.rules import Policy


@dataclasses.dataclass(frozen=True)
class KeyTasks:
    """The tasks of a graph under one coalescing key."""

    key: str
    labels: tuple[str, ...]
    #: labels of the tasks whose payload names a ``supersederUrl``
    followed: tuple[str, ...]


def load_graph(path: str | Path) -> dict[str, Any]:
    """A ``taskgraph full --json`` file, or ConfigError in one line."""
    try:
        doc = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise ConfigError(f"task graph {str(path)!r} not found") from None
    except OSError as exc:
        raise ConfigError(f"task graph {str(path)!r} cannot be read: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"task graph {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not all(
        isinstance(t, dict) and isinstance(t.get("task"), dict) for t in doc.values()
    ):
        raise ConfigError(
            f"task graph {str(path)!r} is not `taskgraph full --json` output "
            "(a mapping of label to {kind, label, task, ...})"
        )
    return doc


def keys_of(graph: Mapping[str, Any], prefix: str) -> tuple[list[KeyTasks], list[str]]:
    """The graph's keys in first-seen order, and the labels of the tasks without one."""
    found: dict[str, tuple[list[str], list[str]]] = {}
    without = []
    for name, entry in graph.items():
        label = entry.get("label", name)  # the morphed and optimized graphs are by taskId
        definition = entry["task"]
        routes = definition.get("routes") or []
        keys = keys_from_routes([r for r in routes if isinstance(r, str)], prefix)
        if not keys:
            without.append(str(label))
        payload = definition.get("payload")
        follows = isinstance(payload, dict) and bool(payload.get("supersederUrl"))
        for key in keys:
            labels, followed = found.setdefault(key, ([], []))
            labels.append(str(label))
            if follows:
                followed.append(str(label))
    keyed = [KeyTasks(k, tuple(ls), tuple(fs)) for k, (ls, fs) in found.items()]
    return keyed, without


def explain(graph: Mapping[str, Any], policy: Policy, prefix: str, source: str) -> list[str]:
    """One line for the graph, one per key: its rule and what that means for its tasks."""
    keyed, without = keys_of(graph, prefix)
    lines = [
        f"{source}: {len(graph)} tasks, {len(graph) - len(without)} under {len(keyed)} "
        f"coalescing keys ({prefix}.*), {len(without)} without"
        + (f": {_few(without)}" if without else "")
    ]
    for entry in keyed:
        rule = policy.rule_for(entry.key)
        if rule.decides:
            fate = "superseded on arrival by `coalescer enforce`"
        elif entry.followed:
            fate = "superseded when a worker claims one ("
            fate += (
                "each names supersederUrl)"
                if entry.followed == entry.labels
                else (f"only {_few(list(entry.followed))} name supersederUrl)")
            )
        else:
            fate = "never superseded: no supersederUrl, and no rule decides on arrival"
        if len(entry.labels) > 1:  # one graph is one push: these would supersede each other
            fate += (
                f"; {len(entry.labels)} tasks of this graph share it and would supersede each other"
            )
        lines.append(
            f"{entry.key}: {rule.name} ({rule.strategy}): {fate} [{_few(list(entry.labels))}]"
        )
    return lines


def _few(labels: list[str], most: int = 3) -> str:
    shown = ", ".join(labels[:most])
    return shown if len(labels) <= most else f"{shown} and {len(labels) - most} more"
