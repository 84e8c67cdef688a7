"""Learning a task the index does not know yet from the queue (event lag).

A worker may ask about its task before the task's Pulse events have reached the index. Then,
rather than answer ``[ID]`` alone, the service can ask the queue (``TASKCLUSTER_ROOT_URL``) for
the task's definition (routes, tags) and ``status``, turn them into an index event as a Pulse
message or reconcile would (:func:`~coalescer.ingest.events.status_event`), apply it through the
store's ordinary write path and read the key again. Versions make the application idempotent:
a Pulse event racing it, before or after, changes nothing.

Whatever goes wrong (the queue slow, down or not knowing the task, an answer failing its
schema, the task not under the queried key) the query is answered as without this, ``[ID]``
alone, and the log says why: never a wrong answer. Concurrent queries for one task share one
lookup, and the lookups in flight are bounded.

:func:`learned_event` and :func:`outcome_for` decide; :class:`Learner` does the IO around them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client import Counter
from taskcluster.exceptions import TaskclusterFailure, TaskclusterRestFailure

from coalescer import model
from coalescer.errors import InvalidEvent, StoreUnavailable
from coalescer.ingest import validation
from coalescer.ingest.events import status_event
from coalescer.ingest.reconcile import queue_session

if TYPE_CHECKING:
    from coalescer.policy.rules import Policy
    from coalescer.settings import Settings
    from coalescer.store import Store

log = logging.getLogger(__name__)

LEARN = Counter(
    "coalescer_learn",
    "Superseding queries for a task the index did not know, by what asking the queue gave: "
    "learned, not-under-key, unscheduled, expired, not-found, invalid, timeout, failed",
    ["outcome"],
)
LOOKUPS = Counter(
    "coalescer_learn_lookups",
    "Queue lookups (task definition and status) for unknown tasks; concurrent queries for one "
    "task share one",
)

#: Lookups in flight at most, over every task: the queue is asked in bursts at worst.
MAX_LOOKUPS = 8
#: The client retries connection errors and 5xx this often, within the timeout.
MAX_RETRIES = 2
#: Outcomes after which the index knows the task (under its own keys).
_KNOWN = frozenset(("learned", "unscheduled", "expired"))


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup:
    """What one lookup gave, for every query sharing it: an outcome, the task's coalescing
    keys (when the queue answered) and, for the log, why."""

    outcome: str
    keys: tuple[str, ...] = ()
    detail: str = ""


def learned_event(
    task_id: str,
    definition: Any,
    status: Any,
    *,
    prefix: str,
    rank_tag: str | None = None,
) -> tuple[tuple[str, ...], model.TaskEvent | None]:
    """The coalescing keys of a task and its index event, from the queue's ``task`` (definition)
    and ``status`` answers; the event is ``None`` when the task has no run yet.

    Raises :class:`InvalidEvent` when an answer fails its schema or cannot be indexed.
    """
    for schema, body in (("task", definition), ("task-status-response", status)):
        problems = validation.errors(schema, body)
        if problems:
            raise InvalidEvent(
                f"the queue's {schema} answer fails its schema: " + "; ".join(problems)
            )
    if status["status"]["taskId"] != task_id:
        raise InvalidEvent(f"the queue answered the status of {status['status']['taskId']}")
    keys = model.keys_from_routes(definition.get("routes", []), prefix)
    if not keys:
        return keys, None
    tags = definition.get("tags") or {}
    return keys, status_event(status["status"], keys, tags=tags, rank_tag=rank_tag)


def outcome_for(lookup: Lookup, key: str) -> str:
    """The outcome of one query on ``key`` sharing ``lookup``."""
    if lookup.outcome in _KNOWN and key not in lookup.keys:
        return "not-under-key"
    return lookup.outcome


class Learner:
    """Asks the queue about tasks the index does not know, and applies what it says.

    ``queue`` is a ``taskcluster.aio.Queue``; :meth:`from_settings` builds one, with its own
    HTTP session, closed by :meth:`close`.
    """

    def __init__(
        self,
        store: Store,
        queue: Any,
        *,
        prefix: str,
        rank_tag: str | None = None,
        policy: Policy | None = None,
        timeout: float = 2.0,
        lookups: int = MAX_LOOKUPS,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.prefix = prefix
        self.rank_tag = rank_tag
        self.policy = policy
        self.timeout = timeout
        self._slots = asyncio.Semaphore(lookups)
        self._session = session
        self._flights: dict[str, _Flight] = {}  # by taskId

    @classmethod
    def from_settings(cls, settings: Settings, store: Store) -> Learner | None:
        """A learner on the queue at ``TASKCLUSTER_ROOT_URL``; ``None`` when that is unset or
        ``COALESCER_LEARN_UNKNOWN`` is false. Call from a running event loop."""
        if settings.taskcluster_root_url is None or not settings.learn_unknown:
            return None
        queue, session = queue_session(settings.taskcluster_root_url, max_retries=MAX_RETRIES)
        return cls(
            store,
            queue,
            prefix=settings.route_prefix,
            rank_tag=settings.rank_tag,
            policy=settings.policy,
            timeout=settings.learn_timeout,
            session=session,
        )

    async def close(self) -> None:
        """Stop the lookups in flight (their queries answer ``[ID]``) and close the session."""
        flights = [flight.task for flight in self._flights.values()]
        for task in flights:
            task.cancel()
        await asyncio.gather(*flights, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def waiting(self, task_id: str) -> int:
        """How many queries wait on the lookup of ``task_id`` (0: none in flight)."""
        flight = self._flights.get(task_id)
        return flight.waiting if flight else 0

    async def learn(
        self, key: str, task_id: str, now_ms: int, snap: model.KeySnapshot, *, cap: int
    ) -> tuple[int, model.KeySnapshot]:
        """``(now_ms, snap)`` for a query on ``key`` about ``task_id``, which ``snap`` (read at
        ``now_ms``) does not know: read again once the queue's word is applied, else as given.
        """
        lookup = await self._shared(task_id)
        outcome = outcome_for(lookup, key)
        LEARN.labels(outcome).inc()
        extra = {"key": key, "task_id": task_id, "outcome": outcome}
        if outcome != "learned":
            level = logging.WARNING if outcome in ("timeout", "failed") else logging.INFO
            why = (
                f"its coalescing keys are {', '.join(lookup.keys) or 'none'}"
                if outcome == "not-under-key"
                else lookup.detail
            )
            log.log(level, "answering [%s] alone (%s): %s", task_id, outcome, why, extra=extra)
            return now_ms, snap
        log.info("learned task %s of key %s from the queue", task_id, key, extra=extra)
        now_ms = int(time.time() * 1000)
        return now_ms, await self.store.snapshot(key, task_id, now_ms=now_ms, cap=cap)

    async def _shared(self, task_id: str) -> Lookup:
        flight = self._flights.get(task_id)
        if flight is None:
            task = asyncio.create_task(self._lookup(task_id), name=f"learn {task_id}")
            flight = self._flights[task_id] = _Flight(task)
            task.add_done_callback(lambda done: self._landed(task_id, done))
        flight.waiting += 1
        try:
            # Shielded: a query given up (client gone) must not cancel the others' lookup.
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if flight.task.cancelled() and not _cancelling():  # the learner closed, not the query
                return Lookup("failed", detail="the service is stopping")
            raise
        finally:
            flight.waiting -= 1

    def _landed(self, task_id: str, task: asyncio.Task[Lookup]) -> None:
        if task_id in self._flights and self._flights[task_id].task is task:
            del self._flights[task_id]

    async def _lookup(self, task_id: str) -> Lookup:
        """Ask the queue about ``task_id`` and apply its answer; never raises but cancelled."""
        LOOKUPS.inc()
        try:
            async with asyncio.timeout(self.timeout):
                async with self._slots:
                    # Both at once: one round trip's wait; both finish, whatever either does.
                    answers: tuple[Any, ...] = await asyncio.gather(
                        self.queue.task(task_id), self.queue.status(task_id), return_exceptions=True
                    )
            for answer in answers:
                if isinstance(answer, TaskclusterRestFailure) and answer.status_code == 404:
                    return Lookup("not-found", detail="the queue does not know the task")
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            definition, status = answers
            keys, event = learned_event(
                task_id, definition, status, prefix=self.prefix, rank_tag=self.rank_tag
            )
            if event is None:
                return Lookup("unscheduled", keys, detail="no run yet: nothing to index")
            # Held to the limits ingest is held to (the store's census knows them).
            limits = self.store.census.limits
            (applied,) = await self.store.apply([event], policy=self.policy, limits=limits)
        except TimeoutError:
            return Lookup("timeout", detail=f"the queue did not answer in {self.timeout:g} s")
        except InvalidEvent as exc:
            return Lookup("invalid", detail=str(exc))
        except (TaskclusterFailure, aiohttp.ClientError, StoreUnavailable) as exc:
            # The client has retried connection errors and 5xx already.
            return Lookup("failed", detail=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug must cost an answer's quality, never the answer
            log.exception("learning task %s failed", task_id, extra={"task_id": task_id})
            return Lookup("failed", detail=f"{type(exc).__name__}: {exc}")
        if applied == "expired":
            return Lookup("expired", keys, detail="past its deadline and grace: not indexed")
        if applied == "limited":
            return Lookup("limited", keys, detail="the index is at its limits: not indexed")
        return Lookup("learned", keys)


@dataclasses.dataclass(slots=True)
class _Flight:
    """One lookup in flight, and how many queries wait on it."""

    task: asyncio.Task[Lookup]
    waiting: int = 0


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
