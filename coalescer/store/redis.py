"""The store's domain actions on Redis: apply events, read a key's snapshot, list keys, stats.

Every action is one round trip. Writes for one coalescing key happen in one Lua script (see
``scripts/``); Redis errors become :class:`~coalescer.errors.StoreUnavailable`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from importlib import resources
from typing import Any, Literal, TypeVar, cast

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from coalescer import keyset, model
from coalescer.errors import StoreUnavailable
from coalescer.store import keys, views
from coalescer.store.cluster import ClusterPipeline, ClusterRouter, NodeClients
from coalescer.store.pipelined import NoScript, PipelinedClient, ReplyError
from coalescer.store.policy import KeyPolicy, queue_decide

log = logging.getLogger(__name__)

Outcome = Literal["applied", "stale", "expired", "ignored"]
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
    "list",
    "unlist",
)
#: How many resolutions and answers each key remembers for the pages.
LOG_LENGTH = 50


class Store:
    """Async access to the index. Build one with :func:`open_store`."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        grace_ms: int,
        embedded: bool = False,
        fast: PipelinedClient | ClusterRouter | None = None,
        nodes: NodeClients | None = None,
    ) -> None:
        self.client = client
        self.fast = fast
        self.nodes = nodes  # set on a Redis Cluster
        self.grace_ms = grace_ms
        self.embedded = embedded
        self._sha: dict[str, str] = {}
        self._source = {
            name: resources.files(__package__).joinpath("scripts", f"{name}.lua").read_text()
            for name in _SCRIPTS
        }

    # -- plumbing -------------------------------------------------------------------------
    async def load_scripts(self) -> None:
        for name, source in self._source.items():
            self._sha[name] = await self._guard(self.client.script_load(source))

    async def _guard(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis is unreachable: {exc}") from exc
        except redis.exceptions.BusyLoadingError as exc:
            raise StoreUnavailable("Redis is loading its data set") from exc

    async def _pipeline(self, fill: Callable[[Any], object]) -> list[Any]:
        """Run the commands ``fill`` queues in one round trip, reloading scripts once if Redis
        lost them (restart, ``SCRIPT FLUSH``)."""
        for attempt in (1, 2):
            if not self._sha:
                await self.load_scripts()
            pipe: Any = (
                self.client.pipeline(transaction=False)
                if self.nodes is None
                else ClusterPipeline(cast(RedisCluster, self.client), self.nodes)
            )
            fill(pipe)
            try:
                return await self._guard(pipe.execute(raise_on_error=True))
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                self._sha.clear()
        raise AssertionError("unreachable")

    def _eval(self, pipe: Any, name: str, key_names: Sequence[str], *args: Any) -> None:
        pipe.evalsha(self._sha[name], len(key_names), *key_names, *args)

    async def ping(self) -> bool:
        return bool(await self._guard(self.client.ping()))

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        if self.nodes is not None:
            await self.nodes.close()
        await self.client.aclose()

    # -- writes -----------------------------------------------------------------------------
    async def apply(
        self,
        events: Sequence[model.TaskEvent],
        *,
        now_ms: int | None = None,
        policy: KeyPolicy | None = None,
    ) -> list[Outcome]:
        """Apply events, one script call per (event, key), all in one round trip.

        An event's outcome is ``applied`` if any of its keys took it, else ``stale`` or
        ``expired``. Safe to repeat: versions make every call idempotent.

        With a ``policy``, each call on a key whose rule decides on arrival is followed, in the
        same round trip, by ``decide.lua`` (see :mod:`coalescer.store.policy`); keys without
        such a rule cost exactly what they cost without a policy.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        calls = [(i, key) for i, ev in enumerate(events) for key in ev.keys]
        if not calls:
            return ["ignored"] * len(events)
        deciding: dict[str, list[str | int]] = {}
        if policy is not None:
            for _, key in calls:
                if key not in deciding and (args := policy.script_args(key)) is not None:
                    deciding[key] = list(args)
        # Where each apply.lua result lands among the pipeline's replies.
        positions: list[int] = []
        at = 0
        for _, key in calls:
            positions.append(at)
            at += 2 if key in deciding else 1

        def fill(pipe: Any) -> None:
            for i, key in calls:
                ev = events[i]
                self._eval(
                    pipe,
                    "apply",
                    keys.group(key),
                    ev.task_id,
                    ev.run_id,
                    int(ev.rank),
                    ev.state,
                    repr(ev.order),
                    ev.deadline_ms,
                    ev.pending_since_ms,
                    now,
                    self.grace_ms,
                    ev.reason,
                )
                if key in deciding:
                    queue_decide(self, pipe, key, deciding[key], now, ev)
            # A key is known until the newest deadline plus grace of its tasks (keyset.py).
            expiring: dict[str, int] = {}
            for i, key in calls:
                expires = keyset.expires_ms(events[i].deadline_ms, self.grace_ms)
                if expires > now:
                    expiring[key] = max(expires, expiring.get(key, 0))
            if expiring:
                pairs = [a for item in expiring.items() for a in item]
                self._eval(pipe, "list", (keys.KEYS_INDEX, keys.KEYS_EXPIRY), now, *pairs)
            if deciding:
                pipe.zadd(keys.OUTBOX, {key: now for key in deciding})
            for i, key in calls:
                ev = events[i]
                if ev.rank == model.Rank.RESOLVED:
                    entry = f"{now}|resolved|{ev.task_id}|{ev.run_id}|{ev.state}|{ev.reason}"
                    # Apart from the answers (``log``): a busy key's answers would push them out.
                    pipe.lpush(keys.resolutions(key), entry)
                    pipe.ltrim(keys.resolutions(key), 0, LOG_LENGTH - 1)
                    pipe.pexpire(keys.resolutions(key), ev.deadline_ms + self.grace_ms - now)

        replies = await self._pipeline(fill)
        results = [replies[j] for j in positions]
        outcomes: list[Outcome] = ["ignored"] * len(events)
        for (i, _key), result in zip(calls, results, strict=True):
            got = result.decode() if isinstance(result, bytes) else str(result)
            if got == "applied" or outcomes[i] == "ignored":
                outcomes[i] = cast(Outcome, got)
            elif got == "stale" and outcomes[i] == "expired":
                outcomes[i] = "stale"
        return outcomes

    async def count(self, counters: dict[str, int]) -> None:
        """Add to the service-wide counters shown by ``/v1/stats``."""
        counters = {k: v for k, v in counters.items() if v}
        if counters:
            await self._pipeline(
                lambda pipe: [pipe.hincrby(keys.STATS, k, v) for k, v in counters.items()]
            )

    async def remember_answers(self, answers: Sequence[views.GivenAnswer]) -> None:
        """Log ``(key, initial, answer, reason, at_ms)`` answers for the pages, in one round
        trip; only the newest :data:`LOG_LENGTH` per key are kept, so only those are sent.
        Each listed task also gets a record of the newest answer that listed it (task page)."""
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
                self._eval(
                    pipe,
                    "remember",
                    keys.answered(key),
                    views.ANSWERED_PER_KEY,
                    views.ANSWERED_TTL_MS,
                    *args,
                )

        if per_key:
            await self._pipeline(fill)

    # -- reads ------------------------------------------------------------------------------
    async def snapshot(self, key: str, initial: str, *, now_ms: int, cap: int) -> model.KeySnapshot:
        """The data for one superseding query (``cap`` < 0: every pending task)."""
        t, p, w, d, _ = keys.group(key)
        if self.fast is not None and self._sha:
            try:
                raw = await self.fast.execute(
                    "EVALSHA", self._sha["snapshot"], 4, t, p, w, d, initial, now_ms, cap
                )
                return decode_snapshot(raw)
            except (NoScript, ReplyError):
                pass  # fall back to redis-py, which reloads scripts (and raises real errors)
        (raw,) = await self._pipeline(
            lambda pipe: self._eval(pipe, "snapshot", (t, p, w, d), initial, now_ms, cap)
        )
        return decode_snapshot(raw)

    async def pending(self, key: str, *, now_ms: int, limit: int = 1000) -> list[views.TaskRecord]:
        """A key's pending tasks, oldest first, with what the index knows of each."""
        (raw,) = await self._pipeline(
            lambda pipe: self._eval(pipe, "inspect", keys.group(key)[:4], now_ms, limit)
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
        (records,) = await self._pipeline(lambda pipe: pipe.hmget(keys.group(key)[0], ids))
        return {
            tid: views.parse_record(tid, rec.decode())
            for tid, rec in zip(ids, records, strict=True)
            if rec is not None
        }

    async def all_known(self, key: str) -> dict[str, views.TaskRecord]:
        (records,) = await self._pipeline(lambda pipe: pipe.hgetall(keys.group(key)[0]))
        return {
            tid.decode(): views.parse_record(tid.decode(), rec.decode())
            for tid, rec in records.items()
        }

    async def history(self, key: str) -> list[list[str]]:
        """Recent answers and resolutions for ``key``, newest first, as split log entries."""
        (raw,) = await self._pipeline(lambda pipe: pipe.lrange(keys.log(key), 0, LOG_LENGTH - 1))
        return [entry.decode().split("|", 5) for entry in raw]

    async def keys(self, *, since_ms: int = 0) -> list[tuple[str, int]]:
        """Every known coalescing key with its last activity (ms), most recent first: O(keys),
        for the commands and the enforcer; the pages read pages of keys (:mod:`.keyset`)."""
        (raw,) = await self._pipeline(
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
        counts = await self._pipeline(
            lambda pipe: [pipe.zcount(keys.group(k)[3], f"({now}", "+inf") for k in key_names]
        )
        return dict(zip(key_names, map(int, counts), strict=True))

    async def forget(self, key: str, task_ids: Sequence[str]) -> int:
        """Drop ``task_ids`` from ``key`` entirely (the queue no longer knows them), atomically;
        returns how many the index held."""
        if not task_ids:
            return 0
        (held,) = await self._pipeline(
            lambda pipe: self._eval(pipe, "forget", keys.group(key), *task_ids)
        )
        return int(held)

    async def stats(self) -> dict[str, str]:
        (raw,) = await self._pipeline(lambda pipe: pipe.hgetall(keys.STATS))
        return {k.decode(): v.decode() for k, v in raw.items()}


def decode_snapshot(raw: list[Any]) -> model.KeySnapshot:
    ids = raw[3:]
    if ids and isinstance(ids[0], bytes):
        ids = [v.decode() for v in ids]
    newer = int(raw[2])
    return model.KeySnapshot(
        pending=int(raw[0]),
        oldest_since_ms=None if raw[1] is None else int(float(raw[1])),
        newest=ids,
        newer=None if newer < 0 else newer,
    )


async def open_store(redis_url: str | None, *, grace_seconds: int) -> Store:
    """Connect to ``redis_url`` (standalone Redis or a Redis Cluster, told apart by asking it),
    or to an embedded in-process store when it is ``None``."""
    grace_ms = grace_seconds * 1000
    if redis_url is None:
        from coalescer.store.embedded import embedded_client

        store = Store(embedded_client(), grace_ms=grace_ms, embedded=True)
    elif await _is_cluster(redis_url):
        # Every script touches one key's hash slot (keys.py), so each call goes whole to the
        # node that owns it: writes through per-node pipelines, queries through a lean
        # connection per node.
        cluster = aioredis.RedisCluster.from_url(
            redis_url, socket_connect_timeout=5, socket_timeout=10, max_connections=256
        )
        router = ClusterRouter(cluster, redis_url) if PipelinedClient.supports(redis_url) else None
        store = Store(
            cast(aioredis.Redis, cluster),
            grace_ms=grace_ms,
            nodes=NodeClients(redis_url),
            fast=router,
        )
        log.info("REDIS_URL is a Redis Cluster")
    else:
        client = aioredis.Redis.from_url(
            redis_url,
            socket_connect_timeout=5,
            socket_timeout=10,
            health_check_interval=30,
            max_connections=256,
        )
        fast = PipelinedClient(redis_url) if PipelinedClient.supports(redis_url) else None
        store = Store(client, grace_ms=grace_ms, fast=fast)
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
