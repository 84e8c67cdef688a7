"""What the service counts and remembers about itself: Prometheus metrics, the shared counters
behind ``/v1/stats``, recent answers for the debug pages, and the history behind their charts
(:mod:`coalescer.history`), written along with the counters and the answers.

Queries stay at one Redis round trip: answers (and how long each took) are buffered here and
written to each key's log, and observed by the metrics, in batches by :meth:`Observer.flush`,
which the web app calls about once a second. Gauges of the index (pending tasks, the oldest
wait) are read from Redis when ``/metrics`` is scraped, so they agree across processes: counted
then for a small index, else as the background upkeep last counted them (:mod:`coalescer.upkeep`).

With ``PROMETHEUS_MULTIPROC_DIR`` set (several web processes), prometheus-client keeps the
counters in files there and :func:`exposition` merges every process's.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector

from coalescer import history, keyset
from coalescer.errors import StoreError, StoreOverloaded, StoreUnavailable
from coalescer.history import Durations, Retention, Tally
from coalescer.model import TaskEvent
from coalescer.store import Store, views
from coalescer.store import keyset as stored

if TYPE_CHECKING:
    from coalescer.health import Health

log = logging.getLogger(__name__)

EVENTS = Counter(
    "coalescer_events",
    "Task events received, by source (pulse, http), exchange and outcome (applied, stale, "
    "ignored, expired, invalid, dead-lettered)",
    ["source", "exchange", "outcome"],
)
QUERIES = Counter("coalescer_queries", "Superseding queries answered, by reason", ["reason"])
LIST_SIZE = Histogram(
    "coalescer_supersedes_list_size",
    "Length of supersedes lists answered",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
QUERY_SECONDS = Histogram(
    "coalescer_query_seconds",
    "Time to answer a superseding query, from routing to the answer (the Redis round trip "
    "included, sending the response not)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
STORE_ERRORS = Counter(
    "coalescer_store_errors",
    "Store (Redis) failures seen by the service, by reason (unreachable, timeout, full, "
    "read-only, loading, busy, ...)",
    ["reason"],
)
HELD = Gauge(
    "coalescer_ingest_held_events",
    "Pulse events held (not acknowledged) while the store cannot take them",
    multiprocess_mode="livesum",
)
HTTP_ERRORS = Counter("coalescer_http_errors", "Error responses sent, by status code", ["status"])
REQUESTS_SHED = Counter(
    "coalescer_requests_shed",
    "Requests answered 503 with Retry-After to shed load, by reason (store_busy: every "
    "connection of the process's Redis pool stayed in use while the request waited for one); "
    "not a store outage, and not counted in coalescer_store_errors_total",
    ["reason"],
)
CONNECTIONS_SHED = Counter(
    "coalescer_connections_shed",
    "Client connections closed by the service, by reason (idle: no request within "
    "COALESCER_IDLE_TIMEOUT of connecting; slow_head: a request head not complete within "
    "COALESCER_HEAD_TIMEOUT; over_limit: the one waiting longest for its client, closed for a "
    "new one at COALESCER_MAX_CONNECTIONS; refused: a new one at the cap while every other one "
    "had a request in flight)",
    ["reason"],
)
CONNECTIONS_OPEN = Gauge(
    "coalescer_connections_open",
    "Client connections open (summed over the web processes)",
    multiprocess_mode="livesum",
)
CONNECTIONS_LIMIT = Gauge(
    "coalescer_connections_limit",
    "Client connections the web processes keep open at most (COALESCER_MAX_CONNECTIONS, or what "
    "the file descriptor limit allows; summed over the processes)",
    multiprocess_mode="livesum",
)

EVENTS_LIMITED = Counter(
    "coalescer_events_limited",
    "Events not indexed under one of their keys because the index is at a limit, by limit "
    "(keys: a new key past COALESCER_MAX_KEYS; tasks: a new task past COALESCER_MAX_TASKS)",
    ["limit"],
)
FINDINGS_LIMITED = Counter(
    "coalescer_findings_limited",
    "Bisection findings refused by POST /v1/bisections because COALESCER_MAX_FINDINGS are kept",
)
#: Seconds between the log lines that say what the limits refused (the first at once).
LIMITED_LOG_EVERY = 10.0

CULPRITS_LOCATED = Counter(
    "coalescer_culprits_located",
    "Bisections after a failed primary that located a culprit (the first failing push), by "
    "source (http: reported by a worker to POST /v1/bisections; enforcer)",
    ["source"],
)
BISECTION_EXTRA_RUNS = Counter(
    "coalescer_bisection_extra_runs",
    "Runs bisections took beyond the failed primary's first run (confirmations included), by "
    "source (http, enforcer)",
    ["source"],
)


def store_failed(exc: StoreUnavailable) -> None:
    """Count a store failure, unless it is load shed (:class:`StoreOverloaded`): Redis is fine
    then, and an alert on store errors must not fire."""
    if not isinstance(exc, StoreOverloaded):
        STORE_ERRORS.labels(exc.reason).inc()


#: Names of the shared counters (``/v1/stats``) per ingest outcome.
STAT_NAMES = {
    "applied": "events_applied",
    "stale": "events_stale",
    "ignored": "events_ignored",
    "expired": "events_expired",
    "limited": "events_limited",
    "invalid": "events_invalid",
    "dead-lettered": "events_dead_lettered",
}
#: Every shared counter ``/v1/stats`` shows (``0`` until counted), tc-coalesce's first.
STAT_COUNTERS = ("total_msgs_handled", *STAT_NAMES.values())
#: The queue's task exchanges by short name; anything else counts as ``other``, so that a
#: client cannot grow the metrics' label sets.
EXCHANGES = frozenset(
    ("task-pending", "task-running", "task-completed", "task-failed", "task-exception")
)


def exchange_label(exchange: str) -> str:
    """``exchange/taskcluster-queue/v1/task-pending`` → ``task-pending``; else ``other``."""
    name = exchange.rsplit("/", 1)[-1]
    return name if name in EXCHANGES else "other"


def bisection_recorded(finding: Mapping[str, Any], source: str = "enforcer") -> None:
    """Count a bisection's ``finding`` (the shape of :mod:`coalescer.store.bisections`) once
    it is recorded: whoever records one (``POST /v1/bisections``, the enforcer) calls this, so
    that every finding is counted the same way. ``source`` is ``http`` or ``enforcer``."""
    if finding.get("culprit") is not None:
        CULPRITS_LOCATED.labels(source).inc()
    extra = finding.get("extraRuns")
    if isinstance(extra, int) and extra > 0:
        BISECTION_EXTRA_RUNS.labels(source).inc(extra)


class Observer:
    def __init__(
        self, store: Store, *, buffer: int = 10_000, retention: Retention | None = None
    ) -> None:
        self.store = store
        self.retention = retention or Retention()
        #: Counts for the history's buckets, written with the next counters or answers.
        self.history = Tally(self.retention)
        self.durations = Durations()
        self._answers: collections.deque[views.GivenAnswer] = collections.deque(maxlen=buffer)
        self._seconds: collections.deque[float] = collections.deque(maxlen=buffer)
        self._counted = 0  # answers at the head of the buffer already in the metrics
        self._uncounted: collections.Counter[str] = collections.Counter()  # for /v1/stats
        self._limited = _LimitedLog(store)

    def answer(
        self,
        key: str,
        initial: str,
        answer: list[str],
        reason: str,
        now_ms: int,
        started: float | None = None,
    ) -> None:
        """Record one answer (``started``: ``time.perf_counter()`` when the query began);
        metrics and logs catch up at the next :meth:`flush` (hot path)."""
        # A tuple of strings, not the list: the garbage collector stops tracking tuples of
        # atomic values, and a second's worth of answers would otherwise slow every collection.
        self._answers.append((key, initial, tuple(answer), reason, now_ms))
        if started is not None:
            self._seconds.append(time.perf_counter() - started)

    def applied(self, events: Iterable[TaskEvent], now_ms: int | None = None) -> None:
        """Count, for the history, events the store has just applied (never a stale one, so
        a redelivered event counts once): superseded resolutions, and the worker time they
        saved, estimated from the key's recent completed and failed runs."""
        for ev in events:
            if ev.state in ("completed", "failed") and 0 < ev.started_ms <= ev.resolved_ms:
                for key in ev.keys:
                    self.durations.add(key, ev.resolved_ms - ev.started_ms)
            elif ev.state == "exception" and ev.reason == "superseded":
                at = ev.resolved_ms or (int(time.time() * 1000) if now_ms is None else now_ms)
                self.history.add(history.SUPERSEDED, at)
                saved = self.durations.estimate(ev.keys)
                if saved:
                    self.history.add(history.SAVED_MS, at, saved)

    async def ingest(
        self,
        source: str,
        outcomes: Sequence[str],
        exchanges: Sequence[str] | None = None,
        applied: Iterable[TaskEvent] = (),
    ) -> None:
        """Count ingested events: ``outcomes[i]`` of a message from ``exchanges[i]``; and,
        for the history, the ``applied`` events (:meth:`applied`)."""
        self.applied(applied)
        self._limited.catch_up()
        names: Iterable[str] = (
            map(exchange_label, exchanges) if exchanges is not None else ["other"] * len(outcomes)
        )
        for (exchange, outcome), n in collections.Counter(
            zip(names, outcomes, strict=True)
        ).items():
            EVENTS.labels(source, exchange, outcome).inc(n)
        counts = collections.Counter(outcomes)
        shared = collections.Counter(
            {STAT_NAMES.get(k, f"events_{k}"): n for k, n in counts.items()}
        )
        shared["total_msgs_handled"] = sum(counts.values())
        # The shared counters wait while the store cannot take them; they never fail ingest.
        self._uncounted.update(shared)
        buckets = self.history.take()
        try:
            await self.store.count(dict(self._uncounted), history=buckets, retention=self.retention)
        except StoreError as exc:
            STORE_ERRORS.labels(exc.reason).inc()
            self.history.restore(buckets)
            return
        self._uncounted.clear()

    async def flush(self) -> None:
        """Write buffered answers to the keys' logs; keep them, and raise, if the store is
        down (the supervisor tries again later)."""
        seconds, self._seconds = self._seconds, collections.deque(maxlen=self._seconds.maxlen)
        for s in seconds:
            QUERY_SECONDS.observe(s)
        batch = list(self._answers)
        if not batch and not self.history:
            return
        fresh = batch[self._counted :]
        for reason, n in collections.Counter(a[3] for a in fresh).items():
            QUERIES.labels(reason).inc(n)
        for _key, _initial, answer, _reason, _at in fresh:
            LIST_SIZE.observe(len(answer))
        self.history.add_each(history.ANSWERS, (a[4] for a in fresh))
        self._counted = len(batch)
        buckets = self.history.take()
        try:
            await self.store.remember_answers(batch, history=buckets, retention=self.retention)
        except StoreUnavailable as exc:
            store_failed(exc)
            self.history.restore(buckets)
            raise
        for _ in batch:
            self._answers.popleft()
        self._counted = 0


class _LimitedLog:
    """Counts what the index's limits refused (the store's census) in the metrics, and says
    so in the log: at once, then at most every :data:`LIMITED_LOG_EVERY` seconds, with
    counts."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._seen = (0, 0)  # the census's refusals already counted
        self._held = (0, 0)  # ... and not logged yet
        self._logged = -LIMITED_LOG_EVERY

    def catch_up(self) -> None:
        census = self.store.census
        keys_n, tasks_n = census.refused_keys - self._seen[0], census.refused_tasks - self._seen[1]
        if not (keys_n or tasks_n or any(self._held)):
            return
        self._seen = (census.refused_keys, census.refused_tasks)
        if keys_n:
            EVENTS_LIMITED.labels("keys").inc(keys_n)
        if tasks_n:
            EVENTS_LIMITED.labels("tasks").inc(tasks_n)
        held = (self._held[0] + keys_n, self._held[1] + tasks_n)
        now = time.monotonic()
        if now - self._logged < LIMITED_LOG_EVERY:
            self._held = held
            return
        limits = census.limits
        log.warning(
            "the index is at its limits: %d events not indexed under a key since the last line "
            "(%d of new keys past COALESCER_MAX_KEYS=%s, %d of new tasks past "
            "COALESCER_MAX_TASKS=%s; answered 'limited', their queries answer [taskId]); the "
            "index holds %s keys and %s tasks",
            sum(held),
            held[0],
            limits.keys if limits else "?",
            held[1],
            limits.tasks if limits else "?",
            census.keys,
            census.tasks,
        )
        self._held, self._logged = (0, 0), now


class _IndexGauges(Collector):
    """Gauges of the index (the same from every process): the keys known now, the rest as the
    last count found them (:func:`coalescer.store.keyset.totals`); and the health of the
    process scraped."""

    def __init__(
        self, totals: keyset.Totals | None, up: bool, now_ms: int, health: Health | None
    ) -> None:
        self.totals = totals
        self.up = up
        self.now_ms = now_ms
        self.health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("coalescer_store_up", "1 when the store (Redis) answered")
        up.add_metric([], 1 if self.up else 0)
        yield up
        yield from self._health()
        if self.totals is None:
            return
        t = self.totals
        gauges = [("coalescer_keys", "Coalescing keys known", float(t.keys))]
        if t.counted_ms is not None:  # a large index before its first background count
            gauges += [
                (
                    "coalescer_keys_with_pending",
                    "Coalescing keys with pending tasks",
                    t.with_pending,
                ),
                (
                    "coalescer_pending_tasks",
                    "Pending tasks in the index, over every key",
                    t.pending,
                ),
                (
                    "coalescer_oldest_pending_seconds",
                    "How long the longest-waiting pending task has waited, over every key",
                    t.oldest_wait_seconds(self.now_ms),
                ),
                (
                    "coalescer_index_count_age_seconds",
                    "How old the counts of keys with pending tasks, pending tasks and the "
                    "oldest wait are: 0 for an index small enough to count at scrape time, "
                    "else the time since the background count began",
                    t.age_seconds(self.now_ms),
                ),
            ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge

    def _health(self) -> Iterator[GaugeMetricFamily]:
        health = self.health
        if health is None:
            return
        for name, doc, value in (
            (
                "coalescer_store_writable",
                "1 when the store took the last write probe (a full or read-only Redis: 0)",
                health.store_down is None,
            ),
            (
                "coalescer_store_evicting",
                "1 when Redis's maxmemory-policy may evict index keys (set noeviction)",
                health.eviction is not None,
            ),
            (
                "coalescer_index_complete",
                "0 from when the store is found empty (new, or emptied) until a rebuild from the "
                "queue (coalescer reconcile --rebuild) completes",
                health.index_complete is not False,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], 1 if value else 0)
            yield gauge
        failing = GaugeMetricFamily(
            "coalescer_background_failing",
            "1 while a background task of the process scraped keeps failing, by task",
            labels=["task"],
        )
        for name, loop in sorted(health.loops.items()):
            failing.add_metric([name], 1 if loop.failing else 0)
        yield failing


def _process_registry(multiproc_dir: str | None) -> CollectorRegistry:
    if multiproc_dir:
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, multiproc_dir)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


async def exposition(
    store: Store, health: Health | None = None, *, multiproc_dir: str | None = None
) -> bytes:
    """The ``/metrics`` body: this service's counters (every process's, from the files in
    ``multiproc_dir``: ``PROMETHEUS_MULTIPROC_DIR``), the index gauges, read now, and this
    process's ``health``."""
    now_ms = int(time.time() * 1000)
    totals: keyset.Totals | None = None
    up = True
    try:
        totals = await stored.totals(store, now_ms=now_ms)
    except StoreUnavailable as exc:
        store_failed(exc)
        log.warning("metrics without the index gauges: %s", exc)
        up = False
    gauges = CollectorRegistry(auto_describe=False)
    gauges.register(_IndexGauges(totals, up, now_ms, health))
    return generate_latest(_process_registry(multiproc_dir)) + generate_latest(gauges)
