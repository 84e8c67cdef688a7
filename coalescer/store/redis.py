"""The store's domain actions on Redis: apply events, read a key's snapshot, list keys, stats.

Every action is one round trip. Writes for one coalescing key happen in one Lua script (see
``scripts/``). Redis errors become domain errors (:func:`store_error`): the server's condition
(unreachable, too slow, full, read-only, loading, busy, cluster down) is
:class:`~coalescer.errors.StoreUnavailable`, never the caller's fault; anything else (a script
error) is :class:`~coalescer.errors.StoreRejected`.

The scripts that write start with ``#!lua``: Redis then checks memory once, before the script
runs, so a full Redis refuses the whole script instead of failing it halfway through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping, Sequence
from importlib import resources
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from coalescer import keyset, model
from coalescer.errors import StoreError, StoreRejected, StoreUnavailable
from coalescer.history import Retention, Slot
from coalescer.store import history as stored_history
from coalescer.store import keys, views
from coalescer.store.admission import POOL_SIZE, Admission
from coalescer.store.census import Census, Limits
from coalescer.store.cluster import ClusterPipeline, ClusterRouter, NodeClients, NotReplicated
from coalescer.store.pipelined import NoScript, PipelinedClient, ReplyError
from coalescer.store.policy import KeyPolicy, queue_decide

log = logging.getLogger(__name__)

Outcome = Literal["applied", "stale", "expired", "limited", "ignored"]
T = TypeVar("T")

_SCRIPTS = (
    "apply",
    "snapshot",
    "inspect",
    "forget",
    "summary",
    "remember",
    "decide",
    "settle",
    "lease",
    "idle",
    "marker",
    "list",
    "unlist",
    "history",
    "bisect",
)
#: How many resolutions and answers each key remembers for the pages.
LOG_LENGTH = 50
#: Most events of one key that one ``apply.lua`` call applies (Redis runs nothing else
#: meanwhile: a few milliseconds at most).
APPLY_BATCH = 250
#: Redis error codes that describe the server's condition, never the command: retry later.
CONDITIONS = {
    "OOM": "full",
    "READONLY": "read-only",
    "MISCONF": "misconf",
    "BUSY": "busy",
    "LOADING": "loading",
    "CLUSTERDOWN": "cluster-down",
    "TRYAGAIN": "try-again",
    "MASTERDOWN": "master-down",
    "NOREPLICAS": "no-replicas",
    "NOSCRIPT": "no-script",
    "NOAUTH": "no-auth",
    "WRONGPASS": "no-auth",
    "NOPERM": "no-permission",
    # A Cluster slot that moved (a failover): the pipelines follow it, and a command still
    # redirected after that waits for a retry, as a store that is unavailable for a moment.
    "MOVED": "moved",
    "ASK": "moved",
}
#: redis-py's classes for some of them (it strips the code from their message).
_CONDITION_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "full"),
    (redis.exceptions.ReadOnlyError, "read-only"),
    (redis.exceptions.BusyLoadingError, "loading"),
    (redis.exceptions.ClusterDownError, "cluster-down"),
    (redis.exceptions.TryAgainError, "try-again"),
    (redis.exceptions.MasterDownError, "master-down"),
    (redis.exceptions.NoScriptError, "no-script"),
    (redis.exceptions.NoPermissionError, "no-permission"),
    (redis.exceptions.MovedError, "moved"),
    (redis.exceptions.AskError, "moved"),
    (NotReplicated, "not-replicated"),
    (redis.exceptions.AuthenticationError, "no-auth"),
    (redis.exceptions.TimeoutError, "timeout"),
    (redis.exceptions.ConnectionError, "unreachable"),
)
#: How an event's outcomes under its keys add up: the highest.
_PRECEDENCE = {"ignored": 0, "expired": 1, "stale": 2, "limited": 3, "applied": 4}
#: Eviction policies under which Redis never drops a key to make room.
SAFE_POLICIES = frozenset({"noeviction"})


def condition(exc: BaseException) -> str | None:
    """The server condition ``exc`` reports (``full``, ``read-only``, ...), or ``None`` when
    it is about the command itself."""
    for cls, reason in _CONDITION_CLASSES:
        if isinstance(exc, cls):
            return reason
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return "unreachable"
    if not isinstance(exc, redis.exceptions.ResponseError | ReplyError | NoScript):
        # redis-py's own failures (a closed buffer, a bad reply) are the connection's
        return None if isinstance(exc, redis.exceptions.DataError) else "unreachable"
    text = str(exc)
    # A pipeline's error reads "Command # 3 (EVALSHA ...) of pipeline caused error: OOM ..."
    text = text.rpartition("caused error: ")[2]
    return CONDITIONS.get(text.split(" ", 1)[0])


def store_error(exc: BaseException) -> StoreError:
    """``exc``, raised by redis-py or the lean clients, as a domain error."""
    if isinstance(exc, StoreError):
        return exc
    reason = condition(exc)
    if reason is None:
        return StoreRejected(f"Redis refused a command: {exc}")
    return StoreUnavailable(f"Redis is {reason.replace('-', ' ')}: {exc}", reason=reason)


class Store:
    """Async access to the index. Build one with :func:`open_store`."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        grace_ms: int,
        embedded: bool = False,
        fast: PipelinedClient | ClusterRouter | None = None,
        writer: PipelinedClient | None = None,
        nodes: NodeClients | None = None,
        query_timeout: float = 2.0,
    ) -> None:
        self.client = client
        self.fast = fast
        self.writer = writer  # background batches, on a connection of their own
        self.nodes = nodes  # set on a Redis Cluster
        self.grace_ms = grace_ms
        self.embedded = embedded
        self.query_timeout = query_timeout
        self._source = {name: _script(name, embedded) for name in _SCRIPTS}
        # A script's SHA1 is fixed by its text: known from the start, so that a coroutine never
        # finds a name missing while another reloads the scripts (after a restart or a failover
        # to a node that lacks them); only whether Redis holds them changes.
        self._sha = {
            name: hashlib.sha1(source.encode()).hexdigest() for name, source in self._source.items()
        }
        self._loaded = False
        #: Who may use the connection pool now, and who waits (a burst is shed, see admission).
        self.admission = Admission(POOL_SIZE)
        #: How large the index is, as this process last saw it, and what it refused.
        self.census = Census()

    # -- the seam: what the modules beside this one use (store/base.py) ---------------------
    async def load_scripts(self) -> None:
        async with self.admission.slot():
            await self._load_scripts()

    async def _load_scripts(self) -> None:
        for name, source in self._source.items():
            self._sha[name] = await self._guard(self.client.script_load(source))
        self._loaded = True

    async def _guard(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except (redis.exceptions.RedisError, OSError) as exc:
            raise store_error(exc) from exc

    async def pipeline(
        self,
        fill: Callable[[Any], object],
        *,
        raise_on_error: bool = True,
        replicated: bool = False,
    ) -> list[Any]:
        """Run the commands ``fill`` queues in one round trip, reloading scripts once if Redis
        lost them (restart, ``SCRIPT FLUSH``). With ``raise_on_error`` false, a command's
        error is its reply (redis-py's exception), for the caller to sort out. Waits for a
        connection of the pool a bounded time (:class:`~coalescer.errors.StoreOverloaded`).
        With ``replicated``, on a Cluster, writes are done only once a replica holds them,
        else the store is unavailable (see :class:`~coalescer.store.cluster.ClusterPipeline`):
        for what someone is told was applied."""
        async with self.admission.slot():
            return await self._round_trip(
                fill, raise_on_error=raise_on_error, replicated=replicated
            )

    async def _round_trip(
        self, fill: Callable[[Any], object], *, raise_on_error: bool, replicated: bool = False
    ) -> list[Any]:
        for attempt in (1, 2):
            if not self._loaded:
                await self._load_scripts()
            pipe: Any = (
                self.client.pipeline(transaction=False)
                if self.nodes is None
                else ClusterPipeline(
                    cast(RedisCluster, self.client), self.nodes, replicated=replicated
                )
            )
            fill(pipe)
            try:
                replies: list[Any] = await self._guard(pipe.execute(raise_on_error=raise_on_error))
            except StoreUnavailable as exc:
                if exc.reason != "no-script" or attempt == 2:
                    raise
                self._loaded = False
                continue
            if attempt == 1 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
                self._loaded = False  # every script call is idempotent: run the whole lot again
                continue
            return replies
        raise AssertionError("unreachable")

    def eval(self, pipe: Any, name: str, key_names: Sequence[str], *args: Any) -> None:
        """Queue on ``pipe`` (one :meth:`pipeline` is filling) a call of
        ``scripts/<name>.lua`` with ``key_names`` as its KEYS and ``args`` as its ARGV."""
        pipe.evalsha(self._sha[name], len(key_names), *key_names, *args)

    def send_in_order(
        self, calls: Sequence[tuple[str, Sequence[str], Sequence[Any]]]
    ) -> list[Awaitable[Any]] | None:
        """Send script calls ``(name, key_names, args)`` on the lean connection without
        waiting, each the reply it will have: Redis runs them in the order given, as one
        connection's commands. ``None`` when there is no single lean connection (the embedded
        store, a Cluster) or the scripts are not loaded yet: use :meth:`pipeline` then. A
        reply fails with :class:`NoScript` or :class:`ReplyError` (redis-py's
        :meth:`pipeline` reloads, or raises the real error) or :class:`StoreUnavailable`."""
        if not isinstance(self.fast, PipelinedClient) or not self._loaded:
            return None
        fast = self.fast
        return [
            fast.execute("EVALSHA", self._sha[name], len(names), *names, *args)
            for name, names, args in calls
        ]

    async def ping(self) -> bool:
        async with self.admission.slot():
            return bool(await self._guard(self.client.ping()))

    async def probe(self) -> None:
        """Write and read one small key: :class:`StoreUnavailable` unless Redis takes writes
        now (a full or read-only Redis still answers ``PING``)."""
        await self.pipeline(lambda pipe: pipe.set(keys.PROBE, b"1", px=60_000))

    async def index_state(self, now_ms: int) -> IndexState:
        """The index's state marker (see ``marker.lua``), created as ``lost`` when missing."""
        (raw,) = await self.pipeline(
            lambda pipe: self.eval(pipe, "marker", (keys.INDEX_STATE,), now_ms)
        )
        return IndexState.decode(raw)

    async def mark_rebuilt(self, now_ms: int, *, started_ms: int) -> IndexState:
        """Record a completed rebuild from the queue that started at ``started_ms``; it does not
        count when the store was found emptied after that."""
        (raw,) = await self.pipeline(
            lambda pipe: self.eval(pipe, "marker", (keys.INDEX_STATE,), now_ms, started_ms)
        )
        return IndexState.decode(raw)

    async def eviction_policy(self) -> str | None:
        """Redis's ``maxmemory-policy`` when it can evict keys (it would drop index keys without
        an error), ``None`` when it cannot, or when the server does not say (the embedded
        store, a Cluster)."""
        if self.embedded or self.nodes is not None:
            return None
        async with self.admission.slot():
            info = await self._guard(self.client.info("memory"))
        policy = str(info.get("maxmemory_policy", "noeviction"))
        return None if policy in SAFE_POLICIES else policy

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        if self.writer is not None:
            await self.writer.close()
        if self.nodes is not None:
            await self.nodes.close()
        await self.client.aclose()
        if self.embedded:
            # The embedded client is given its pool (fakeredis makes it), and a client closes
            # only a pool it made itself (redis-py below 5.1 included): close it here.
            await self.client.connection_pool.disconnect()

    # -- writes -----------------------------------------------------------------------------
    async def apply(
        self,
        events: Sequence[model.TaskEvent],
        *,
        now_ms: int | None = None,
        policy: KeyPolicy | None = None,
        limits: Limits | None = None,
    ) -> list[Outcome]:
        """Apply events in one round trip: one ``apply.lua`` call per key for up to
        :data:`APPLY_BATCH` of its events, in their order (a call touches one key's hash slot,
        and applies each event atomically, as a call per event would).

        An event's outcome is ``applied`` if any of its keys took it, else ``limited`` if a
        key refused it because of the ``limits`` (a new key or task past them: see
        :mod:`coalescer.store.census`), else ``stale`` or ``expired``. Safe to repeat:
        versions make every call idempotent.

        With a ``policy``, each event on a key whose rule decides on arrival is applied in a
        call of its own, followed in the same round trip by ``decide.lua`` (see
        :mod:`coalescer.store.policy`); keys without such a rule cost exactly what they cost
        without a policy.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        per_key = by_key(events)
        if not per_key:
            return ["ignored"] * len(events)
        deciding: dict[str, list[str | int]] = {}
        if policy is not None:
            for key in per_key:
                if (args := policy.script_args(key)) is not None:
                    deciding[key] = list(args)
        # One apply.lua call per (key, batch of its events); a deciding key's decide.lua
        # reply follows its apply.lua reply.
        calls = apply_calls(per_key, alone=deciding)
        positions = list(
            itertools.accumulate((2 if k in deciding else 1 for k, _ in calls), initial=0)
        )
        listed_at = positions.pop()  # then list.lua's, when there is a key to list
        # A key is known until the newest deadline plus grace of its tasks (keyset.py).
        expiring: dict[str, int] = {}
        for key, indexes in per_key.items():
            expires = keyset.expires_ms(max(events[i].deadline_ms for i in indexes), self.grace_ms)
            if expires > now:
                expiring[key] = expires
        held = self.census.reserve(len(per_key), [len(i) for _, i in calls], limits)
        admit = {key: n < held.keys for n, key in enumerate(per_key)}

        def fill(pipe: Any) -> None:
            for (key, indexes), may_add in zip(calls, held.per_call, strict=True):
                self.eval(
                    pipe,
                    "apply",
                    apply_keys(key),
                    *apply_args(
                        [events[i] for i in indexes],
                        now,
                        self.grace_ms,
                        LOG_LENGTH,
                        new_key=admit[key],
                        new_tasks=may_add,
                    ),
                )
                if key in deciding:
                    queue_decide(self, pipe, key, deciding[key], now, events[indexes[0]])
            if expiring:
                triples = [a for k, e in expiring.items() for a in (k, e, int(admit[k]))]
                self.eval(
                    pipe,
                    "list",
                    (keys.KEYS_INDEX, keys.KEYS_EXPIRY, keys.CENSUS),
                    now,
                    *held.unsent,
                    *(("", "") if limits is None else (limits.keys, limits.tasks)),
                    *triples,
                )
            if deciding:
                pipe.zadd(keys.OUTBOX, {key: now for key in deciding})

        try:
            replies = await self._batch(fill)
        except BaseException:
            self.census.release(held, None, 0)
            raise
        folded = _Folded(len(events))
        for (_key, indexes), j in zip(calls, positions, strict=True):
            folded.add(indexes, replies[j])
        listed = replies[listed_at] if expiring else None
        counts = None if listed is None or isinstance(listed, Exception) else _counts(listed)
        self.census.release(held, counts, folded.new_tasks)
        self.census.refused(folded.refused_keys, folded.refused_tasks)
        errors = [store_error(r) for r in replies if isinstance(r, Exception)]
        if not errors:
            return folded.outcomes
        done = [None if i in folded.failed else o for i, o in enumerate(folded.outcomes)]
        unavailable = [e for e in errors if isinstance(e, StoreUnavailable)]
        if unavailable:
            # Applied events stay applied (a retry finds them stale); the rest wait for a retry.
            first = unavailable[0]
            raise StoreUnavailable(str(first), reason=first.reason, outcomes=done)
        raise errors[0]

    async def count(
        self,
        counters: dict[str, int],
        *,
        history: Mapping[Slot, int] | None = None,
        retention: Retention | None = None,
    ) -> None:
        """Add to the service-wide counters shown by ``/v1/stats`` and, in the same round
        trip, to the buckets of the history over every key (:mod:`coalescer.history`)."""
        counters = {k: v for k, v in counters.items() if v}

        def fill(pipe: Any) -> None:
            for k, v in counters.items():
                pipe.hincrby(keys.STATS, k, v)
            if history and retention is not None:
                stored_history.queue(
                    self, pipe, keys.HISTORY, stored_history.added(history), retention
                )

        if counters or history:
            await self._write(fill)

    async def remember_answers(
        self,
        answers: Sequence[views.GivenAnswer],
        *,
        history: Mapping[Slot, int] | None = None,
        retention: Retention | None = None,
    ) -> None:
        """Log ``(key, initial, answer, reason, at_ms)`` answers for the pages, in one round
        trip; only the newest :data:`LOG_LENGTH` per key are kept, so only those are sent.
        Each listed task also gets a record of the newest answer that listed it (task page).
        ``history`` counts are added to the history over every key in the same round trip."""
        per_task = views.answer_records(reversed(answers))
        per_key: dict[str, list[str]] = {}
        for key, initial, answer, reason, at_ms in reversed(answers):
            entries = per_key.setdefault(key, [])
            if len(entries) < LOG_LENGTH:
                entries.append(
                    f"{at_ms}|answer|{initial}|{len(answer)}|{reason}|{','.join(answer)}"
                )

        def fill(pipe: Any) -> None:
            for key, entries in per_key.items():
                pipe.lpush(keys.log(key), *reversed(entries))
                pipe.ltrim(keys.log(key), 0, LOG_LENGTH - 1)
                pipe.expire(keys.log(key), 7 * 86400)
            for key, rows in per_task.items():
                args = [a for task_id, at_ms, record in rows for a in (task_id, at_ms, record)]
                self.eval(
                    pipe,
                    "remember",
                    keys.answered(key),
                    views.ANSWERED_PER_KEY,
                    views.ANSWERED_TTL_MS,
                    *args,
                )
            if history and retention is not None:
                stored_history.queue(
                    self, pipe, keys.HISTORY, stored_history.added(history), retention
                )

        if per_key or history:
            await self._write(fill)

    async def _batch(self, fill: Callable[[Any], object]) -> list[Any]:
        """:meth:`pipeline` without raising on a command's error, for the ingest's batches:
        on the lean writer connection when there is one, where hiredis packs the commands and
        parses the replies (redis-py's Python packing and per-reply parsing cost more than Redis
        spends running a batch's scripts). A command's error is its reply; a lost script is
        loaded again and the whole batch run again (every command in it is idempotent)."""
        if self.writer is None:
            # acknowledged to the queue's broker or a client once done: durable on a Cluster
            return await self.pipeline(fill, raise_on_error=False, replicated=True)
        for attempt in (1, 2):
            if not self._loaded:
                await self.load_scripts()
            batch = _Commands()
            fill(batch)
            replies = await self.writer.execute_many(batch.commands)
            if attempt == 1 and any(isinstance(r, NoScript) for r in replies):
                self._loaded = False
                continue
            return replies
        raise AssertionError("unreachable")

    async def _write(self, fill: Callable[[Any], object]) -> None:
        """Run the commands ``fill`` queues in one round trip, as :meth:`pipeline` does, for
        background writes: over the lean writer connection when there is one (hiredis packs
        and parses; redis-py's pipeline cost a busy web process a fifth of its time at one
        batch of answers a second), else through redis-py. Commands Redis refused on the lean
        connection (a lost script, a full Redis) go again through redis-py, which reloads
        scripts and maps errors; the others are not repeated."""
        if self.writer is None or not self._loaded:
            await self.pipeline(fill)
            return
        batch = _Commands()
        fill(batch)
        replies = await self.writer.execute_many(batch.commands)
        failed = [
            command
            for command, reply in zip(batch.commands, replies, strict=True)
            if isinstance(reply, ReplyError | NoScript)
        ]
        if failed:
            await self.pipeline(lambda pipe: [pipe.execute_command(*c) for c in failed])

    # -- reads ------------------------------------------------------------------------------
    def snapshot_soon(
        self, key: str, initial: str, *, now_ms: int, cap: int, wait: bool = True
    ) -> asyncio.Future[Any] | None:
        """Send :meth:`snapshot`'s read on the lean connection without waiting: the future of
        its raw reply (for :func:`decode_snapshot`), or ``None`` when only :meth:`snapshot`
        can read it (no lean connection, scripts not loaded yet). Without ``wait``, the
        snapshot's ``oldest_since_ms`` is left ``None`` (only an age threshold reads it, and it
        costs Redis a tenth of the read). The future fails with
        :class:`StoreUnavailable`, :class:`NoScript` or :class:`ReplyError`; the lean
        connection's watchdog fails it when Redis is later than the query timeout."""
        if self.fast is None or not self._loaded:
            return None
        t, p, w, d, _ = keys.group(key)
        try:
            args = (t, p, w, d, initial, now_ms, cap, 1 if wait else 0)
            return asyncio.ensure_future(
                self.fast.execute("EVALSHA", self._sha["snapshot"], 4, *args)
            )
        except ReplyError:  # a Cluster without a slot map yet
            return None

    @staticmethod
    def snapshot_of(reply: asyncio.Future[Any]) -> model.KeySnapshot | None:
        """What a done :meth:`snapshot_soon` ``reply`` holds; ``None`` when only
        :meth:`snapshot` can read it (the script must be reloaded, or a Cluster node redirects
        the read). Raises :class:`StoreUnavailable`."""
        try:
            return decode_snapshot(reply.result())
        except (NoScript, ReplyError):
            return None

    async def snapshot(self, key: str, initial: str, *, now_ms: int, cap: int) -> model.KeySnapshot:
        """The data for one superseding query (``cap`` < 0: every pending task)."""
        soon = self.snapshot_soon(key, initial, now_ms=now_ms, cap=cap)
        if soon is not None:
            try:
                return decode_snapshot(await soon)
            except (NoScript, ReplyError):
                pass  # fall back to redis-py, which reloads scripts (and raises real errors)
        t, p, w, d, _ = keys.group(key)
        try:
            async with asyncio.timeout(self.query_timeout):
                (raw,) = await self.pipeline(
                    lambda pipe: self.eval(pipe, "snapshot", (t, p, w, d), initial, now_ms, cap)
                )
        except TimeoutError as exc:
            raise StoreUnavailable(
                f"Redis did not answer within {self.query_timeout:g} s", reason="timeout"
            ) from exc
        return decode_snapshot(raw)

    async def pending(self, key: str, *, now_ms: int, limit: int = 1000) -> list[views.TaskRecord]:
        """A key's pending tasks, oldest first, with what the index knows of each."""
        (raw,) = await self.pipeline(
            lambda pipe: self.eval(pipe, "inspect", keys.group(key)[:4], now_ms, limit)
        )
        items = [v.decode() if isinstance(v, bytes) else v for v in raw]
        return [
            views.parse_record(items[i], items[i + 1])
            for i in range(0, len(items), 2)
            if items[i + 1]
        ]

    async def known(self, key: str, task_ids: Iterable[str]) -> dict[str, views.TaskRecord]:
        """What the index holds for ``task_ids`` under ``key`` (any state)."""
        ids = list(task_ids)
        if not ids:
            return {}
        (records,) = await self.pipeline(lambda pipe: pipe.hmget(keys.group(key)[0], ids))
        return {
            tid: views.parse_record(tid, rec.decode())
            for tid, rec in zip(ids, records, strict=True)
            if rec is not None
        }

    async def all_known(self, key: str) -> dict[str, views.TaskRecord]:
        (records,) = await self.pipeline(lambda pipe: pipe.hgetall(keys.group(key)[0]))
        return {
            tid.decode(): views.parse_record(tid.decode(), rec.decode())
            for tid, rec in records.items()
        }

    async def history(self, key: str) -> list[list[str]]:
        """Recent answers and resolutions for ``key``, newest first, as split log entries."""
        (raw,) = await self.pipeline(lambda pipe: pipe.lrange(keys.log(key), 0, LOG_LENGTH - 1))
        return [entry.decode().split("|", 5) for entry in raw]

    async def keys(self, *, since_ms: int = 0) -> list[tuple[str, int]]:
        """Every known coalescing key with its last activity (ms), most recent first: O(keys),
        for the commands and the enforcer; the pages read pages of keys (:mod:`.keyset`)."""
        (raw,) = await self.pipeline(
            lambda pipe: pipe.zrevrangebyscore(keys.KEYS_INDEX, "+inf", since_ms, withscores=True)
        )
        return [(k.decode(), int(score)) for k, score in raw]

    async def pending_counts(
        self, key_names: Sequence[str], *, now_ms: int | None = None
    ) -> dict[str, int]:
        """Pending tasks per key whose deadline has not passed, in one round trip."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        if not key_names:
            return {}
        counts = await self.pipeline(
            lambda pipe: [pipe.zcount(keys.group(k)[3], f"({now}", "+inf") for k in key_names]
        )
        return dict(zip(key_names, map(int, counts), strict=True))

    async def forget(self, key: str, task_ids: Sequence[str]) -> int:
        """Drop ``task_ids`` from ``key`` entirely (the queue no longer knows them), atomically;
        returns how many the index held."""
        if not task_ids:
            return 0
        (held,) = await self.pipeline(
            lambda pipe: self.eval(pipe, "forget", keys.group(key), *task_ids)
        )
        return int(held)

    async def stats(self) -> dict[str, str]:
        (raw,) = await self.pipeline(lambda pipe: pipe.hgetall(keys.STATS))
        return {k.decode(): v.decode() for k, v in raw.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class IndexState:
    """The index's marker: ``ok`` once rebuilt from the queue, ``lost`` from ``since_ms``, when
    the store was found without it (new, or emptied); ``created``: found missing just now."""

    state: str
    since_ms: int
    rebuilt_ms: int | None
    created: bool

    @classmethod
    def decode(cls, raw: list[Any]) -> IndexState:
        state, since, rebuilt = (v.decode() if isinstance(v, bytes) else str(v) for v in raw[:3])
        return cls(state, int(since or 0), int(rebuilt) if rebuilt else None, bool(int(raw[3])))


def by_key(events: Sequence[model.TaskEvent]) -> dict[str, list[int]]:
    """Each coalescing key's events, as their indexes in ``events``, in order."""
    out: dict[str, list[int]] = {}
    for i, ev in enumerate(events):
        for key in ev.keys:
            out.setdefault(key, []).append(i)
    return out


def apply_calls(
    per_key: Mapping[str, list[int]], *, alone: Container[str] = ()
) -> list[tuple[str, list[int]]]:
    """``apply.lua`` calls for :func:`by_key`'s events: ``(key, indexes)``, one per key for up
    to :data:`APPLY_BATCH` of its events, in order (a key in ``alone``: one per event)."""
    calls: list[tuple[str, list[int]]] = []
    for key, indexes in per_key.items():
        step = 1 if key in alone else APPLY_BATCH
        calls.extend((key, indexes[j : j + step]) for j in range(0, len(indexes), step))
    return calls


def apply_keys(key: str) -> tuple[str, ...]:
    """``apply.lua``'s KEYS for coalescing key ``key`` (see its header)."""
    return (*keys.group(key), keys.resolutions(key))


def apply_args(
    events: Sequence[model.TaskEvent],
    now_ms: int,
    grace_ms: int,
    log_length: int,
    *,
    new_key: bool = True,
    new_tasks: int | None = None,
) -> list[Any]:
    """``apply.lua``'s ARGV for ``events`` of one key (see its header): ``new_tasks``, how
    many tasks new to the key it may add (``None``: all)."""
    room = len(events) if new_tasks is None else new_tasks
    args: list[Any] = [now_ms, grace_ms, log_length, int(new_key), room]
    for ev in events:
        args += (
            ev.task_id,
            ev.run_id,
            model.STATE_RANK_NUMBERS[ev.state],
            ev.state,
            repr(ev.order),
            ev.deadline_ms,
            ev.pending_since_ms,
            ev.reason,
        )
    return args


def _script(name: str, embedded: bool) -> str:
    source = resources.files(__package__).joinpath("scripts", f"{name}.lua").read_text()
    if embedded and source.startswith("#!"):
        # The embedded store runs scripts without flags (and never runs out of memory).
        source = source.split("\n", 1)[1]
    return source


class _Commands:
    """Stands in for a redis-py pipeline and records the commands queued on it, for the lean
    writer: ``pipe.lpush(name, *values)`` queues ``("LPUSH", name, *values)``. Positional
    arguments only, as the store's batched writes pass them, but for ``zadd``'s mapping."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def zadd(self, name: str, mapping: dict[str, float]) -> None:
        pairs = [a for member, score in mapping.items() for a in (score, member)]
        self.commands.append(("ZADD", name, *pairs))

    def __getattr__(self, name: str) -> Callable[..., None]:
        def queue(*args: Any) -> None:
            self.commands.append((name.upper(), *args))

        return queue


class _Folded:
    """How a batch's events came out, folded from its ``apply.lua`` replies: an event's
    outcome under its keys is the highest (:data:`_PRECEDENCE`)."""

    def __init__(self, count: int) -> None:
        self.outcomes: list[Outcome] = ["ignored"] * count
        #: Events with a key whose script did not run.
        self.failed: set[int] = set()
        self.new_tasks = self.refused_keys = self.refused_tasks = 0

    def add(self, indexes: Sequence[int], reply: Any) -> None:
        """One ``apply.lua`` call's ``reply`` for the events at ``indexes``."""
        if isinstance(reply, Exception):
            self.failed.update(indexes)
            return
        for i, raw in zip(indexes, reply, strict=True):
            got = raw.decode() if isinstance(raw, bytes) else str(raw)
            if got == "added":
                got = "applied"
                self.new_tasks += 1
            elif got == "limited":
                self.refused_tasks += 1
            elif got == "limited-key":
                got = "limited"
                self.refused_keys += 1
            if _PRECEDENCE[got] > _PRECEDENCE[self.outcomes[i]]:
                self.outcomes[i] = cast(Outcome, got)


def _counts(raw: list[Any]) -> tuple[int, int]:
    """``list.lua``'s answer: keys listed, tasks tracked."""
    return int(raw[0]), int(raw[1])


def decode_snapshot(raw: list[Any]) -> model.KeySnapshot:
    joined = raw[4]
    ids = (joined.decode() if isinstance(joined, bytes) else joined).split()
    newer = int(raw[2])
    return model.KeySnapshot(
        pending=int(raw[0]),
        oldest_since_ms=None if raw[1] is None else int(float(raw[1])),
        newest=ids,
        newer=None if newer < 0 else newer,
        initial_resolved=int(raw[3]) == model.Rank.RESOLVED,
    )


async def open_store(
    redis_url: str | None, *, grace_seconds: int, query_timeout: float = 2.0
) -> Store:
    """Connect to ``redis_url`` (standalone Redis or a Redis Cluster, told apart by asking it),
    or to an embedded in-process store when it is ``None``. A query waits ``query_timeout``
    seconds for Redis at most."""
    grace_ms = grace_seconds * 1000
    if redis_url is None:
        from coalescer.store.embedded import embedded_client

        store = Store(
            embedded_client(), grace_ms=grace_ms, embedded=True, query_timeout=query_timeout
        )
    elif await _is_cluster(redis_url):
        # Every script touches one key's hash slot (keys.py), so each call goes whole to the
        # node that owns it: writes through per-node pipelines, queries through a lean
        # connection per node.
        cluster = aioredis.RedisCluster.from_url(
            redis_url, socket_connect_timeout=5, socket_timeout=10, max_connections=POOL_SIZE
        )
        router = (
            ClusterRouter(cluster, redis_url, timeout=query_timeout)
            if PipelinedClient.supports(redis_url)
            else None
        )
        store = Store(
            cast(aioredis.Redis, cluster),
            grace_ms=grace_ms,
            nodes=NodeClients(redis_url),
            fast=router,
            query_timeout=query_timeout,
        )
        log.info("REDIS_URL is a Redis Cluster")
    else:
        client = aioredis.Redis.from_url(
            redis_url,
            socket_connect_timeout=5,
            socket_timeout=10,
            health_check_interval=30,
            max_connections=POOL_SIZE,  # no more in use at once: see Store.admission
            # A pooled connection may be one that a restarted Redis closed: one retry on a new
            # connection (never after a timeout: a frozen Redis must be an error soon).
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        )
        lean = PipelinedClient.supports(redis_url)
        store = Store(
            client,
            grace_ms=grace_ms,
            fast=PipelinedClient(redis_url, timeout=query_timeout) if lean else None,
            # Background batches wait as long as redis-py's commands do (socket_timeout).
            writer=PipelinedClient(redis_url, timeout=10) if lean else None,
            query_timeout=query_timeout,
        )
    try:
        await store.load_scripts()
    except StoreUnavailable:
        log.warning("store not reachable at start; will retry on first use")
    return store


async def _is_cluster(redis_url: str) -> bool:
    probe = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        info = await probe.info("cluster")
    except redis.exceptions.RedisError as exc:
        log.warning("could not ask REDIS_URL whether it is a Cluster (%s): assuming not", exc)
        return False
    finally:
        await probe.aclose()
    return bool(info.get("cluster_enabled"))
