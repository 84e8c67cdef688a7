"""The store's side of superseding policies: decisions, the outbox and leases (lineage is
read by :mod:`coalescer.store.lineage`).

Decisions are taken by ``decide.lua`` inside the key's hash slot, in the same round trip as the
event they follow (:meth:`Store.apply` with a policy) or on a tick. Each decision is written
twice: as lineage (``co:{K}:v``) and as an entry of the key's outbox stream, which
``coalescer enforce`` consumes with a consumer group; ``settle.lua`` records what was done and
acknowledges the entry in one step, so an entry is either pending (and will be carried out
again, harmlessly) or done. On a Cluster, a step the enforcer takes (a settle, a reservation, a
search step) is done only once a replica holds it: the queue calls that follow act on it, and a
failover must not take it back. See :mod:`coalescer.store.keys` for the layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from coalescer import model
from coalescer.errors import StoreRejected
from coalescer.store import keys
from coalescer.store.base import Pipelining

#: Most decisions one script call takes; the rest follow on the next event or tick.
MAX_DECISIONS = 256


class KeyPolicy(Protocol):
    """What :meth:`Store.apply` needs of a policy (``coalescer.policy.rules.Policy``)."""

    def script_args(self, key: str) -> Sequence[str | int] | None: ...


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def queue_decide(
    store: Pipelining,
    pipe: Any,
    key: str,
    rule_args: Sequence[str | int],
    now_ms: int,
    event: model.TaskEvent | None = None,
) -> None:
    """Queue one ``decide.lua`` call on ``pipe`` (after ``event``'s ``apply.lua``, if any)."""
    store.eval(
        pipe,
        "decide",
        (*keys.group(key), *keys.policy(key), keys.searches(key)),
        now_ms,
        store.grace_ms,
        *rule_args,
        "" if event is None else event.task_id,
        0 if event is None else event.started_ms,
        0 if event is None else event.resolved_ms,
        MAX_DECISIONS,
    )


async def tick(
    store: Pipelining, rules: Mapping[str, Sequence[str | int]], *, now_ms: int
) -> dict[str, int]:
    """Run ``decide.lua`` without an event on each key (thresholds that time made due, events
    that were lost); keys left with outbox work are (re)listed for the enforcer. Returns the
    decisions taken per key."""
    if not rules:
        return {}
    names = list(rules)

    def fill(pipe: Any) -> None:
        for key in names:
            queue_decide(store, pipe, key, rules[key], now_ms)

    replies = await store.pipeline(fill)
    busy = {k: now_ms for k, (_, work) in zip(names, replies, strict=True) if int(work)}
    if busy:
        # Not atomic with the decisions, and need not be: the next tick lists them again.
        await store.pipeline(lambda pipe: pipe.zadd(keys.OUTBOX, busy))
    return {k: int(made) for k, (made, _) in zip(names, replies, strict=True)}


# -- the outbox -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One outbox entry: a decision for the enforcer to carry out.

    ``action`` is ``supersede`` (resolve a pending victim now), ``hold`` (claim it and keep it
    until the primary ends), ``cancel`` (a running victim), or, for a held victim once its
    primary ended, ``supersede`` or ``release``.
    """

    id: str
    key: str
    action: str
    victim: str
    run: int
    primary: str
    primary_run: int
    rule: str
    reason: str
    cascade: str
    protect_ms: int
    supersede_running: bool

    @classmethod
    def parse(cls, key: str, entry_id: Any, fields: Mapping[Any, Any]) -> Entry:
        f = {_text(k): _text(v) for k, v in fields.items()}
        return cls(
            id=_text(entry_id),
            key=key,
            action=f["a"],
            victim=f["v"],
            run=int(f["r"]),
            primary=f["p"],
            primary_run=int(f["pr"]),
            rule=f["rule"],
            reason=f["why"],
            cascade=f["c"],
            protect_ms=int(f["pt"]),
            supersede_running=f["sr"] == "1",
        )


async def work(store: Pipelining, *, limit: int = 1000) -> list[tuple[str, float]]:
    """Keys that may have outbox work, with the score that listed them (oldest first)."""
    (raw,) = await store.pipeline(
        lambda pipe: pipe.zrange(keys.OUTBOX, 0, limit - 1, withscores=True)
    )
    return [(_text(k), float(s)) for k, s in raw]


async def outstanding(store: Pipelining, names: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``(outbox entries, held victims and bisections under way)`` per key, in one round
    trip."""
    if not names:
        return {}

    def fill(pipe: Any) -> None:
        for key in names:
            _, _, _, _, _, o, h, _, _ = keys.policy(key)
            pipe.xlen(o)
            pipe.zcard(h)
            pipe.hlen(keys.searches(key))

    raw = await store.pipeline(fill)
    return {
        k: (int(raw[3 * i]), int(raw[3 * i + 1]) + int(raw[3 * i + 2])) for i, k in enumerate(names)
    }


async def idle(store: Pipelining, key: str, seen: float) -> bool:
    """Unlist ``key`` unless it was listed again after the enforcer saw ``seen``."""
    (done,) = await store.pipeline(
        lambda pipe: store.eval(pipe, "idle", (keys.OUTBOX,), key, repr(seen))
    )
    return bool(done)


async def lease(store: Pipelining, key: str, mode: str, holder: str, ttl_ms: int) -> bool:
    """Acquire, renew or release the key's enforcer lease (``mode``); True when held."""
    (got,) = await store.pipeline(
        lambda pipe: store.eval(pipe, "lease", (keys.lease(key),), mode, holder, ttl_ms)
    )
    return bool(got)


async def read(store: Pipelining, key: str, consumer: str, *, count: int = 64) -> list[Entry]:
    """The key's outbox entries for ``consumer``, oldest first: every entry still pending in
    the group (a dead enforcer's included: the caller holds the key's lease, so nobody else is
    working on them), then new ones."""
    stream = keys.policy(key)[5]
    group = keys.OUTBOX_GROUP

    def fill(pipe: Any) -> None:
        # XAUTOCLAIM first: without the group, its NOGROUP is the error the pipeline raises
        # (the embedded store's XREADGROUP words it otherwise while the stream does not exist).
        pipe.xautoclaim(stream, group, consumer, 0, "0-0", count=count)
        pipe.xreadgroup(group, consumer, {stream: ">"}, count=count)

    try:
        claimed, fresh = await store.pipeline(fill)
    except StoreRejected as exc:
        if "NOGROUP" not in str(exc):
            raise
        await _create_group(store, stream)
        claimed, fresh = await store.pipeline(fill)
    found: dict[str, Entry] = {}
    for entry_id, fields in claimed[1]:
        if fields:
            found[_text(entry_id)] = Entry.parse(key, entry_id, fields)
    if _text(claimed[0]) not in ("0-0", "0"):
        # More pending than one batch: the new entries (now pending too) wait their turn.
        return sorted(found.values(), key=_entry_order)
    # RESP2: [[stream, entries]]; RESP3: {stream: entries}.
    streams = list(fresh.values()) if isinstance(fresh, dict) else [s[1] for s in fresh or []]
    for entries in streams:
        for entry_id, fields in entries:
            if fields:
                found[_text(entry_id)] = Entry.parse(key, entry_id, fields)
    return sorted(found.values(), key=_entry_order)


def _entry_order(entry: Entry) -> tuple[int, ...]:
    return tuple(map(int, entry.id.split("-")))


async def _create_group(store: Pipelining, stream: str) -> None:
    try:
        await store.pipeline(
            lambda pipe: pipe.xgroup_create(stream, keys.OUTBOX_GROUP, id="0", mkstream=True)
        )
    except StoreRejected as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def ack(store: Pipelining, key: str, entry_id: str) -> None:
    """Acknowledge and delete an entry that needs nothing done (its decision moved on)."""
    stream = keys.policy(key)[5]
    await store.pipeline(
        lambda pipe: (pipe.xack(stream, keys.OUTBOX_GROUP, entry_id), pipe.xdel(stream, entry_id))
    )


async def held_due(store: Pipelining, key: str, now_ms: int, *, limit: int = 64) -> list[str]:
    """Held victims whose claim is due for renewal."""
    h = keys.policy(key)[6]
    (raw,) = await store.pipeline(
        lambda pipe: pipe.zrangebyscore(h, "-inf", now_ms, start=0, num=limit)
    )
    return [_text(v) for v in raw]


async def settle(
    store: Pipelining,
    key: str,
    victim: str,
    *,
    expected: Sequence[str],
    new: str,
    now_ms: int,
    rule: str,
    entry_id: str = "",
    due_ms: int = 0,
    saved: str = "",
    started_ms: int = 0,
    definition: str = "",
    cascaded: Sequence[str] = (),
    resolution: tuple[str, str] | None = None,
    offer: bool = False,
) -> tuple[bool, int]:
    """Move ``victim`` from one of ``expected`` states to ``new`` and acknowledge ``entry_id``
    (see ``settle.lua``); returns whether the state changed and the milliseconds saved.
    ``resolution``: how the victim's run was ended, and why, for its lineage. ``offer``: it was
    released in the run it was held in, pending still: the index offers it again."""
    (raw,) = await store.pipeline(
        lambda pipe: store.eval(
            pipe,
            "settle",
            keys.settled(key),
            entry_id,
            keys.OUTBOX_GROUP,
            victim,
            ",".join(expected),
            new,
            now_ms,
            due_ms,
            rule,
            saved,
            started_ms,
            definition,
            ",".join(cascaded),
            "|".join(resolution) if resolution else "",
            "1" if offer else "",
        ),
        replicated=True,
    )
    return bool(int(raw[0])), int(raw[1])


# -- bisections under way ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One victim's lineage change in a search step (see ``settle.lua``'s ``search`` mode):
    from state ``was`` to ``new``; ``action``, ``by`` and ``reason`` kept when empty; with
    ``emit``, an outbox entry for ``action`` follows (a supersede or a release to carry out)."""

    victim: str
    was: str
    new: str
    action: str = ""
    by: str = ""
    by_run: int = 0
    reason: str = ""
    emit: bool = False


async def searches(store: Pipelining, key: str) -> dict[str, str]:
    """The key's bisections under way: failed primary → its record (JSON text)."""
    (raw,) = await store.pipeline(lambda pipe: pipe.hgetall(keys.searches(key)))
    return {_text(k): _text(v) for k, v in raw.items()}


async def reserve(
    store: Pipelining,
    key: str,
    task_id: str,
    *,
    run: int,
    by: str,
    rule: str,
    reason: str,
    now_ms: int,
    expire_ms: int,
    undo: bool = False,
) -> bool:
    """Take ``task_id`` of ``key`` for the search after ``by``, which runs it again (its run
    ``run`` is coming): ``probing``, hidden from decisions until the lineage expires at
    ``expire_ms``. False while a decision about it is under way. With ``undo``, give it
    back (``ran``): False when it was not the search's (see ``settle.lua``'s ``reserve``)."""
    args = ["reserve", task_id, run, by, rule, reason, now_ms, expire_ms, int(undo)]
    (raw,) = await store.pipeline(
        lambda pipe: store.eval(pipe, "settle", keys.settled(key), *args), replicated=True
    )
    return bool(int(raw[0]))


async def search_step(
    store: Pipelining,
    key: str,
    primary: str,
    *,
    expected: str,
    record: str | None,
    now_ms: int,
    moves: Sequence[Move] = (),
    cascade: str = "cancel",
    protect_ms: int = -1,
    supersede_running: bool = False,
) -> bool:
    """Replace ``primary``'s search record ``expected`` by ``record`` (None: the search is
    over) and make ``moves``, atomically; False, changing nothing, when the record is no longer
    ``expected`` (the step was taken already)."""
    args: list[str | int] = [
        "search",
        primary,
        expected,
        record or "",
        now_ms,
        cascade,
        protect_ms,
        int(supersede_running),
    ]
    for m in moves:
        args += [m.victim, m.was, m.new, m.action, m.by, m.by_run, m.reason, int(m.emit)]
    (raw,) = await store.pipeline(
        lambda pipe: store.eval(pipe, "settle", keys.settled(key), *args), replicated=True
    )
    return bool(int(raw[0]))
