"""Lineage: what superseded a task, what it superseded, and where a chain of replacements ends.

``A`` superseded by ``B``, then ``B`` by ``C``: ``A``'s chain is ``[B, C]`` and ``C`` is its
final primary, the task whose result stands for ``A``. The primary can also read what it
superseded, with their definitions as the enforcer saw them, to reuse their state
(:func:`handoff`: the same shape as the worker's ``COALESCER_SUPERSEDES_FILE``).
"""

from __future__ import annotations

from typing import Any

import orjson

from coalescer import keyset
from coalescer.model import format_time_ms
from coalescer.policy.rules import Policy
from coalescer.store import Store
from coalescer.store import keyset as stored
from coalescer.store import lineage as records

#: Longest chain followed (chains are short in practice: each link is a newer push).
MAX_CHAIN = 16
#: States in which a victim's work is (being) replaced by its primary's.
REPLACED = frozenset({"decided", "settling", "held", "superseded", "canceled"})


async def deciding_keys(store: Store, policy: Policy | None) -> list[str]:
    """The keys whose rule decides on arrival (the only ones with lineage), among the
    :data:`~coalescer.keyset.LIST_CAP` most recently active keys."""
    if policy is None or not policy.decides:
        return []
    listed, _ = await stored.recent(store, 0, keyset.LIST_CAP - 1)
    return [k for k, _ in listed if policy.rule_for(k).decides]


def _decision_json(d: records.Decision, task_id: str) -> dict[str, Any]:
    return {
        "taskId": task_id,
        "runId": d.run if task_id == d.task_id else d.by_run,
        "key": d.key,
        "rule": d.rule,
        "reason": d.reason,
        "at": format_time_ms(d.at_ms),
        "action": d.action,
        "state": d.state,
        "resolution": {"as": d.resolved_as, "why": d.resolved_why} if d.resolved_as else None,
    }


async def lineage(store: Store, policy: Policy | None, task_id: str) -> dict[str, Any] | None:
    """``GET /v1/tasks/<taskId>``'s answer, or None when no decision names the task."""
    names = await deciding_keys(store, policy)
    mine, theirs = await records.lineage(store, names, task_id)
    if not mine and not theirs:
        return None
    by = min(mine, key=lambda d: d.at_ms) if mine else None
    chain: list[str] = []
    seen = {task_id}
    step = by
    while step is not None and step.by not in seen and len(chain) < MAX_CHAIN:
        chain.append(step.by)
        seen.add(step.by)
        above, _ = await records.lineage(store, names, step.by)
        # A victim that ran for a bisection (``ran``) stands for others with its own result.
        above = [d for d in above if d.state in REPLACED]
        step = min(above, key=lambda d: d.at_ms) if above else None
    return {
        "taskId": task_id,
        "supersededBy": None if by is None else _decision_json(by, by.by) | {"victimRunId": by.run},
        "chain": chain,
        "finalPrimary": chain[-1] if chain else None,
        "supersedes": [_decision_json(d, d.task_id) for d in theirs],
        "decisions": [_decision_json(d, d.by) | {"victimRunId": d.run} for d in mine],
    }


async def handoff(store: Store, policy: Policy | None, task_id: str) -> list[dict[str, Any]]:
    """What ``task_id`` replaces, transitively, oldest decision first: ``[{taskId, runId,
    task}]`` (``task`` is the definition the enforcer saw, or None if it has not acted yet)."""
    names = await deciding_keys(store, policy)
    found: list[records.Decision] = []
    todo, seen = [task_id], {task_id}
    while todo and len(found) < 1000:
        _, theirs = await records.lineage(store, names, todo.pop(0))
        for d in theirs:
            if d.task_id not in seen and d.state in REPLACED:
                seen.add(d.task_id)
                found.append(d)
                todo.append(d.task_id)
    found.sort(key=lambda d: (d.at_ms, d.task_id))
    per_key: dict[str, list[str]] = {}
    for d in found:
        per_key.setdefault(d.key, []).append(d.task_id)
    kept: dict[str, str] = {}
    for key, ids in per_key.items():
        kept |= await records.definitions(store, key, ids)
    return [
        {
            "taskId": d.task_id,
            "runId": d.run,
            "task": orjson.loads(kept[d.task_id]) if d.task_id in kept else None,
        }
        for d in found
    ]


async def stats(store: Store, policy: Policy | None) -> list[dict[str, Any]]:
    """Per deciding key and rule (:func:`deciding_keys`): tasks superseded, canceled,
    released, and the worker time saved (estimated from the key's recent run durations)."""
    names = await deciding_keys(store, policy)
    out = []
    for key, counts in (await records.counters(store, names)).items():
        per_rule: dict[str, dict[str, int]] = {}
        for field, n in counts.items():
            rule, _, what = field.rpartition("|")
            per_rule.setdefault(rule, {})[what] = n
        for rule, c in sorted(per_rule.items()):
            row: dict[str, Any] = {"key": key, "rule": rule}
            row |= {k: v for k, v in c.items() if k != "saved_ms"}
            row["savedMs"] = int(c.get("saved_ms", 0))
            out.append(row)
    return out
