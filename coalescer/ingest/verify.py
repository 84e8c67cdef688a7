"""Events applied after the store was emptied, checked against the queue.

Versions order a task's events only while the index holds the task's record. After the store
was emptied (Redis restarted without persistence, a flush), a run's state captured before the
run ended (a Pulse message one consumer held while the store was down or full, delivered after
another consumer had applied the run's end to the lost index; a message delivered again after a
broker cut) would be taken as the task's state, and the rebuild, which lists only what is live,
would never correct it: the task would read ``running`` at a run the queue ended, until
``coalescer reconcile``.

So, with a queue to ask (``TASKCLUSTER_ROOT_URL``), every event applied whose run was scheduled
before the index's marker time (the store's last emptying, or its start: ``marker.lua``) is
checked: the task's status is read from the queue (the reconcile's fetcher, in bulk) and
applied as reconcile applies it, at the order the event gave. A newer state wins by its
version; the same state changes nothing. The marker is read after the events were applied: an
emptying found only then dates the marker now, so nothing applied before it escapes the check.
Runs scheduled since the marker's time were seen whole by this store: they cost one marker
read per batch and nothing more.

Whatever goes wrong with the queue (slow, down, not knowing the task) the events stay applied
as they came, which is what the index holds without this check, and the log says why; a store
that is unavailable is the caller's to wait for, as it waits to apply events. A queue
that does not answer within :data:`TIMEOUT` is not asked again for :data:`PAUSE` seconds, so
that a queue outage does not slow ingestion down batch after batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from taskcluster.exceptions import TaskclusterFailure

from coalescer.errors import InvalidEvent
from coalescer.ingest.events import status_event
from coalescer.ingest.reconcile import StatusFetcher, queue_fetcher, queue_session
from coalescer.logs import Throttled
from coalescer.model import TaskEvent

if TYPE_CHECKING:
    from coalescer.policy.rules import Policy
    from coalescer.settings import Settings
    from coalescer.store import Store
    from coalescer.store.census import Limits

log = logging.getLogger(__name__)

MAX_RETRIES = 2
#: Seconds a check waits for the queue's statuses.
TIMEOUT = 10.0
#: Seconds without checks after one failed.
PAUSE = 60.0


def suspects(events: Sequence[TaskEvent], since_ms: int) -> dict[str, TaskEvent]:
    """The events to check, by task (its last in ``events``): those whose run was scheduled
    before ``since_ms``, the index marker's time."""
    return {e.task_id: e for e in events if e.pending_since_ms < since_ms}


def corrections(
    found: Mapping[str, TaskEvent], statuses: Mapping[str, Mapping[str, Any]]
) -> list[TaskEvent]:
    """The queue's state of each task in ``found`` whose status is newer than its event, under
    the event's keys and at its order."""
    out = []
    for task_id, event in found.items():
        status = statuses.get(task_id)
        if status is None:  # expired, or unknown to the queue: nothing to say
            continue
        try:
            queued = status_event(status, event.keys, order=event.order)
        except InvalidEvent as exc:
            log.warning("could not check task %s against the queue: %s", task_id, exc)
            continue
        if queued is not None and queued.version > event.version:
            out.append(queued)
    return out


class Verifier:
    """Checks applied events against the queue (the module's doc); ``fetch`` reads statuses."""

    def __init__(
        self,
        store: Store,
        fetch: StatusFetcher,
        *,
        policy: Policy | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.store, self.fetch, self.policy = store, fetch, policy
        self._session = session
        self._failed = Throttled(log, PAUSE)
        self._paused_until = 0.0

    @classmethod
    def from_settings(cls, settings: Settings, store: Store) -> Verifier | None:
        """A verifier on the queue at ``TASKCLUSTER_ROOT_URL`` (None when unset). Call from a
        running event loop."""
        if settings.taskcluster_root_url is None:
            return None
        queue, session = queue_session(settings.taskcluster_root_url, max_retries=MAX_RETRIES)
        return cls(store, queue_fetcher(queue), policy=settings.policy, session=session)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def check(self, applied: Sequence[TaskEvent], *, limits: Limits | None = None) -> int:
        """Check events just applied; how many tasks the queue's state corrected. Raises
        :class:`~coalescer.errors.StoreUnavailable` when the store cannot be read or written:
        the caller holds and retries the check as it holds events."""
        if not applied or time.monotonic() < self._paused_until:
            return 0
        try:
            marker = await self.store.index_state(int(time.time() * 1000))
            found = suspects(applied, marker.since_ms)
            if not found:
                return 0
            statuses = await asyncio.wait_for(self.fetch(list(found)), TIMEOUT)
            fixed = corrections(found, statuses)
            if not fixed:
                return 0
            outcomes = await self.store.apply(fixed, policy=self.policy, limits=limits)
        except (TaskclusterFailure, aiohttp.ClientError, TimeoutError) as exc:
            self._paused_until = time.monotonic() + PAUSE
            self._failed.log(
                logging.WARNING,
                "could not check events of runs scheduled before the store was emptied against "
                "the queue; they stay as they came (`coalescer reconcile` corrects them), and "
                "none is checked for %.0f s: %s",
                PAUSE,
                exc if str(exc) else type(exc).__name__,
            )
            return 0
        n = sum(1 for o in outcomes if o == "applied")
        if n:
            log.info(
                "%d tasks corrected from the queue: an event of a run scheduled before the "
                "store was emptied said less than the queue (e.g. %s)",
                n,
                fixed[0].task_id,
            )
        return n
