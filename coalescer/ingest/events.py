"""Pulse message → :class:`~coalescer.model.TaskEvent`. Pure: no IO.

A message is what a Pulse consumer sees: the exchange, the primary routing key, the ``CC``
routes (``route.<task.routes[i]>``) and the JSON body, validated against the queue's saved
message schema for that exchange.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

from coalescer import schemas
from coalescer.errors import InvalidEvent, InvalidInput
from coalescer.ingest import validation
from coalescer.model import (
    MAX_ROUTES,
    STATE_RANK_NUMBERS,
    TERMINAL_RUN,
    TaskEvent,
    keys_from_routes,
    parse_time_ms,
    rank_order,
)

EXCHANGE_PREFIX = "exchange/taskcluster-queue/v1/"
#: Exchange name → the state its messages announce for ``runId``.
EXCHANGE_STATES = {
    "task-pending": "pending",
    "task-running": "running",
    "task-completed": "completed",
    "task-failed": "failed",
    "task-exception": "exception",
}

#: Exchange, by full or short name → the state its messages announce and their schema.
_ANNOUNCES = {
    exchange: (state, f"{name}-message")
    for name, state in EXCHANGE_STATES.items()
    for exchange in (EXCHANGE_PREFIX + name, name)
}


class Message(NamedTuple):
    """A Pulse message as ingest takes it (a named tuple: one is made per event)."""

    exchange: str
    routing_key: str
    routes: tuple[str, ...]
    payload: Mapping[str, Any]

    @classmethod
    def from_json(cls, doc: Any) -> Message:
        """``{"exchange", "routingKey", "routes" | "CC", "payload"}`` as ``POST /v1/events`` takes."""
        if not isinstance(doc, dict):
            raise InvalidEvent("a message must be a JSON object")
        exchange, payload = doc.get("exchange"), doc.get("payload")
        routes = doc.get("routes", doc.get("CC", []))
        if not isinstance(exchange, str):
            raise InvalidEvent("message lacks a string 'exchange'")
        if not isinstance(payload, dict):
            raise InvalidEvent("message lacks an object 'payload'")
        if not isinstance(routes, list) or not all(isinstance(r, str) for r in routes):
            raise InvalidEvent("'routes'/'CC' must be a list of strings")
        routing_key = doc.get("routingKey", "")
        if not isinstance(routing_key, str):
            raise InvalidEvent("'routingKey' must be a string")
        return cls(exchange, routing_key, tuple(routes), payload)


@functools.cache
def queue_exchanges() -> frozenset[str]:
    """Every exchange the queue publishes on (``exchanges.json``), by full name."""
    reference = schemas.load_reference("exchanges.json")
    prefix = reference["exchangePrefix"]
    return frozenset(prefix + entry["exchange"] for entry in reference["entries"])


def exchange_state(exchange: str) -> str:
    name = exchange.removeprefix(EXCHANGE_PREFIX)
    if name not in EXCHANGE_STATES:
        raise InvalidEvent(f"not a task state exchange: {exchange!r}")
    return EXCHANGE_STATES[name]


def to_event(message: Message, *, prefix: str, rank_tag: str | None = None) -> TaskEvent | None:
    """The index event for ``message``, or ``None`` when it names no coalescing route or comes
    from one of the queue's other exchanges (``task-defined``, ``artifact-created``, task
    groups): valid messages with nothing for the index.

    Raises :class:`InvalidEvent` for a message that can never be applied.
    """
    announces = _ANNOUNCES.get(message.exchange)
    if announces is None:
        if message.exchange in queue_exchanges():
            return None
        raise InvalidEvent(f"not a task state exchange: {message.exchange!r}")
    state, schema = announces
    if len(message.routes) > MAX_ROUTES:
        raise InvalidEvent(
            f"the message names {len(message.routes)} routes; a queue message carries at most "
            f"{MAX_ROUTES} (one CC route.<route> per task route, task.routes maxItems)"
        )
    keys = keys_from_routes(message.routes, prefix)
    if not keys:
        return None
    body = message.payload
    problems = validation.errors(schema, body)
    if problems:
        name = schema.removesuffix("-message")
        raise InvalidEvent(f"{name} message fails its schema: " + "; ".join(problems))
    if "runId" in body:
        announced = (int(body["runId"]), state)
    else:  # exception before any run (deadline): final, newer than any run
        announced = (TERMINAL_RUN, "exception")
    tags = (body.get("task") or {}).get("tags", {})
    return status_event(body["status"], keys, announced=announced, tags=tags, rank_tag=rank_tag)


def status_event(
    status: Mapping[str, Any],
    keys: tuple[str, ...],
    *,
    announced: tuple[int, str] | None = None,
    tags: Mapping[str, Any] | None = None,
    rank_tag: str | None = None,
    order: float | None = None,
) -> TaskEvent | None:
    """The index event for a task status (``task-status.json``) under coalescing ``keys``.

    ``announced`` is the ``(runId, state)`` a Pulse message announces; the status's newest run
    wins when it is newer. Without it (the queue's ``status`` answer, for reconcile) the newest
    run is the truth, and a task with no run is final when its state is ``exception`` (deadline)
    and not yet indexable otherwise (``None``). ``order`` overrides the order the status and
    ``tags`` give: reconcile passes the order the index holds, as a status has no tags.

    Raises :class:`InvalidEvent` for data that can never be applied.
    """
    runs = status.get("runs") or []
    if announced is None:
        if runs:
            announced = (int(runs[-1]["runId"]), runs[-1]["state"])
        elif status.get("state") == "exception":
            announced = (TERMINAL_RUN, "exception")
        else:
            return None
    run_id, state = announced
    rank = STATE_RANK_NUMBERS[state]
    last = runs[-1] if runs else None
    try:
        # Newest knowledge wins: the announced run, or a later run the status shows.
        if last is not None and (last["runId"], STATE_RANK_NUMBERS[last["state"]]) > (run_id, rank):
            run_id, state = last["runId"], last["state"]
        deadline_ms = parse_time_ms(status["deadline"])
        since_ms = parse_time_ms(last["scheduled"]) if last is not None else deadline_ms
        if order is None:
            order = _order(tags or {}, runs, rank_tag, deadline_ms)
    except InvalidInput as exc:
        raise InvalidEvent(str(exc)) from exc
    if last is None:
        reason, started_ms, resolved_ms = "deadline-exceeded", 0, 0
    else:
        reason = last.get("reasonResolved", "")
        if last.get("runId") == run_id:
            started_ms, resolved_ms = _run_time(last, "started"), _run_time(last, "resolved")
        else:
            started_ms, resolved_ms = 0, 0
    return TaskEvent(
        task_id=status["taskId"],
        run_id=run_id,
        state=state,
        keys=keys,
        order=order,
        deadline_ms=deadline_ms,
        pending_since_ms=since_ms,
        reason=reason,
        started_ms=started_ms,
        resolved_ms=resolved_ms,
    )


def _run_time(run: Mapping[str, Any], field: str) -> int:
    """A run's ``started`` or ``resolved`` time in ms, 0 when it lacks it (or it cannot be
    read: these only tune superseding policies, so they never make an event invalid)."""
    value = run.get(field)
    if value is None:
        return 0
    try:
        return parse_time_ms(value)
    except InvalidInput:
        return 0


def _order(tags: Mapping[str, Any], runs: list[Any], rank_tag: str | None, fallback: int) -> float:
    if rank_tag is not None:
        return rank_order(tags, rank_tag)
    # Tasks resolved before any run sort by deadline; they are never offered anyway.
    return float(parse_time_ms(runs[0]["scheduled"])) if runs else float(fallback)
