"""A process's health: the store's condition, the index's marker, and its background tasks.

Every background task runs under a :class:`Supervisor`. A periodic job that fails is logged
(throttled), counted, and tried again at its next tick, later and later while it keeps failing;
a long-running service that crashes is restarted the same way, unless it stops on a
:class:`~coalescer.errors.ConfigError` (retrying cannot fix a setting). Nothing dies silently:
``/__heartbeat__`` and ``/metrics`` read :class:`Health`.

:func:`watch_store` is the periodic job that finds out what the store is up to: whether it takes
writes (a full or read-only Redis still answers ``PING``), whether it may evict keys, and
whether it was emptied (see ``store/scripts/marker.lua``), and says so loudly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter

from coalescer.backoff import JITTER, Backoff
from coalescer.errors import ConfigError, StoreOverloaded, StoreUnavailable
from coalescer.logs import Throttled
from coalescer.model import format_time_ms
from coalescer.store import IndexState, Store
from coalescer.store import keyset as stored_keyset
from coalescer.store.census import Limits

log = logging.getLogger(__name__)

BACKGROUND_FAILURES = Counter(
    "coalescer_background_failures",
    "Failures of a background task (a periodic job's round, or a service's crash), by task",
    ["task"],
)
#: The longest wait between tries of a failing task.
MAX_BACKOFF = 30.0
#: Consecutive failures after which a task shows as failing in the heartbeat.
FAILING_AFTER = 3


@dataclasses.dataclass
class Loop:
    """How one background task is doing."""

    name: str
    failures: int = 0  # consecutive
    total_failures: int = 0
    restarts: int = 0
    last_ok: float | None = None  # time.time()
    last_error: str | None = None
    last_failure: float = 0.0  # time.time()
    stopped: str | None = None  # why a service stopped for good

    @property
    def failing(self) -> bool:
        """Stopped for good, or failed again and again lately (a service that was restarted and
        then ran a while is well again)."""
        recent = time.time() - self.last_failure < 2 * MAX_BACKOFF
        return self.stopped is not None or (self.failures >= FAILING_AFTER and recent)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": "error" if self.failing else "ok"}
        if self.last_ok is not None:
            out["lastOk"] = format_time_ms(int(self.last_ok * 1000))
        if self.total_failures:
            out.update(failures=self.total_failures, lastError=self.last_error)
        if self.restarts:
            out["restarts"] = self.restarts
        if self.stopped:
            out["stopped"] = self.stopped
        return out


@dataclasses.dataclass
class Health:
    """What this process knows of its own health (one per process)."""

    #: Why the store refuses work now (``full``, ``read-only``, ``unreachable``, ...), or None.
    store_down: str | None = None
    store_error: str | None = None
    #: Redis's ``maxmemory-policy`` when it may evict index keys.
    eviction: str | None = None
    index: IndexState | None = None
    embedded: bool = False  # the store is the in-process one, empty at every start
    #: This process rebuilds the embedded store's index from the queue (ingest.startup).
    rebuilds: bool = False
    #: Why the index takes no new keys or tasks (``COALESCER_MAX_KEYS``, ``_MAX_TASKS``).
    limited: str | None = None
    loops: dict[str, Loop] = dataclasses.field(default_factory=dict)

    def loop(self, name: str) -> Loop:
        return self.loops.setdefault(name, Loop(name))

    @property
    def index_complete(self) -> bool | None:
        return None if self.index is None else self.index.state == "ok"

    def alerts(self) -> list[str]:
        """What a person looking at the pages must know, worst first."""
        out = []
        if self.store_down is not None:
            out.append(
                f"Redis refuses writes ({self.store_down}): events are held and retried, "
                "nothing is lost, but the index is behind until it takes writes again."
            )
        if self.index is not None and self.index.state != "ok":
            out.append(f"Superseding is incomplete: {self.index_message()}.")
        if self.eviction is not None:
            out.append(
                f"Redis maxmemory-policy is {self.eviction}: it may evict index keys without "
                "an error. Set maxmemory-policy noeviction."
            )
        if self.limited is not None:
            out.append(f"The index is at its limits: {self.limited}.")
        out.extend(
            f"Background task {lp.name} keeps failing: {lp.stopped or lp.last_error}"
            for lp in self.loops.values()
            if lp.failing
        )
        return out

    def report(self) -> dict[str, Any]:
        """The heartbeat's ``checks`` and ``details`` beyond a live ping."""
        checks: dict[str, str] = {
            "writable": "ok" if self.store_down is None else "error",
            "eviction": "ok" if self.eviction is None else "warning",
            "index": {None: "unknown", True: "ok", False: "warning"}[self.index_complete],
            "limits": "ok" if self.limited is None else "warning",
            "background": "error" if any(lp.failing for lp in self.loops.values()) else "ok",
        }
        details: dict[str, Any] = {
            "background": {name: lp.report() for name, lp in sorted(self.loops.items())}
        }
        if self.store_down is not None:
            details["writable"] = f"Redis refuses writes ({self.store_down}): {self.store_error}"
        if self.eviction is not None:
            details["eviction"] = (
                f"Redis maxmemory-policy is {self.eviction}: it may evict index keys without an "
                "error; set maxmemory-policy noeviction"
            )
        if self.index is not None and self.index.state != "ok":
            details["index"] = self.index_message()
        if self.limited is not None:
            details["limits"] = self.limited
        return {"checks": checks, "details": details}

    def index_message(self) -> str:
        """Why the index is incomplete and what to do, for this process's store."""
        assert self.index is not None
        return index_message(self.index, embedded=self.embedded, rebuilds=self.rebuilds)


def index_message(state: IndexState, *, embedded: bool = False, rebuilds: bool = False) -> str:
    """Why an index marked ``state`` is incomplete, and the way out: for the embedded store,
    which ``coalescer reconcile`` cannot reach, whether this process ``rebuilds`` it itself."""
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(state.since_ms / 1000))
    if not embedded:
        return (
            f"the index has not been rebuilt from the queue since it was found empty at {since} "
            f"(Redis new, restarted empty or flushed): {_ANSWERED_ALONE}; "
            "run `coalescer reconcile --rebuild`"
        )
    found = f"the embedded store started empty at {since} (it keeps nothing across restarts)"
    if rebuilds:
        return (
            f"{found}: {_ANSWERED_ALONE}, or until this process has rebuilt the index from the "
            "queue (TASKCLUSTER_ROOT_URL), which it is doing now; the log says how it goes"
        )
    return (
        f"{found}: {_ANSWERED_ALONE}; set TASKCLUSTER_ROOT_URL so that `coalescer serve` "
        "rebuilds the index from the queue at start, or keep the index in Redis (REDIS_URL) "
        "and run `coalescer reconcile --rebuild`"
    )


_ANSWERED_ALONE = "tasks pending since before then are answered alone until they change state"


class Supervisor:
    """Runs a process's background tasks and keeps them running; :meth:`stop` ends them all."""

    def __init__(self, health: Health, *, jitter: float = JITTER) -> None:
        self.health = health
        self.jitter = jitter  # of each wait after a failure (coalescer.backoff)
        self._tasks: list[asyncio.Task[None]] = []

    def _backoff(self, initial: float) -> Backoff:
        return Backoff(initial, maximum=MAX_BACKOFF, jitter=self.jitter)

    def every(self, name: str, seconds: float, job: Callable[[], Awaitable[object]]) -> None:
        """Run ``job`` now and every ``seconds``; a failed round is retried later and later."""
        self._tasks.append(asyncio.create_task(self._periodic(name, seconds, job), name=name))

    def service(
        self,
        name: str,
        run: Callable[[], Awaitable[object]],
        *,
        expected: tuple[type[Exception], ...] = (),
    ) -> asyncio.Task[None]:
        """Run ``run`` until it returns; restart it whenever it crashes. A crash on one of the
        ``expected`` errors (whose message says why) is logged as one line, without a trace."""
        task = asyncio.create_task(self._service(name, run, expected), name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _periodic(
        self, name: str, seconds: float, job: Callable[[], Awaitable[object]]
    ) -> None:
        state = self.health.loop(name)
        throttled = Throttled(log)
        # After a failure: twice the period, then longer (up to MAX_BACKOFF).
        backoff = self._backoff(min(seconds * 2, MAX_BACKOFF))
        while True:
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _still_cancelled(exc)
                delay = backoff.next()
                self._failed(state, exc, throttled, "failed; next try in", delay)
            else:
                state.failures, state.last_ok, delay = 0, time.time(), seconds
                backoff.reset()
            _still_cancelled(None)
            await asyncio.sleep(delay)

    async def _service(
        self,
        name: str,
        run: Callable[[], Awaitable[object]],
        expected: tuple[type[Exception], ...],
    ) -> None:
        state = self.health.loop(name)
        throttled = Throttled(log)
        backoff = self._backoff(1.0)
        while True:
            started = time.monotonic()
            state.last_ok = time.time()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except ConfigError as exc:
                state.stopped = str(exc)
                log.error("background task %s stopped: %s", name, exc)
                return
            except Exception as exc:
                _still_cancelled(exc)
                if time.monotonic() - started > MAX_BACKOFF:
                    backoff.reset()  # it ran a while: start backing off afresh
                delay = backoff.next()
                self._failed(state, exc, throttled, "stopped; restarting in", delay, expected)
                state.restarts += 1
                await asyncio.sleep(delay)

    @staticmethod
    def _failed(
        state: Loop,
        exc: Exception,
        throttled: Throttled,
        what: str,
        delay: float,
        expected: tuple[type[Exception], ...] = (),
    ) -> None:
        state.failures += 1
        state.total_failures += 1
        state.last_error = f"{type(exc).__name__}: {exc}"
        state.last_failure = time.time()
        BACKGROUND_FAILURES.labels(state.name).inc()
        # A store outage is expected and shows elsewhere; anything else is a bug to look at.
        if isinstance(exc, StoreUnavailable):
            throttled.log(logging.WARNING, "%s %s %.0f s: %s", state.name, what, delay, exc)
        elif isinstance(exc, expected):
            log.error("%s %s %.0f s: %s", state.name, what, delay, exc)
        else:
            log.error("%s %s %.0f s", state.name, what, delay, exc_info=exc)


def _still_cancelled(exc: Exception | None) -> None:
    """A cancel that a library swallowed or turned into another error (redis-py drops the
    connection of a command cancelled mid-flight) is still a cancel: stop, don't go on."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc


async def watch_store(store: Store, health: Health) -> None:
    """One round of watching the store: writable, evicting, emptied. Raises
    :class:`StoreUnavailable` when it cannot tell (the supervisor retries).

    Each emptying is said once by every process that watches, whether it finds the store empty
    itself or another process (``serve``, a ``listen``) found it first: each emptying creates
    the marker anew, with a ``since_ms`` of its own. At start, an index still waiting for its
    rebuild is a warning."""
    try:
        await store.probe()
    except StoreOverloaded:
        raise  # a burst of requests holds every connection: Redis may well take writes
    except StoreUnavailable as exc:
        if health.store_down != exc.reason:
            log.error("Redis does not take writes (%s): %s", exc.reason, exc)
        health.store_down, health.store_error = exc.reason, str(exc)
        raise
    if health.store_down is not None:
        log.info("Redis takes writes again (it was %s)", health.store_down)
        health.store_down = health.store_error = None
    eviction = await store.eviction_policy()
    if eviction is not None and eviction != health.eviction:
        log.error(
            "Redis maxmemory-policy is %s: Redis may evict index keys without an error, and "
            "superseding would then answer wrongly or not at all; set maxmemory-policy noeviction",
            eviction,
        )
    health.eviction = eviction
    before = health.index
    state = await store.index_state(int(time.time() * 1000))
    health.index, health.embedded = state, store.embedded
    if state.created and before is not None:
        log.error(
            "the index store was emptied (Redis restarted empty or was flushed): %s",
            index_message(state),
        )
    elif state.created and store.embedded:  # said loudly at start already
        log.info("%s", health.index_message())
    elif state.created:
        log.warning("the index store holds no marker (new, or emptied): %s", index_message(state))
    elif state.state != "ok" and before is None:
        log.warning("the index is incomplete: %s", index_message(state))
    elif state.state != "ok" and before is not None and state.since_ms != before.since_ms:
        log.error(
            "the index store was emptied (Redis restarted empty or was flushed): %s",
            index_message(state),
        )
    elif state.state == "ok" and before is not None and before.state != "ok":
        log.info("the index was rebuilt from the queue; superseding covers every pending task")
    await watch_limits(store, health)


async def watch_limits(store: Store, health: Health) -> None:
    """Whether the index is at its limits (keys, tracked tasks), said once when it gets there
    and once when it has room again; the events refused meanwhile are logged by ingest."""
    known, tasks, limits = await stored_keyset.size(store)
    message = None if limits is None else limits_message(known, tasks, limits)
    if message is not None and health.limited is None:
        log.warning("the index is at its limits: %s", message)
    elif message is None and health.limited is not None:
        log.info("the index has room again: %d keys, %d tasks tracked", known, tasks)
    health.limited = message


def limits_message(known: int, tasks: int, limits: Limits) -> str | None:
    """What a person must know of the index at ``known`` keys and ``tasks`` tracked tasks,
    or ``None`` while it has room."""
    full = []
    if known >= limits.keys:
        full.append(f"{known} keys of COALESCER_MAX_KEYS={limits.keys}")
    if tasks >= limits.tasks:
        full.append(f"{tasks} tracked tasks of COALESCER_MAX_TASKS={limits.tasks}")
    if not full:
        return None
    refused = "new tasks" if tasks >= limits.tasks else "tasks of new keys"
    return (
        f"{' and '.join(full)}; events of {refused} are not indexed (answered 'limited', and "
        "queries answer them [taskId] alone) until tasks expire or the limits are raised"
    )
