"""Request ids and one log line per request, for every route but the superseding query.

:class:`RequestId` is a pure ASGI middleware set on each route (``Route(middleware=...)``), not
on the app, so the query path pays nothing for it. It takes the caller's ``X-Request-Id`` when
it looks like an id (else makes one), echoes it in the response, and keeps it in
:data:`coalescer.logs.REQUEST_ID` so that every line logged while handling the request carries
it. Exceptions with a handler are turned into responses inside the route (Starlette's
``request_response``), so the status logged is the one sent. Lines of ``5xx`` answers are
throttled (the first at once, then one every few seconds saying how many were held back):
a burst shed or a store outage writes a few lines, not one per request.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coalescer.logs import REQUEST_ID, Throttled

log = logging.getLogger("coalescer.web")

HEADER = b"x-request-id"
#: What an incoming id may look like: it is echoed in a header and written to logs.
_ID_RE = re.compile(rb"^[A-Za-z0-9._:@/+=-]{1,128}$")
#: Polled by load balancers and Prometheus: logged only at DEBUG when they succeed.
QUIET = ("/__lbheartbeat__", "/__heartbeat__", "/__version__", "/metrics", "/v1/ping")
SCOPE_KEY = "coalescer.request_id"
#: The access lines of error responses, throttled per status (see :class:`Throttled`).
_ERROR_LINES: dict[int, Throttled] = {}


def request_id(scope: Scope) -> str:
    """The request's id: the one this middleware chose, else the caller's, else a new one."""
    chosen = scope.get(SCOPE_KEY)
    if isinstance(chosen, str):
        return chosen
    for name, value in scope.get("headers", ()):
        if name == HEADER and _ID_RE.fullmatch(value):
            return str(value.decode("ascii"))
    return uuid.uuid4().hex


class RequestId:
    def __init__(self, app: ASGIApp, *, quiet: bool | None = None) -> None:
        self.app = app
        self.quiet = quiet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        scope[SCOPE_KEY] = rid
        token = REQUEST_ID.set(rid)
        started = time.perf_counter()
        status = 500  # unless a response starts: an exception escapes to the app's 500 handler

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (HEADER, rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            quiet = self.quiet if self.quiet is not None else path in QUIET or path == "/v1/events"
            level = (
                logging.ERROR
                if status >= 500
                else logging.INFO
                if status >= 400 or not quiet
                else logging.DEBUG
            )
            extra = {
                "method": scope.get("method", ""),
                "path": path,
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
            }
            if query := scope.get("query_string", b""):
                extra["query"] = query.decode("latin-1")
            # Long paths and queries are clipped by the log handler (coalescer.logs.ClipLong).
            if status >= 500:
                # A burst shed or an outage fails many requests alike: a line, then summaries.
                throttled = _ERROR_LINES.setdefault(status, Throttled(log))
                throttled.log(level, "%s %s %d", scope.get("method", ""), path, status, extra=extra)
            else:
                log.log(level, "%s %s %d", scope.get("method", ""), path, status, extra=extra)
            REQUEST_ID.reset(token)


#: For ``Route(..., middleware=TRACED)``.
TRACED = [Middleware(RequestId)]
