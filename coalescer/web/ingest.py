"""``POST /v1/events``: authenticated ingest of Pulse-shaped messages.

The body is one message or a list of them; the answer says, per message, ``applied``,
``stale`` (older than what the index holds), ``ignored`` (no coalescing route), ``expired``
(past deadline plus grace), ``limited`` (a new key or task past the index's limits: not
indexed, and never worth a retry) or ``invalid`` (with why). Valid messages are applied in one round
trip; a retry after a failure is harmless because every application is idempotent. When the
store cannot take writes (down, full, read-only), the answer is 503 with ``Retry-After`` and,
per message, what was applied and what is ``unavailable``.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from coalescer.errors import (
    AuthError,
    IngestDisabled,
    InvalidEvent,
    InvalidInput,
    StoreUnavailable,
)
from coalescer.ingest.events import Message, to_event
from coalescer.model import TaskEvent
from coalescer.observe import store_failed
from coalescer.store.census import Limits
from coalescer.web.responses import JSON, error

log = logging.getLogger(__name__)

MAX_MESSAGES = 1000
#: nginx's "client closed request": logged as such, not an error of the service.
CLIENT_CLOSED = 499


def check_token(request: Request) -> None:
    expected = request.app.state.settings.ingest_token
    if expected is None:
        raise IngestDisabled("ingest is disabled: set COALESCER_INGEST_TOKEN to enable it")
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), expected.reveal().encode()
    ):
        raise AuthError("missing or wrong bearer token")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _unavailable(
    exc: StoreUnavailable,
    results: list[dict[str, Any]],
    slots: list[int],
    events: list[TaskEvent],
) -> Response:
    """503, saying per message what was applied before the store stopped taking writes, so a
    client can retry exactly (retrying the whole request is also right: what was applied then
    answers ``stale``)."""
    store_failed(exc)
    outcomes = exc.outcomes or [None] * len(events)
    for i, event, outcome in zip(slots, events, outcomes, strict=True):
        results[i] = (
            {"status": outcome, "taskId": event.task_id}
            if outcome is not None
            else {"status": "unavailable", "taskId": event.task_id, "error": "not applied: retry"}
        )
    response = JSON(
        {
            "error": f"the index store (Redis) is unavailable ({exc.reason}); retry the "
            "messages answered unavailable",
            "results": results,
        },
        503,
    )
    response.headers["retry-after"] = "2"
    return response


class BodyTooLarge(Exception):
    """A request body over :func:`read_body`'s limit (answered 413)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


async def json_body(request: Request, limit: int) -> Any:
    """The request's JSON body, at most ``limit`` bytes, or the :class:`Response` that ends the
    request instead: 413 for a larger body, nothing for a client that went away mid-body
    (nothing is applied, and nobody reads an answer). InvalidInput when it is not JSON."""
    try:
        body = await read_body(request, limit)
    except BodyTooLarge as exc:
        return error(413, f"request body larger than {exc.limit} bytes")
    except ClientDisconnect:
        return Response(status_code=CLIENT_CLOSED)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"body is not JSON: {exc}") from exc


async def post_events(request: Request) -> Response:
    check_token(request)
    settings = request.app.state.settings
    doc = await json_body(request, settings.max_body_bytes)
    if isinstance(doc, Response):
        return doc
    if not isinstance(doc, dict | list):
        raise InvalidInput("the body must be a message object or a list of them")
    docs: list[Any] = doc if isinstance(doc, list) else [doc]
    if len(docs) > MAX_MESSAGES:
        raise InvalidInput(f"at most {MAX_MESSAGES} messages per request")
    results: list[dict[str, Any]] = [{} for _ in docs]
    events: list[TaskEvent] = []
    messages: list[Message] = []
    slots: list[int] = []
    prefix, rank_tag = settings.route_prefix, settings.rank_tag
    for i, item in enumerate(docs):
        try:
            message = Message.from_json(item)
            event = to_event(message, prefix=prefix, rank_tag=rank_tag)
        except InvalidEvent as exc:
            results[i] = {"status": "invalid", "error": str(exc)}
            continue
        if event is None:
            results[i] = {"status": "ignored"}
        else:
            events.append(event)
            messages.append(message)
            slots.append(i)
    limits = Limits(settings.max_keys, settings.max_tasks)
    try:
        outcomes = await request.app.state.store.apply(
            events, policy=settings.policy, limits=limits
        )
    except StoreUnavailable as exc:
        return _unavailable(exc, results, slots, events)
    applied = [ev for ev, outcome in zip(events, outcomes, strict=True) if outcome == "applied"]
    if (verifier := request.app.state.verifier) is not None:
        try:
            await verifier.check(applied, limits=limits)
        except StoreUnavailable as exc:
            # Applied, not checked: said, and left to `coalescer reconcile`.
            log.warning("could not check %d applied events: %s", len(applied), exc)
    if (recorder := request.app.state.recorder) is not None:
        recorder.record(messages)
    for i, event, outcome in zip(slots, events, outcomes, strict=True):
        results[i] = {"status": outcome, "taskId": event.task_id}
    exchanges = [str(d.get("exchange", "")) if isinstance(d, dict) else "" for d in docs]
    await request.app.state.observer.ingest(
        "http",
        [r["status"] for r in results],
        exchanges,
        applied=applied,
    )
    return JSON({"results": results})
