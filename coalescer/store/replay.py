"""The store's side of ``coalescer replay``: events and a question in one round trip, and a
replay's keys deleted when it is done.

A replay asks the index once for every task a modelled worker claims, after telling it what
happened since the last question. Both go in one round trip: ``apply.lua`` for every key's
events, then ``snapshot.lua`` for the asked key, the very scripts the service runs. The pages'
logs (recent answers and resolutions) that :meth:`Store.apply` also keeps are not written: a
replay's keys are never shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coalescer import model
from coalescer.store import keys
from coalescer.store.pipelined import NoScript, ReplyError
from coalescer.store.redis import (
    Store,
    apply_args,
    apply_calls,
    apply_keys,
    by_key,
    decode_snapshot,
)


async def holds_nothing(store: Store) -> bool:
    """Whether the store's database holds no key at all (a scratch database)."""
    (size,) = await store.pipeline(lambda pipe: pipe.dbsize())
    return int(size) == 0


async def drop(store: Store, names: Sequence[str]) -> None:
    """Delete everything held for coalescing keys ``names`` (their index, logs and policy
    data), and unlist them, in one round trip."""

    def fill(pipe: Any) -> None:
        for key in names:
            pipe.delete(
                *keys.group(key),
                keys.log(key),
                keys.resolutions(key),
                *keys.answered(key),
                *keys.settled(key),
                *keys.policy(key)[3:5],
                *keys.bisections(key),
                keys.lease(key),
            )
        pipe.zrem(keys.KEYS_INDEX, *names)
        pipe.zrem(keys.KEYS_EXPIRY, *names)
        pipe.zrem(keys.OUTBOX, *names)

    if names:
        await store.pipeline(fill)


async def drop_census(store: Store) -> None:
    """Delete the index's size count (a scratch database's, once a policy replay is done)."""
    await store.pipeline(lambda pipe: pipe.delete(keys.CENSUS))


async def apply_and_ask(
    store: Store,
    events: Sequence[model.TaskEvent],
    key: str,
    initial: str,
    *,
    now_ms: int,
    cap: int,
) -> model.KeySnapshot:
    """Apply ``events`` (every key of each), then read ``key``'s snapshot for ``initial``."""
    calls = [
        (apply_keys(k), apply_args([events[i] for i in indexes], now_ms, store.grace_ms, 0))
        for k, indexes in apply_calls(by_key(events))
    ]
    t, p, w, d, _ = keys.group(key)
    read = ("snapshot", (t, p, w, d), (initial, now_ms, cap))
    try:
        # Commands on one connection run in the order sent: the applies before the read.
        sent = store.send_in_order([*(("apply", names, args) for names, args in calls), read])
        if sent is not None:
            *applied, asked = sent
            for reply in applied:
                await reply
            return decode_snapshot(await asked)
    except (NoScript, ReplyError):
        pass  # redis-py reloads the scripts, or raises the real error; applying is idempotent

    def fill(pipe: Any) -> None:
        for names, args in calls:
            store.eval(pipe, "apply", names, *args)
        store.eval(pipe, "snapshot", (t, p, w, d), initial, now_ms, cap)

    replies = await store.pipeline(fill)
    return decode_snapshot(replies[-1])
