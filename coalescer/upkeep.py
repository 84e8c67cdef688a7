"""The index's upkeep, in the background of the web process: forget keys whose tasks have all
expired, and count the totals that ``/metrics`` and ``/v1/stats`` show.

Both walk the key set in bounded steps (:data:`coalescer.keyset.STEP` keys, one round trip
each), so no request ever pays for every key. One process at a time does the rounds (a lease
in Redis); every process reads the totals the last round saved.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from coalescer import keyset
from coalescer.store import Store, views
from coalescer.store import keyset as stored

log = logging.getLogger(__name__)

#: Seconds between upkeep rounds.
EVERY = 15.0
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


def rounds(store: Store, *, every: float = EVERY) -> Callable[[], Awaitable[None]]:
    """One upkeep round per call, for the web process's supervisor to run every ``every``
    seconds (it retries a round that failed, later and later). A round is done by the process
    holding the upkeep lease, which it keeps while it does rounds."""
    token = uuid.uuid4().hex

    async def one_round() -> None:
        if await stored.hold(store, token, int(every * 2000)):
            forgotten = await sweep(store)
            if forgotten:
                log.info("forgot %d coalescing keys whose tasks have all expired", forgotten)
            await count(store, pause=PAUSE)
        _stop_if_cancelled()

    return one_round


def _stop_if_cancelled() -> None:
    """Stop if cancelled: a cancellation that arrives while redis-py runs a command can be
    lost (the command completes), and the round would go on, and the next one."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
