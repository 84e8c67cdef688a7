"""The superseding API (native and tc-coalesce's) and the operations endpoints."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

import orjson
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import request_response
from starlette.types import Receive, Scope, Send

from coalescer import __version__, keyset, model
from coalescer.errors import InvalidInput
from coalescer.health import Health
from coalescer.observe import STAT_COUNTERS
from coalescer.store import Store
from coalescer.store import keyset as stored
from coalescer.web import pages
from coalescer.web.responses import JSON, NOSNIFF, wants_html
from coalescer.web.tracing import RequestId

STARTED = time.time()


class KeyPath(Convertor[str]):
    """A URL path that can name a coalescing key: anything but the reserved paths (``/v1/``,
    ``/__*__``, ``/metrics``, ``/openapi.json``, ``/static/``, ``/favicon.ico``)."""

    regex = (
        r"(?!v1(?:/|$)|__|static(?:/|$)|metrics(?:/|$)|openapi\.json$|favicon\.ico$|tasks/)[^?#]+"
    )

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("keypath", KeyPath())
KEY_PATH = re.compile(KeyPath.regex)


def _store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def _whole_number(name: str, raw: str | None) -> int | None:
    if raw is None or raw == "":
        return None
    # isascii: str.isdigit() also takes "²" and other digits int() refuses (a 500, found by
    # fuzzing).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise InvalidInput(f"query parameter {name!r} must be a non-negative whole number")
    return int(raw)


def _query(query_string: bytes) -> dict[str, str]:
    """Query parameters; the common case (plain ASCII, no escapes) without urllib's cost."""
    text = query_string.decode("latin-1")
    if "%" in text or "+" in text:
        return dict(parse_qsl(text, keep_blank_values=True))
    return dict(part.partition("=")[::2] for part in text.split("&") if part)


class Query(NamedTuple):
    """A superseding query, checked: what :func:`finish` needs besides the key's snapshot."""

    key: str
    task_id: str
    age: int | None
    size: int | None
    cap: int
    started: float  # time.perf_counter() when it began, for the latency histogram


def parse(state: State, path: str, query_string: bytes) -> Query | None:
    """The superseding query ``GET /<path>?<query_string>`` asks, or ``None`` when it asks for
    the key's listing (no ``taskId``). Raises :class:`InvalidInput` for bad input."""
    started = time.perf_counter()
    params = _query(query_string)
    task_id = params.get("taskId")
    if task_id is None:
        return None
    key = model.key_from_path(path)
    model.check_task_id(task_id)
    age = _whole_number("age", params.get("age"))
    size = _whole_number("size", params.get("size"))
    return Query(key, task_id, age, size, state.settings.max_list, started)


def finish(state: State, query: Query, now_ms: int, snap: model.KeySnapshot) -> bytes:
    """The JSON answer to ``query`` from ``snap`` (read at ``now_ms``), recorded for the pages
    and metrics."""
    answer, reason = model.supersedes(
        query.task_id, snap, now_ms=now_ms, age=query.age, size=query.size, cap=query.cap
    )
    state.observer.answer(query.key, query.task_id, answer, reason, now_ms, query.started)
    return orjson.dumps({"supersedes": answer})


#: The scope entry that carries a store failure met on the fast path (coalescer.web.fastpath)
#: to this endpoint, which raises it for the app's exception handlers to answer.
FAILED = "coalescer.fast_path.failed"


class KeyEndpoint:
    """``GET /<key-path>?taskId=`` → ``{"supersedes": [...]}``, oldest first
    (docs/explanation/protocol.md).

    A plain ASGI endpoint: it is the service's hot path, so it skips building a Request and a
    Response. Without ``taskId`` it serves the key's pending tasks, as JSON or as a page.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (failed := scope.pop(FAILED, None)) is not None:
            raise failed  # met on the fast path: answered by the app's exception handlers
        body = await self.answer(scope)
        if body is None:
            await _key_listing(scope, receive, send)
        else:
            await send_json(send, body)

    async def answer(self, scope: Scope) -> bytes | None:
        """The JSON answer to a superseding query, or ``None`` when ``scope`` asks for the
        key's listing (no ``taskId``). Raises :class:`InvalidInput` for bad input."""
        state = scope["app"].state
        query = parse(state, scope["path_params"]["path"], scope["query_string"])
        if query is None:
            return None
        now_ms, snap = await read_key(state, query.key, query.task_id, query.cap)
        return finish(state, query, now_ms, snap)


async def read_key(state: State, key: str, task_id: str, cap: int) -> tuple[int, model.KeySnapshot]:
    """``(now_ms, snapshot)`` of ``key`` for a query about ``task_id``: one Redis round trip,
    and a queue lookup first when the index does not know the task (event lag)."""
    now_ms = int(time.time() * 1000)
    snap = await state.store.snapshot(key, task_id, now_ms=now_ms, cap=cap)
    if snap.newer is None and state.learner is not None:
        now_ms, snap = await state.learner.learn(key, task_id, now_ms, snap, cap=cap)
    return now_ms, snap


async def send_json(send: Send, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                NOSNIFF,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _listing(request: Request) -> Response:
    key = model.key_from_path(request.path_params["path"])
    for name in ("age", "size"):  # meaningless here, but malformed is still a client error
        _whole_number(name, request.query_params.get(name))
    if wants_html(request):
        return await pages.key_page(request, key)
    tasks = await _store(request).pending(key, now_ms=int(time.time() * 1000))
    return JSON(
        {
            "key": key,
            "pending": [
                {
                    "taskId": t.task_id,
                    "runId": t.run_id,
                    "order": t.order,
                    "pendingSince": model.format_time_ms(t.since_ms),
                    "deadline": model.format_time_ms(t.deadline_ms),
                }
                for t in tasks
            ],
        }
    )


# Off the query path: a request id and a log line, as the other routes (see tracing).
_key_listing = RequestId(request_response(_listing))


async def not_found(request: Request) -> Response:
    # Raised, so that the app's handler answers a browser with a page and counts it.
    raise HTTPException(404, f"no such endpoint: {request.url.path}")


async def docker_worker(request: Request) -> Response:
    """``GET /v1/docker-worker[/<age>/<size>]/<key>?taskId=``: the answer an unmodified
    docker-worker needs, newest first (see :func:`coalescer.model.docker_worker_list`). The key
    is dotted, as on tc-coalesce's ``/v1/list`` routes, so that no key reads as thresholds."""
    started = time.perf_counter()
    task_id = request.query_params.get("taskId")
    if task_id is None:
        raise InvalidInput(
            "missing query parameter 'taskId' (docker-worker appends ?taskId=<its task> to its "
            "supersederUrl, which must therefore have no query string of its own)"
        )
    key = model.check_key(request.path_params["key"])
    model.check_task_id(task_id)
    state = request.app.state
    cap = state.settings.max_list
    now_ms, snap = await read_key(state, key, task_id, cap)
    answer, reason = model.docker_worker_list(
        task_id,
        snap,
        now_ms=now_ms,
        age=request.path_params.get("age"),
        size=request.path_params.get("size"),
        cap=cap,
    )
    # Recorded oldest first, as every answer is, for the pages.
    state.observer.answer(key, task_id, answer[::-1], reason, now_ms, started)
    return JSON({"supersedes": answer})


async def compat_list(request: Request) -> Response:
    """tc-coalesce's ``GET /v1/list/<age>/<size>/<key>``: newest first, ``[]`` below thresholds."""
    key = model.check_key(request.path_params["key"])
    now_ms = int(time.time() * 1000)
    snap = await _store(request).snapshot(key, "", now_ms=now_ms, cap=-1)
    answer = model.compat_list(
        snap, now_ms=now_ms, age=request.path_params["age"], size=request.path_params["size"]
    )
    return JSON({"supersedes": answer})


async def compat_list_all(request: Request) -> Response:
    """tc-coalesce's ``GET /v1/list/<key>``: every pending task, newest first."""
    key = model.check_key(request.path_params["key"])
    snap = await _store(request).snapshot(key, "", now_ms=int(time.time() * 1000), cap=-1)
    return JSON({"supersedes": snap.newest})


async def compat_keys(request: Request) -> Response:
    """tc-coalesce's ``GET /v1/list``: ``{"<prefix>.": [keys]}`` of keys with pending tasks,
    among the :data:`~coalescer.keyset.LIST_CAP` most recently active keys."""
    store = _store(request)
    listed, _ = await stored.recent(store, 0, keyset.LIST_CAP - 1)
    counts = await store.pending_counts([k for k, _ in listed])
    prefix = request.app.state.settings.route_prefix + "."
    return JSON({prefix: [key for key, n in counts.items() if n]})


async def compat_stats(request: Request) -> Response:
    """tc-coalesce's ``GET /v1/stats``: string counters, plus ours, every one always present
    (``"0"`` until counted). ``pending_count`` and ``coalesced_lists`` are the index's totals as
    last counted (at ``index_counted_at``); all three are ``null`` until a large index has been
    counted once."""
    store = _store(request)
    stats: dict[str, str | None] = dict.fromkeys(STAT_COUNTERS, "0")
    stats.update(await store.stats())
    now_ms = int(time.time() * 1000)
    totals = await stored.totals(store, now_ms=now_ms)
    stats["keys"] = str(totals.keys)
    counted = totals.counted_ms is not None
    stats["pending_count"] = str(totals.pending) if counted else None
    stats["coalesced_lists"] = str(totals.with_pending) if counted else None
    stats["index_counted_at"] = (
        model.format_time_ms(totals.counted_ms) if totals.counted_ms is not None else None
    )
    return JSON(stats)


async def ping(request: Request) -> Response:
    return JSON({"alive": True, "uptime": time.time() - STARTED})


async def heartbeat(request: Request) -> Response:
    """Dockerflow: 200 when Redis answers and takes writes and every background task runs
    (``warning`` when the index needs a rebuild or Redis may evict keys), 503 otherwise; the
    checks and their details say which."""
    store = _store(request)
    health: Health = request.app.state.health
    report = health.report()
    checks: dict[str, str] = {"redis": "ok", **report["checks"]}
    details: dict[str, Any] = report["details"]
    try:
        async with asyncio.timeout(store.query_timeout):
            await store.ping()
    except Exception as exc:  # any failure means unhealthy; say which
        checks["redis"] = "error"
        details["redis"] = str(exc) or f"no answer within {store.query_timeout:g} s"
    else:
        try:
            async with asyncio.timeout(store.query_timeout):
                await store.probe()
        except Exception as exc:
            checks["writable"] = "error"
            details["writable"] = f"Redis refuses writes: {exc}"
        else:
            checks["writable"] = "ok"
            details.pop("writable", None)
    status = (
        "error"
        if "error" in checks.values()
        else "warning"
        if "warning" in checks.values()
        else "ok"
    )
    body = {
        "status": status,
        "checks": checks,
        "details": details,
        "store": "embedded" if store.embedded else "redis",
    }
    return JSON(body, 503 if status == "error" else 200)


async def lbheartbeat(request: Request) -> Response:
    return JSON({"status": "ok"})


async def version(request: Request) -> Response:
    return JSON(
        {
            "name": "coalescer",
            "version": __version__,
            "source": "coalescer",
            "commit": request.app.state.commit,
        }
    )
