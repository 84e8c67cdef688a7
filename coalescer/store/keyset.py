"""The key set in Redis: sweeping out expired keys, counting totals, pages of keys.

``co:keys`` (key → last activity) and ``{co:keys}:expiry`` (key → when its data expires) share
one hash slot, so ``list.lua`` (on every write, see :meth:`Store.apply`) and ``unlist.lua``
keep them in step. A key's own data lives in its own slot: the sweeper reads it in one round
trip, then forgets the key with a check that no newer task arrived meanwhile. Decisions are in
:mod:`coalescer.keyset`; each function here is one or two round trips on a bounded batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from coalescer import keyset
from coalescer.store import keys, views
from coalescer.store.census import Limits

if TYPE_CHECKING:
    from coalescer.store.redis import Store

Listed = list[tuple[str, int]]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _listed(raw: list[Any]) -> Listed:
    return [(_text(k), int(score)) for k, score in raw]


async def sweep(store: Store, *, now_ms: int, limit: int = keyset.STEP) -> tuple[int, int]:
    """Forget up to ``limit`` keys whose data has expired by ``now_ms``: ``(forgotten, kept)``.
    A key found to hold a live task after all (listed before expiry times were kept) is kept
    with its real expiry time. A key that got a task since it was read is neither."""
    (due,) = await store.pipeline(
        lambda pipe: pipe.zrangebyscore(
            keys.KEYS_EXPIRY, "-inf", now_ms, start=0, num=limit, withscores=True
        )
    )
    if not due:
        return 0, 0
    listed = _listed(due)
    newest = await store.pipeline(
        lambda pipe: [pipe.zrange(keys.group(key)[4], -1, -1, withscores=True) for key, _ in listed]
    )

    gone = [
        keyset.outlived(int(found[0][1]) if found else None, now_ms=now_ms, grace_ms=store.grace_ms)
        for found in newest
    ]

    def fill(pipe: Any) -> None:
        for (key, seen), found, out in zip(listed, newest, gone, strict=True):
            if out:
                store.eval(pipe, "unlist", (keys.KEYS_INDEX, keys.KEYS_EXPIRY), key, seen)
            else:
                expires = keyset.expires_ms(int(found[0][1]), store.grace_ms)
                pipe.zadd(keys.KEYS_EXPIRY, {key: expires}, gt=True)

    replies = await store.pipeline(fill)
    forgotten = sum(int(r) for r, out in zip(replies, gone, strict=True) if out)
    return forgotten, gone.count(False)


async def hold(store: Store, token: str, ttl_ms: int) -> bool:
    """Take (or keep) the upkeep lease for ``ttl_ms``: one process at a time does the rounds."""
    _, holder = await store.pipeline(
        lambda pipe: (
            pipe.set(keys.UPKEEP_LEASE, token, nx=True, px=ttl_ms),
            pipe.get(keys.UPKEEP_LEASE),
        )
    )
    if holder is None or _text(holder) != token:
        return False
    await store.pipeline(lambda pipe: pipe.pexpire(keys.UPKEEP_LEASE, ttl_ms))
    return True


async def unexpiring(store: Store) -> bool:
    """Whether some keys have no expiry time (listed before expiry times were kept)."""
    known, expiring = await store.pipeline(
        lambda pipe: (pipe.zcard(keys.KEYS_INDEX), pipe.zcard(keys.KEYS_EXPIRY))
    )
    return int(known) > int(expiring)


async def scan(
    store: Store, at: int, *, count: int = keyset.STEP, backfill: bool = False
) -> tuple[int, Listed]:
    """One step through ``co:keys`` from cursor ``at``: ``(next cursor (0: done), keys)``.
    With ``backfill``, keys without an expiry time get their last activity as one, so that
    the sweeper looks at them (and learns their real one)."""
    ((after, raw),) = await store.pipeline(
        lambda pipe: pipe.zscan(keys.KEYS_INDEX, at, count=count)
    )
    listed = _listed(raw)
    if backfill and listed:
        await store.pipeline(lambda pipe: pipe.zadd(keys.KEYS_EXPIRY, dict(listed), nx=True))
    return int(after), listed


async def save_census(store: Store, tally: keyset.Tally, counted_ms: int) -> None:
    record = {
        "with_pending": tally.with_pending,
        "pending": tally.pending,
        "oldest_since_ms": "" if tally.oldest_since_ms is None else tally.oldest_since_ms,
        "counted_ms": counted_ms,
        # Tasks ingest added since are counted from here on (census.py).
        "tracked": tally.tracked,
        "added": 0,
    }
    await store.pipeline(lambda pipe: pipe.hset(keys.CENSUS, mapping=record))


async def size(store: Store) -> tuple[int, int, Limits | None]:
    """Keys listed, tasks tracked (as last counted plus what ingest added since), and the
    limits ingest was last held to (``None``: none yet), in one round trip; also noted in the
    store's :attr:`~coalescer.store.Store.census`."""
    known, (tracked, added, max_keys, max_tasks) = await store.pipeline(
        lambda pipe: (
            pipe.zcard(keys.KEYS_INDEX),
            pipe.hmget(keys.CENSUS, ["tracked", "added", "max_keys", "max_tasks"]),
        )
    )
    tasks = int(tracked or 0) + int(added or 0)
    limits = Limits(int(max_keys), int(max_tasks)) if max_keys and max_tasks else None
    store.census.seen(int(known), tasks, limits)
    return int(known), tasks, limits


async def totals(store: Store, *, now_ms: int | None = None) -> keyset.Totals:
    """The index's totals: counted now for a small index, else as the last upkeep round
    counted them (not counted before the first round)."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    known, record = await store.pipeline(
        lambda pipe: (pipe.zcard(keys.KEYS_INDEX), pipe.hgetall(keys.CENSUS))
    )
    known = int(known)
    if known <= keyset.COUNT_INLINE:
        listed, _ = await recent(store, 0, keyset.COUNT_INLINE - 1)
        tally = keyset.Tally()
        for s in await views.summaries(store, listed, now_ms=now):
            tally.add(s.pending, s.oldest_since_ms)
        return keyset.Totals(known, now, tally.with_pending, tally.pending, tally.oldest_since_ms)
    fields = {_text(k): _text(v) for k, v in record.items()}
    if "counted_ms" not in fields:
        return keyset.Totals(known)
    oldest = fields["oldest_since_ms"]
    return keyset.Totals(
        known,
        int(fields["counted_ms"]),
        int(fields["with_pending"]),
        int(fields["pending"]),
        int(oldest) if oldest else None,
    )


async def recent(store: Store, start: int, stop: int) -> tuple[Listed, int]:
    """Keys ranked ``start``..``stop`` by last activity, most recent first, and how many keys
    are known, in one round trip."""
    raw, known = await store.pipeline(
        lambda pipe: (
            pipe.zrevrange(keys.KEYS_INDEX, start, stop, withscores=True),
            pipe.zcard(keys.KEYS_INDEX),
        )
    )
    return _listed(raw), int(known)


async def search(
    store: Store, wanted: Callable[[str], bool], at: int, *, budget: int = keyset.SEARCH_BUDGET
) -> tuple[Listed, int]:
    """Keys ``wanted`` among about ``budget`` keys from cursor ``at`` (in no particular order),
    and the cursor to go on from (0: every key has been examined)."""
    found: Listed = []
    examined = 0
    while True:
        at, listed = await scan(store, at, count=min(keyset.STEP, budget))
        examined += len(listed)
        found += [(k, a) for k, a in listed if wanted(k)]
        if at == 0 or examined >= budget:
            return found, at
