"""What the debug pages and ``/metrics`` read: a key, a task, summaries of keys.

None of this is on the query path. Each view is one round trip per step (the task view takes
two: what each key looked at knows of the task, the tasks its answer listed). The records
written for the task page are built here too (:func:`answer_records`), so that their format
lives in one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from coalescer.store import keys
from coalescer.store.base import Pipelining
from coalescer.store.lineage import parse_decision

#: ``(key, initial taskId, answer, reason, at_ms)``: one answer the service gave, as buffered.
GivenAnswer = tuple[str, str, tuple[str, ...], str, int]

#: How many recent answers and resolutions a key page shows (the lists' capped length).
RECENT = 50
#: Tasks per key whose newest answer is remembered; older ones are dropped first.
ANSWERED_PER_KEY = 500
#: A busy key's newest answers in one flush say what matters; older ones in the same second
#: mostly list the same tasks, so they are not unpacked per task (it costs CPU in the web
#: process, which serves queries too).
ANSWERS_PER_KEY_PER_FLUSH = 8
ANSWERED_TTL_MS = 7 * 86_400_000


@dataclasses.dataclass(frozen=True, slots=True)
class TaskRecord:
    """What the index holds for one task under one key (any state)."""

    task_id: str
    run_id: int
    order: float
    deadline_ms: int
    since_ms: int
    state: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """One superseding answer: to the worker holding ``initial``, at ``at_ms``."""

    at_ms: int
    initial: str
    count: int
    reason: str
    task_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class Resolution:
    """A resolution event the service saw (``superseded`` comes as ``exception``)."""

    at_ms: int
    task_id: str
    run_id: int
    state: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Listing:
    """The newest answer that listed a task: where in it, and which task was newest.

    The worker that asked runs the newest task it could claim, so ``newest`` is the task's
    likely superseder (or the task itself, when ``task_ids`` are what it would supersede).
    """

    at_ms: int
    initial: str
    reason: str
    position: int
    count: int
    newest: str
    task_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class KeySummary:
    key: str
    activity_ms: int
    pending: int
    oldest_since_ms: int | None
    #: Tasks the index tracks under the key (any state).
    tracked: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class KeyView:
    key: str
    activity_ms: int | None
    pending: list[TaskRecord]
    answers: list[Answer]
    resolutions: list[Resolution]
    #: For superseded resolutions: the task that superseded each, as far as the service knows
    #: (see :func:`superseders`).
    superseded_by: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class TaskUnderKey:
    """What one key knows of a task: its record, its newest listing, and the records of the
    tasks that listing names (for the newest task: what it would supersede)."""

    key: str
    record: TaskRecord | None
    listing: Listing | None
    listed: dict[str, TaskRecord]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_record(task_id: str, record: str) -> TaskRecord:
    run, _rank, order, deadline, since, state, reason = record.split("|", 6)
    return TaskRecord(
        task_id, int(run), float(order), int(deadline), int(float(since)), state, reason
    )


def parse_answer(entry: str) -> Answer | None:
    """A ``log`` entry: ``at|answer|initial|count|reason|ids``."""
    parts = entry.split("|", 5)
    if len(parts) != 6 or parts[1] != "answer":
        return None
    ids = parts[5].split(",") if parts[5] else []
    return Answer(int(parts[0]), parts[2], int(parts[3]), parts[4], ids)


def parse_resolution(entry: str) -> Resolution | None:
    """A ``res`` entry: ``at|resolved|taskId|runId|state|reason``."""
    parts = entry.split("|", 5)
    if len(parts) != 6 or parts[1] != "resolved":
        return None
    return Resolution(int(parts[0]), parts[2], int(parts[3]), parts[4], parts[5])


def parse_listing(record: str) -> Listing:
    at, initial, reason, position, count, newest, ids = record.split("|", 6)
    return Listing(
        int(at), initial, reason, int(position), int(count), newest, ids.split(",") if ids else []
    )


def answer_records(
    answers: Iterable[GivenAnswer],
) -> dict[str, list[tuple[str, int, str]]]:
    """Per key, ``(taskId, at_ms, record)`` for every task the newest answers listed.

    ``answers`` come newest first; a task's newest listing wins. Only the newest task of an
    answer carries the whole list (what it would supersede); the others name it.
    """
    out: dict[str, list[tuple[str, int, str]]] = {}
    seen: dict[str, set[str]] = {}
    used: dict[str, int] = {}
    for key, initial, answer, reason, at_ms in answers:
        if used.get(key, 0) >= ANSWERS_PER_KEY_PER_FLUSH:
            continue
        used[key] = used.get(key, 0) + 1
        done = seen.setdefault(key, set())
        rows = out.setdefault(key, [])
        newest, count = answer[-1], len(answer)
        for position, task_id in enumerate(answer):
            if task_id in done:
                continue
            done.add(task_id)
            ids = ",".join(answer) if task_id == newest else ""
            record = f"{at_ms}|{initial}|{reason}|{position}|{count}|{newest}|{ids}"
            rows.append((task_id, at_ms, record))
    return out


def dedupe(resolutions: Iterable[Resolution]) -> list[Resolution]:
    """Drop repeated deliveries of one resolution (events arrive at least once)."""
    seen: set[tuple[str, int, str]] = set()
    out = []
    for r in resolutions:
        if (r.task_id, r.run_id, r.state) not in seen:
            seen.add((r.task_id, r.run_id, r.state))
            out.append(r)
    return out


# -- reads ------------------------------------------------------------------------------------
async def summaries(
    store: Pipelining, listed: Sequence[tuple[str, int]], *, now_ms: int, tracked: bool = False
) -> list[KeySummary]:
    """Pending count and oldest wait of each ``(key, activity_ms)`` (with ``tracked``, the
    tasks tracked under it too), in one round trip."""
    if not listed:
        return []

    def fill(pipe: Any) -> None:
        for key, _ in listed:
            store.eval(pipe, "summary", keys.group(key)[:4], now_ms, int(tracked))

    raw = await store.pipeline(fill)
    return [
        KeySummary(key, activity, int(r[0]), None if r[1] is None else int(float(r[1])), int(r[2]))
        for (key, activity), r in zip(listed, raw, strict=True)
    ]


async def key_view(store: Pipelining, key: str, *, now_ms: int, limit: int = 1000) -> KeyView:
    """A key's pending tasks, recent answers and resolutions, in one round trip (two when
    some resolutions are ``superseded``: what superseded them)."""

    def fill(pipe: Any) -> None:
        store.eval(pipe, "inspect", keys.group(key)[:4], now_ms, limit)
        pipe.lrange(keys.log(key), 0, RECENT - 1)
        pipe.lrange(keys.resolutions(key), 0, RECENT - 1)
        pipe.zscore(keys.KEYS_INDEX, key)

    inspected, log, res, activity = await store.pipeline(fill)
    items = [_text(v) for v in inspected]
    pending = [
        parse_record(items[i], items[i + 1]) for i in range(0, len(items), 2) if items[i + 1]
    ]
    answers = [a for a in map(parse_answer, map(_text, log)) if a is not None]
    resolutions = dedupe(r for r in map(parse_resolution, map(_text, res)) if r is not None)
    victims = sorted({r.task_id for r in resolutions if r.reason == "superseded"})
    return KeyView(
        key,
        None if activity is None else int(activity),
        pending,
        answers,
        resolutions,
        await superseders(store, key, victims),
    )


async def superseders(store: Pipelining, key: str, task_ids: Sequence[str]) -> dict[str, str]:
    """The task that superseded each of ``task_ids`` under ``key``, in one round trip: the
    primary a superseding policy recorded (exact), else the newest task of the newest answer
    that listed it (the task its worker ran, unless it could not claim that one)."""
    if not task_ids:
        return {}

    def fill(pipe: Any) -> None:
        pipe.hmget(keys.policy(key)[0], task_ids)
        pipe.hmget(keys.answered(key)[0], task_ids)

    decided, listed = await store.pipeline(fill)
    out: dict[str, str] = {}
    for task_id, decision, listing in zip(task_ids, decided, listed, strict=True):
        if decision is not None:
            out[task_id] = parse_decision(key, task_id, _text(decision)).by
        elif listing is not None:
            newest = parse_listing(_text(listing)).newest
            if newest != task_id:
                out[task_id] = newest
    return out


async def task_view(store: Pipelining, task_id: str, names: Sequence[str]) -> list[TaskUnderKey]:
    """Each of the keys ``names`` that knows ``task_id`` (as a task, or from an answer that
    listed it)."""
    if not names:
        return []

    def fill(pipe: Any) -> None:
        for key in names:
            pipe.hget(keys.group(key)[0], task_id)
            pipe.hget(keys.answered(key)[0], task_id)

    raw = await store.pipeline(fill)
    found: list[tuple[str, TaskRecord | None, Listing | None]] = []
    for i, key in enumerate(names):
        record, listing = raw[2 * i], raw[2 * i + 1]
        if record is not None or listing is not None:
            found.append(
                (
                    key,
                    None if record is None else parse_record(task_id, _text(record)),
                    None if listing is None else parse_listing(_text(listing)),
                )
            )
    wanted = [
        (key, [t for t in {*listing.task_ids, listing.newest} if t != task_id])
        for key, _, listing in found
        if listing is not None
    ]
    wanted = [(key, ids) for key, ids in wanted if ids]
    others: dict[str, dict[str, TaskRecord]] = {}
    if wanted:
        replies = await store.pipeline(
            lambda pipe: [pipe.hmget(keys.group(key)[0], ids) for key, ids in wanted]
        )
        for (key, ids), records in zip(wanted, replies, strict=True):
            others[key] = {
                tid: parse_record(tid, _text(rec))
                for tid, rec in zip(ids, records, strict=True)
                if rec is not None
            }
    return [
        TaskUnderKey(key, record, listing, others.get(key, {})) for key, record, listing in found
    ]
