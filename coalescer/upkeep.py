"""The index's upkeep, in the background of the web process: forget keys whose tasks have all
expired, and count the totals that ``/metrics`` and ``/v1/stats`` show (and sample them for the
pages' charts).

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
from coalescer.history import Retention, Sampler
from coalescer.store import Store, views
from coalescer.store import history as stored_history
from coalescer.store import keyset as stored

log = logging.getLogger(__name__)

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
    store: Store,
    *,
    now_ms: int | None = None,
    step: int = keyset.STEP,
    pause: float = 0.0,
    retention: Retention | None = None,
    sampler: Sampler | None = None,
) -> keyset.Tally:
    """Count the index's totals over every key, step by step, and save them for every
    process to read (:func:`coalescer.store.keyset.totals`); with a ``retention``, also as
    samples of the pending tasks over time, per key and over every key (the pages' charts)."""
    started = now_ms or _now_ms()
    backfill = await stored.unexpiring(store)
    tally = keyset.Tally()
    at = 0
    while True:
        at, listed = await stored.scan(store, at, count=step, backfill=backfill)
        summaries = await views.summaries(store, listed, now_ms=now_ms or _now_ms(), tracked=True)
        for s in summaries:
            tally.add(s.pending, s.oldest_since_ms)
            tally.tracked += s.tracked
        if retention is not None:
            samples = [(s.key, s.pending) for s in summaries]
            if sampler is not None:  # only what changed
                samples = sampler.due(samples, started)
            if samples:
                await stored_history.sample_pending(
                    store, retention, now_ms=started, per_key=samples
                )
                if sampler is not None:
                    sampler.wrote(samples, started)
        if at == 0:
            break
        _stop_if_cancelled()
        if pause:
            await asyncio.sleep(pause)
    await stored.save_census(store, tally, started)
    if retention is not None:
        await stored_history.sample_pending(store, retention, now_ms=started, total=tally.pending)
    if sampler is not None:
        sampler.done()
    return tally


def rounds(
    store: Store, *, every: float, retention: Retention | None = None
) -> Callable[[], Awaitable[None]]:
    """One upkeep round per call, for the web process's supervisor to run every ``every``
    seconds (``COALESCER_UPKEEP_SECONDS``; it retries a round that failed, later and later). A round is done by the process
    holding the upkeep lease, which it keeps while it does rounds. With a ``retention``, each
    round also samples the pending tasks for the pages' charts."""
    token = uuid.uuid4().hex
    sampler = None if retention is None else Sampler(retention.per_key())

    async def one_round() -> None:
        if await stored.hold(store, token, int(every * 2000)):
            forgotten = await sweep(store)
            if forgotten:
                log.info("forgot %d coalescing keys whose tasks have all expired", forgotten)
            await count(store, pause=PAUSE, retention=retention, sampler=sampler)
        _stop_if_cancelled()

    return one_round


def _stop_if_cancelled() -> None:
    """Stop if cancelled: a cancellation that arrives while redis-py runs a command can be
    lost (the command completes), and the round would go on, and the next one."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
