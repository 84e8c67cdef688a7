"""The history rings behind the pages' charts (:mod:`coalescer.history`): one over every key
(``{co:keys}:history``) and one per key (``co:{K}:hist``, in the key's hash slot), each written
by ``history.lua`` in one call.

Nothing here is on the query path: counts ride along with writes the service does anyway
(:meth:`~coalescer.store.Store.count` at ingest, :meth:`~coalescer.store.Store.remember_answers`
when the answers are flushed), and the pending samples with the background upkeep's census.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from coalescer import history
from coalescer.history import Retention, Slot
from coalescer.store import keys
from coalescer.store.base import Pipelining

#: ``(series, bucket start ms, 'add' | 'set', value)``
Update = tuple[str, int, str, float]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queue(
    store: Pipelining, pipe: Any, ring: str, updates: Iterable[Update], retention: Retention
) -> None:
    """Queue one ``history.lua`` call on ``pipe`` for ``updates`` of ``ring``."""
    args = [a for update in updates for a in update]
    if args:
        store.eval(
            pipe,
            "history",
            (ring,),
            retention.buckets,
            retention.bucket_ms,
            retention.span_ms,
            *args,
        )


def added(counts: Mapping[Slot, int]) -> list[Update]:
    """Counts of a :class:`~coalescer.history.Tally` as updates that add to the buckets."""
    return [(series, start, "add", n) for (series, start), n in sorted(counts.items())]


async def sample_pending(
    store: Pipelining,
    retention: Retention,
    *,
    now_ms: int,
    per_key: Sequence[tuple[str, int]] = (),
    total: int | None = None,
) -> None:
    """Record pending counts sampled at ``now_ms``: per key (in the keys' coarser rings,
    :meth:`~coalescer.history.Retention.per_key`), and over every key, in one round trip (one
    script call per key: each key's ring lives in the key's slot)."""
    keyed = retention.per_key()

    def fill(pipe: Any) -> None:
        for key, pending in per_key:
            update = (history.PENDING, keyed.start(now_ms), "set", pending)
            queue(store, pipe, keys.history(key), [update], keyed)
        if total is not None:
            update = (history.PENDING, retention.start(now_ms), "set", total)
            queue(store, pipe, keys.HISTORY, [update], retention)

    if per_key or total is not None:
        await store.pipeline(fill)


async def read(
    store: Pipelining, retention: Retention, *, now_ms: int, key: str | None = None
) -> dict[str, history.Series]:
    """The history over every key (``key`` None) or of one key (pending tasks only, in
    coarser buckets), from its oldest bucket kept (at most the retention) to now."""
    ring = keys.HISTORY if key is None else keys.history(key)
    if key is not None:
        retention = retention.per_key()
    (raw,) = await store.pipeline(lambda pipe: pipe.hgetall(ring))
    fields = {_text(k): _text(v) for k, v in raw.items()}
    first = history.first_activity(fields)
    since = now_ms - max(history.SHOWN_AT_LEAST_MS, retention.bucket_ms)
    if first is not None:
        since = min(since, first)
    return history.decode(fields, retention, now_ms=now_ms, since_ms=since)
