"""Reading superseding lineage: the decisions ``decide.lua`` recorded, by victim and by
primary, the definitions the enforcer kept, and the per-key counters. See
:mod:`coalescer.store.keys` for the layout and :mod:`coalescer.store.policy` for the writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from coalescer.store import keys
from coalescer.store.base import Pipelining


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What superseded one task run: ``by`` (its run ``by_run``), when, under which rule, why,
    and how far carrying it out got (``state``)."""

    key: str
    task_id: str
    run: int
    by: str
    by_run: int
    at_ms: int
    rule: str
    state: str
    action: str
    reason: str
    #: How the enforcer ended the victim's run (``completed``, ``exception/superseded``,
    #: ``canceled``, ``released``) and why; empty until it has.
    resolved_as: str = ""
    resolved_why: str = ""


def parse_decision(key: str, task_id: str, record: str, note: str = "") -> Decision:
    """A ``v`` record, with its ``vn`` note (``run|how|why``) when that is about the same run."""
    run, by, by_run, at, rule, state, action, reason = record.split("|", 7)
    note_run, _, rest = note.partition("|")
    how, _, why = rest.partition("|") if note_run == run else ("", "", "")
    return Decision(
        key, task_id, int(run), by, int(by_run), int(at), rule, state, action, reason, how, why
    )


async def decision(store: Pipelining, key: str, victim: str) -> Decision | None:
    (raw,) = await store.pipeline(lambda pipe: pipe.hget(keys.policy(key)[0], victim))
    return None if raw is None else parse_decision(key, victim, _text(raw))


async def lineage(
    store: Pipelining, names: Sequence[str], task_id: str
) -> tuple[list[Decision], list[Decision]]:
    """Under ``names``: the decisions that superseded ``task_id``, and those it took as the
    primary (what it superseded), in one round trip per step."""
    if not names:
        return [], []

    def fill(pipe: Any) -> None:
        for key in names:
            v, vp, *_ = keys.policy(key)
            pipe.hget(v, task_id)
            pipe.hget(keys.settled(key)[8], task_id)
            pipe.zrangebylex(vp, f"[{task_id}|", f"[{task_id}|\xff")

    raw = await store.pipeline(fill)
    mine = [
        parse_decision(k, task_id, _text(raw[3 * i]), _text(raw[3 * i + 1] or ""))
        for i, k in enumerate(names)
        if raw[3 * i] is not None
    ]
    wanted = [
        (k, [_text(m).split("|", 1)[1] for m in raw[3 * i + 2]])
        for i, k in enumerate(names)
        if raw[3 * i + 2]
    ]
    theirs: list[Decision] = []
    if wanted:

        def fill_theirs(pipe: Any) -> None:
            for key, ids in wanted:
                pipe.hmget(keys.policy(key)[0], ids)
                pipe.hmget(keys.settled(key)[8], ids)

        replies = await store.pipeline(fill_theirs)
        for i, (key, ids) in enumerate(wanted):
            records, notes = replies[2 * i], replies[2 * i + 1]
            theirs += [
                parse_decision(key, victim, _text(rec), _text(note or ""))
                for victim, rec, note in zip(ids, records, notes, strict=True)
                if rec is not None
            ]
    theirs.sort(key=lambda d: (d.at_ms, d.task_id))
    return mine, theirs


async def definitions(store: Pipelining, key: str, task_ids: Sequence[str]) -> dict[str, str]:
    """The task definitions (JSON) the enforcer kept for victims, by taskId."""
    if not task_ids:
        return {}
    df = keys.settled(key)[7]
    (raw,) = await store.pipeline(lambda pipe: pipe.hmget(df, list(task_ids)))
    return {t: _text(d) for t, d in zip(task_ids, raw, strict=True) if d is not None}


async def counters(store: Pipelining, names: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per key, its ``<rule>|<state>`` and ``<rule>|saved_ms`` counters."""
    if not names:
        return {}
    raw = await store.pipeline(lambda pipe: [pipe.hgetall(keys.policy(k)[7]) for k in names])
    return {
        k: {_text(f): int(_text(n)) for f, n in r.items()} for k, r in zip(names, raw, strict=True)
    }
