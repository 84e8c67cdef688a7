"""Bisections the superseding side ran when a primary failed: which held push was the first to
fail (the culprit), which was the last good one, and every run the search took. Recorded per
coalescing key by whoever ran the search (the enforcer directly; a worker through
``POST /v1/bisections``), read by the API, the pages and the metrics.

A finding is a JSON object (camelCase, as the HTTP API answers it)::

    {"key": K, "by": "worker g/w",
     "primary": {"taskId", "runId"}, "held": 8,
     "culprit": {"taskId", "runId"} | null, "lastGood": {"taskId", "runId"} | null,
     "runs": [{"taskId", "runId", "attempt", "passed": bool, "ended": ISO 8601}],
     "intermittent": [{"taskId", "runId"}],
     "standsFor": [{"taskId", "runId", "by": {"taskId", "runId"}}],
     "extraRuns": 4, "located": ISO 8601,
     "tasks": [every taskId named above]}

``tasks`` is what :func:`for_task` looks findings up by. Writes are one ``bisect.lua`` call
(atomic, idempotent: the same finding again changes nothing); at most :data:`KEEP` findings per
key are kept, for :data:`TTL_MS` after the newest. Every finding recorded is also counted in
``co:findings`` until it expires, so that the findings over every key stay within a limit
(``COALESCER_MAX_FINDINGS``, :func:`room`), as the index's keys and tasks do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from coalescer.store import keys
from coalescer.store.base import Pipelining

#: Findings kept per key (the newest).
KEEP = 200
#: How long a key's findings are kept after its newest one.
TTL_MS = 30 * 24 * 3600 * 1000


def named_tasks(finding: Mapping[str, Any]) -> list[str]:
    """Every taskId a finding names, in a stable order without repeats."""
    refs: list[Any] = [finding.get(name) for name in ("primary", "culprit", "suspect", "lastGood")]
    refs += list(finding.get("runs") or []) + list(finding.get("intermittent") or [])
    for stand in finding.get("standsFor") or []:
        refs += [stand, stand.get("by")]
    seen: dict[str, None] = {}
    for ref in refs:
        if isinstance(ref, Mapping) and isinstance(ref.get("taskId"), str):
            seen[ref["taskId"]] = None
    return list(seen)


async def record(store: Pipelining, finding: Mapping[str, Any], located_ms: int) -> bool:
    """Record ``finding`` (see the module docstring) under its ``key``; False when the same
    finding was recorded already (a retry)."""
    tasks = named_tasks(finding)
    body = orjson.dumps({**finding, "tasks": tasks})
    primary = finding["primary"]["taskId"]
    until = int(time.time() * 1000) + TTL_MS

    def fill(pipe: Any) -> None:
        store.eval(
            pipe,
            "bisect",
            keys.bisections(finding["key"]),
            primary,
            located_ms,
            body,
            TTL_MS,
            KEEP,
            *tasks,
        )
        pipe.zadd(keys.FINDINGS, {_member(finding): until})

    new, _ = await store.pipeline(fill)
    return bool(new)


def _member(finding: Mapping[str, Any]) -> str:
    return f"{finding['key']} {finding['primary']['taskId']}"


async def room(store: Pipelining, finding: Mapping[str, Any], *, limit: int, now_ms: int) -> bool:
    """Whether ``finding`` may be recorded under a limit of ``limit`` findings over every key:
    yes when fewer are kept (those expired are dropped first), or when it is one of them again
    (a retry). Processes recording at once at the edge can pass the limit by one each."""
    _, kept, again = await store.pipeline(
        lambda pipe: (
            pipe.zremrangebyscore(keys.FINDINGS, "-inf", now_ms),
            pipe.zcard(keys.FINDINGS),
            pipe.zscore(keys.FINDINGS, _member(finding)),
        )
    )
    return again is not None or int(kept) < limit


async def kept(store: Pipelining, *, now_ms: int) -> int:
    """How many findings are kept over every key (those not expired)."""
    (count,) = await store.pipeline(lambda pipe: pipe.zcount(keys.FINDINGS, f"({now_ms}", "+inf"))
    return int(count)


async def for_task(store: Pipelining, names: Sequence[str], task_id: str) -> list[dict[str, Any]]:
    """The findings that name ``task_id`` under the keys ``names`` (one round trip)."""
    if not names:
        return []
    (*primaries,) = await store.pipeline(
        lambda pipe: [pipe.hget(keys.bisections(k)[0], "t:" + task_id) for k in names]
    )
    wanted = [(k, _text(p)) for k, p in zip(names, primaries, strict=True) if p is not None]
    if not wanted:
        return []
    raw = await store.pipeline(
        lambda pipe: [pipe.hget(keys.bisections(k)[0], p) for k, p in wanted]
    )
    return [orjson.loads(r) for r in raw if r is not None]


async def recent(store: Pipelining, key: str, limit: int = 20) -> list[dict[str, Any]]:
    """The key's newest findings, newest first."""
    b, bt = keys.bisections(key)
    (primaries,) = await store.pipeline(lambda pipe: pipe.zrevrange(bt, 0, limit - 1))
    if not primaries:
        return []
    raw = await store.pipeline(lambda pipe: [pipe.hget(b, _text(p)) for p in primaries])
    return [orjson.loads(r) for r in raw if r is not None]


#: Where a page of a key's findings ends: the last one's ``(located_ms, primary)``.
Cursor = tuple[int, str]


async def page(
    store: Pipelining, key: str, *, limit: int, after: Cursor | None = None
) -> tuple[list[dict[str, Any]], Cursor | None]:
    """Up to ``limit`` of the key's findings, newest first (by ``located``, then by primary
    taskId, descending), from after ``after``; and the cursor of the next page (``None``: this
    one is the last). Findings recorded meanwhile do not shift a page: the cursor is a place in
    the order, not a count."""
    b, bt = keys.bisections(key)
    if after is None:
        (listed,) = await store.pipeline(
            lambda pipe: pipe.zrevrangebyscore(
                bt, "+inf", "-inf", start=0, num=limit + 1, withscores=True
            )
        )
    else:
        at, primary = after
        ties, older = await store.pipeline(
            lambda pipe: (
                pipe.zrevrangebyscore(bt, at, at, withscores=True),
                pipe.zrevrangebyscore(
                    bt, f"({at}", "-inf", start=0, num=limit + 1, withscores=True
                ),
            )
        )
        listed = [(m, sc) for m, sc in ties if _text(m) < primary] + list(older)
    entries = [(_text(m), int(sc)) for m, sc in listed[: limit + 1]]
    more = len(entries) > limit
    entries = entries[:limit]
    if not entries:
        return [], None
    (raw,) = await store.pipeline(lambda pipe: pipe.hmget(b, [m for m, _ in entries]))
    found = [orjson.loads(r) for r in raw if r is not None]
    last_primary, last_at = entries[-1]
    return found, (last_at, last_primary) if more else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
