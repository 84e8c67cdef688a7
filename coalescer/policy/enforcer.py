"""``coalescer enforce``: carries out the decisions in the keys' outboxes.

One round: list the keys that may have work (``co:outbox``); for each, take the key's lease
(one enforcer per key at a time, so a key's decisions are carried out in order), read its
outbox through the consumer group — first every entry still pending (a dead enforcer's
included), then new ones — carry each out, record the result and acknowledge the entry in one
atomic step, then renew the claims on held victims. Any number of enforcers can run: they split
the keys. A killed enforcer's entries stay pending in the group and are taken over once its
lease expires; every action is idempotent, so finishing a half-done one is harmless.

Every ``tick`` seconds the enforcer also re-evaluates every deciding key without an event: age
thresholds become due with time, and events can be lost.

:func:`connect` builds an enforcer acting on a queue, for ``coalescer enforce`` and for
``coalescer serve`` on the embedded store (:mod:`coalescer.policy.embedded`) alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import orjson
from prometheus_client import Counter
from taskcluster.exceptions import TaskclusterFailure

from coalescer.concurrency import all_ended
from coalescer.errors import StoreUnavailable
from coalescer.policy.actions import Actions, QueueActions, Result
from coalescer.policy.bisecting import Searcher
from coalescer.policy.record import victims
from coalescer.policy.rules import HoldBy, Policy
from coalescer.store import Store
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.worker.claims import Clock, Connection, utcnow
from coalescer.worker.protocol import SupersedeAs

log = logging.getLogger("coalescer.policy")

# By rule, not by key: a label per coalescing key would make a series per key (up to
# COALESCER_MAX_KEYS); the per-key figures are on the pages and GET /v1/policy.
ACTIONS = Counter(
    "coalescer_enforcer_actions",
    "Superseding decisions this enforcer carried out, by rule and result",
    ["rule", "result"],
)
SAVED = Counter(
    "coalescer_enforcer_saved_seconds",
    "Worker time this enforcer saved (estimated from each key's recent run durations), by rule",
    ["rule"],
)
#: Lineage states from which each kind of entry may move a victim.
_INITIAL = ("decided",)
_SETTLING = ("settling",)
#: States of a primary that is itself being replaced.
_REPLACED = ("decided", "settling", "held", "superseded", "canceled")
#: Runs at most whose logs are rewritten to name a new final primary (a chain's victims).
MAX_RESTATED = 256


def default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@contextlib.asynccontextmanager
async def connect(
    store: Store,
    root_url: str,
    creds: Mapping[str, str],
    *,
    policy: Policy | None,
    worker_group: str = "coalescer",
    worker_id: str = "enforcer",
    supersede_as: SupersedeAs = SupersedeAs.AUTO,
    public_url: str | None = None,
    route_prefix: str = "coalesce.v1",
    rank_tag: str | None = None,
    consumer: str | None = None,
    lease_ms: int = 60_000,
    poll: float = 1.0,
    tick: float = 10.0,
    concurrency: int = 8,
) -> AsyncIterator[Enforcer]:
    """An :class:`Enforcer` acting on the queue at ``root_url`` with ``creds``; its HTTP
    sessions are open inside the ``async with`` block."""
    import aiohttp
    import httpx
    import taskcluster.aio

    options: dict[str, object] = {"rootUrl": root_url, "maxRetries": 5}
    if creds:
        options["credentials"] = dict(creds)
    async with aiohttp.ClientSession() as session, httpx.AsyncClient() as http:
        actions = Actions(
            taskcluster.aio.Queue(options, session=session),
            Connection(root_url, session),
            http,
            worker_group=worker_group,
            worker_id=worker_id,
            supersede_as=supersede_as,
            public_url=public_url,
            route_prefix=route_prefix,
            rank_tag=rank_tag,
        )
        yield Enforcer(
            store,
            actions,
            policy=policy,
            consumer=consumer,
            lease_ms=lease_ms,
            poll=poll,
            tick=tick,
            concurrency=concurrency,
        )


class Enforcer:
    """Consumes outboxes until stopped. ``clock`` is the queue's time (tests drive it);
    ``known_since``: see :class:`~coalescer.policy.bisecting.Searcher`."""

    def __init__(
        self,
        store: Store,
        actions: QueueActions,
        *,
        policy: Policy | None = None,
        consumer: str | None = None,
        lease_ms: int = 60_000,
        poll: float = 1.0,
        tick: float = 10.0,
        concurrency: int = 8,
        clock: Clock = utcnow,
        known_since: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.store = store
        self.actions = actions
        self.policy = policy
        self.consumer = consumer or default_consumer()
        self.lease_ms = lease_ms
        self.poll = poll
        self.tick_every = tick
        self.clock = clock
        self._bound = asyncio.Semaphore(max(1, concurrency))
        self._next_tick = 0.0
        self.searcher = Searcher(store, actions, self._now_ms, known_since, self._parks)

    def _now_ms(self) -> int:
        return int(self.clock().timestamp() * 1000)

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds until ``stop`` is set; a round that found nothing waits ``poll`` seconds."""
        while not stop.is_set():
            try:
                done = await self.round()
            except StoreUnavailable as exc:
                log.warning("store unavailable, retrying: %s", exc)
                done = 0
            if not done:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll)

    async def round(self) -> int:
        """One pass over every key with work; returns how many entries and renewals it did."""
        loop = asyncio.get_running_loop()
        if self.policy is not None and self.policy.decides and loop.time() >= self._next_tick:
            self._next_tick = loop.time() + self.tick_every
            await self.tick()
        listed = await outbox.work(self.store)
        counts = await outbox.outstanding(self.store, [k for k, _ in listed])
        busy = []
        for key, seen in listed:
            if counts[key] == (0, 0):
                await outbox.idle(self.store, key, seen)
            else:
                busy.append(key)
        # Every key's round ends before this one does, even when another's store calls fail (a
        # Cluster node failing over): a key's round left running would have its pending entries
        # taken up again by the next round, under the same lease (the same consumer), and its
        # actions carried out twice at once.
        return sum(await all_ended(*(self._bounded(self.key_round(k)) for k in busy)))

    async def tick(self) -> int:
        """Re-evaluate every deciding key without an event."""
        assert self.policy is not None
        rules = {}
        for key, _ in await self.store.keys():
            args = self.policy.script_args(key)
            if args is not None:
                rules[key] = args
        made = await outbox.tick(self.store, rules, now_ms=self._now_ms())
        return sum(made.values())

    async def _bounded(self, work: Awaitable[int]) -> int:
        async with self._bound:
            return await work

    async def key_round(self, key: str) -> int:
        """Carry out ``key``'s outbox in order, then renew its held claims, under its lease."""
        if not await outbox.lease(self.store, key, "acquire", self.consumer, self.lease_ms):
            return 0
        done = 0
        try:
            for entry in await outbox.read(self.store, key, self.consumer):
                await self.handle(entry)
                done += 1
                if not await outbox.lease(self.store, key, "renew", self.consumer, self.lease_ms):
                    return done  # too slow: another enforcer owns the key now
            due = await outbox.held_due(self.store, key, self._now_ms())
            searched = await self._searched(key) if due else set()
            for victim in due:
                await self._renew(key, victim, searched)
                done += 1
            for primary in await outbox.searches(self.store, key):
                done += await self.searcher.carry_on(key, primary)
        except (TaskclusterFailure, OSError) as exc:
            # The queue is unreachable or refused: the entry stays pending, retried next round.
            log.warning("enforcing %s stopped for this round: %s", key, exc)
        except StoreUnavailable:
            raise
        except Exception:
            # A bug must not stop the other keys; this entry stays pending and is retried.
            log.exception("enforcing %s failed; retrying next round", key)
        finally:
            with contextlib.suppress(StoreUnavailable):
                await outbox.lease(self.store, key, "release", self.consumer, 0)
        return done

    async def handle(self, entry: outbox.Entry) -> Result | None:
        """Carry out one entry and settle it; None when it was stale (only acknowledged)."""
        current = await records.decision(self.store, entry.key, entry.victim)
        if current is None or current.run != entry.run or current.action != entry.action:
            stale = True
        elif current.state in _INITIAL:
            stale = current.by != entry.primary  # decided anew since (after a release)
        else:
            stale = current.state not in _SETTLING
        if stale or current is None:
            await outbox.ack(self.store, entry.key, entry.id)
            return None
        if current.state in _INITIAL:
            entry = await self._final(entry)
        parks = self._parks(entry.rule)
        act: dict[str, Callable[[outbox.Entry], Awaitable[Result]]] = {
            "supersede": self.actions.supersede,
            "hold": self.actions.park if parks else self.actions.hold,
            "cancel": self.actions.cancel,
            "release": self.actions.release,
        }
        if entry.action not in act:
            log.error("unknown outbox action %r for %s: skipped", entry.action, entry.victim)
            result = Result("gone")
        elif entry.action == "release" and parks:
            result = await self.actions.release(
                entry, await self._own_priority(entry.key, entry.victim)
            )
        else:
            result = await act[entry.action](entry)
        changed, saved = await outbox.settle(
            self.store,
            entry.key,
            entry.victim,
            expected=[current.state],
            new=result.state,
            now_ms=self._now_ms(),
            rule=entry.rule,
            entry_id=entry.id,
            due_ms=result.due_ms,
            saved=result.saved,
            started_ms=result.started_ms,
            definition=result.definition,
            cascaded=result.cascaded,
            resolution=None if (r := result.resolution) is None else (r.how, r.why),
            offer=result.offer,
        )
        if not changed and result.state == "held":
            # The decision moved on while we claimed (cannot happen under the lease, unless it
            # expired mid-action): give the run back rather than keep it forever.
            own = orjson.loads(result.definition or "{}").get("priority")
            await self.actions.release(entry, own if parks else None)
        if changed:
            ACTIONS.labels(entry.rule, result.state).inc()
            if result.state == "missed":  # once: a repeat of the entry finds it settled
                log.info(
                    "%s missed: worker %s claimed it before it could be superseded by %s (rule %s)",
                    entry.victim,
                    result.winner or "unknown",
                    entry.primary,
                    entry.rule,
                )
            if saved:
                SAVED.labels(entry.rule).inc(saved / 1000)
            if result.state in ("superseded", "canceled"):
                await self._restate(entry)
        return result

    async def _restate(self, entry: outbox.Entry) -> None:
        """``entry.victim`` was just superseded (for ``entry.primary``, the end of its chain):
        the runs ended earlier for it, and for those it stood for in turn, name that final
        primary now, in their logs and ``superseded-by.json``. Only the queue's real runs
        have logs (:class:`Actions`); best effort."""
        if not isinstance(self.actions, Actions):
            return
        final = (entry.primary, entry.primary_run)
        todo, seen = [entry.victim], {entry.victim, entry.primary}
        while todo and len(seen) < MAX_RESTATED:
            try:
                _, theirs = await records.lineage(self.store, [entry.key], todo.pop(0))
            except StoreUnavailable:
                return
            for decision in theirs:
                if decision.task_id in seen or decision.state not in ("superseded", "canceled"):
                    continue
                seen.add(decision.task_id)
                todo.append(decision.task_id)
                await self.actions.restate(decision, final)

    def _parks(self, rule: str) -> bool:
        """Whether the rule named ``rule`` holds victims pending at the lowest priority."""
        return self.policy is not None and any(
            r.name == rule and r.hold_by is HoldBy.PRIORITY for r in self.policy.rules
        )

    async def _own_priority(self, key: str, victim: str) -> str | None:
        """``victim``'s priority before it was parked, from the definition kept when it was
        held; None when none was kept."""
        kept = await records.definitions(self.store, key, [victim])
        if victim not in kept:
            return None
        priority = orjson.loads(kept[victim]).get("priority")
        return priority if isinstance(priority, str) else None

    async def _final(self, entry: outbox.Entry) -> outbox.Entry:
        """``entry`` with the end of its primary's chain as the primary: when ``B`` (which
        superseded ``A``) has been superseded by ``C`` meanwhile, ``A``'s superseded-by.json
        names ``C``, whose result will stand for both. The lineage keeps ``A`` by ``B``."""
        seen = {entry.victim}
        while entry.primary not in seen and len(seen) < 16:
            seen.add(entry.primary)
            above = await records.decision(self.store, entry.key, entry.primary)
            if above is None or above.run != entry.primary_run or above.state not in _REPLACED:
                break
            entry = dataclasses.replace(entry, primary=above.by, primary_run=above.by_run)
        return entry

    async def _searched(self, key: str) -> set[str]:
        """The victims of ``key``'s searches under way."""
        return {
            v for raw in (await outbox.searches(self.store, key)).values() for v in victims(raw)
        }

    async def _renew(self, key: str, victim: str, searched: set[str]) -> None:
        """Renew a held victim's claim; ``searched``: the victims of the key's searches, as
        read at the start of the round."""
        current = await records.decision(self.store, key, victim)
        if current is None or current.state not in ("held", "bisecting"):
            return
        # Read again before it is taken for orphaned: a search may have begun since.
        if current.state == "bisecting" and victim not in searched:
            under_way = await outbox.searches(self.store, key)
            if not any(victim in victims(raw) for raw in under_way.values()):
                await self._orphaned(current, under_way.get(current.by))
                return
        own = await self._own_priority(key, victim) if self._parks(current.rule) else None
        result = await self.actions.renew(victim, own)
        await outbox.settle(
            self.store,
            key,
            victim,
            expected=[current.state],
            new=current.state if result.state == "held" else result.state,
            now_ms=self._now_ms(),
            rule=current.rule,
            due_ms=result.due_ms,
        )

    async def _orphaned(self, current: records.Decision, record: str | None) -> None:
        """``current`` is held for a bisection, but no search under way has it among its
        victims, however its search came to end without moving it: none will end its hold,
        and renewing it would keep its run from every worker for good. Released
        (a new run, which a worker runs), once: the move applies only while it is still
        ``bisecting``, and no search takes a victim that is. ``record``: the record of a
        search after ``current.by``, if there is one, left as it is (the compare-and-set is
        on it)."""
        move = outbox.Move(
            current.task_id,
            "bisecting",
            "settling",
            "release",
            reason="no bisection under way holds it: it runs itself",
            emit=True,
        )
        if await outbox.search_step(
            self.store,
            current.key,
            current.by,
            expected=record or "",
            record=record,
            now_ms=self._now_ms(),
            moves=[move],
        ):
            log.warning(
                "%s was held for a bisection, but none under way holds it: released to run itself",
                current.task_id,
            )
