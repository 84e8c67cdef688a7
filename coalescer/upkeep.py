"""The index's upkeep, in the background of the web process: forget keys whose tasks have all
expired, and count the totals that ``/metrics`` and ``/v1/stats`` show.

Both walk the key set in bounded steps (:data:`coalescer.keyset.STEP` keys, one round trip
each), so no request ever pays for every key. One process at a time does a round (a lease in
Redis); every process reads the totals the last round saved.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from coalescer import keyset
from coalescer.errors import StoreUnavailable
from coalescer.store import Store, views
from coalescer.store import keyset as stored

log = logging.getLogger(__name__)

#: Seconds between upkeep rounds; the longest wait after a store error.
EVERY = 15.0
MAX_BACKOFF = 300.0
#: Seconds between the steps of a round, so that a large index is walked gently.
PAUSE = 0.02


def _now_ms() -> int:
    return int(time.time() * 1000)


async def sweep(store: Store, *, now_ms: int | None = None, step: int = keyset.STEP) -> int:
    """Forget every key whose data has expired; how many were forgotten."""
    forgotten = 0
    while True:
        gone, kept = await stored.sweep(store, now_ms=now_ms or _now_ms(), limit=step)
        forgotten += gone
        _stop_if_cancelled()
        if gone + kept < step:  # the last batch, or keys that changed meanwhile: next round
            return forgotten


async def count(
    store: Store, *, now_ms: int | None = None, step: int = keyset.STEP, pause: float = 0.0
) -> keyset.Tally:
    """Count the index's totals over every key, step by step, and save them for every
    process to read (:func:`coalescer.store.keyset.totals`)."""
    started = now_ms or _now_ms()
    backfill = await stored.unexpiring(store)
    tally = keyset.Tally()
    at = 0
    while True:
        at, listed = await stored.scan(store, at, count=step, backfill=backfill)
        for s in await views.summaries(store, listed, now_ms=now_ms or _now_ms()):
            tally.add(s.pending, s.oldest_since_ms)
        if at == 0:
            break
        _stop_if_cancelled()
        if pause:
            await asyncio.sleep(pause)
    await stored.save_census(store, tally, started)
    return tally


async def keep_index(store: Store, *, every: float = EVERY) -> None:
    """Upkeep rounds every ``every`` seconds, forever; a store error is logged and the next
    round waits longer (up to :data:`MAX_BACKOFF`)."""
    token = uuid.uuid4().hex
    wait = every
    while True:
        try:
            if await stored.hold(store, token, int(every * 2000)):
                forgotten = await sweep(store)
                if forgotten:
                    log.info("forgot %d coalescing keys whose tasks have all expired", forgotten)
                await count(store, pause=PAUSE)
            wait = every
        except StoreUnavailable as exc:
            wait = min(wait * 2, MAX_BACKOFF)
            log.warning("index upkeep failed, next try in %.0f s: %s", wait, exc)
        _stop_if_cancelled()
        await asyncio.sleep(wait)


def _stop_if_cancelled() -> None:
    """Stop if cancelled: a cancellation that arrives while redis-py runs a command can be
    lost (the command completes), and this loop would then sleep and go on for ever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
