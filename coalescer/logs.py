"""Logging: one JSON object per line (or plain text with COALESCER_LOG_FORMAT=text).

A request's id (``X-Request-Id``, see ``coalescer.web.tracing``) is kept in a context variable
while the request is handled, and every line logged meanwhile carries it as ``request_id``.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
from collections.abc import Mapping
from typing import TextIO

import orjson

#: The id of the HTTP request being handled, if any.
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "coalescer_request_id", default=None
)
#: ``extra={...}`` fields that become JSON fields of their own.
FIELDS = (
    "request_id",
    "method",
    "path",
    "status",
    "duration_ms",
    "key",
    "task_id",
    "exchange",
    "outcome",
    "query",
)


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for extra in FIELDS:
            if hasattr(record, extra):
                doc[extra] = getattr(record, extra)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


#: The longest a value (a path, a key, a query, any string argument) is written in a log line;
#: longer ones are clipped, with a marker saying how much was left out, so that a client sending
#: a 5,000-character path cannot make the service write lines of ten kilobytes.
MAX_VALUE = 256


def clip(value: str, limit: int = MAX_VALUE) -> str:
    """``value``, or its first ``limit`` characters and ``…(+N chars)``."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}…(+{len(value) - limit} chars)"


class ClipLong(logging.Filter):
    """Clips long string arguments and ``extra`` fields of every record (see :func:`clip`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # A record goes through every handler's filters: clip it once, not a clipped value again.
        if getattr(record, "coalescer_clipped", False):
            return True
        record.coalescer_clipped = True
        if isinstance(record.args, tuple) and any(
            isinstance(a, str) and len(a) > MAX_VALUE for a in record.args
        ):
            record.args = tuple(clip(a) if isinstance(a, str) else a for a in record.args)
        for name in FIELDS:
            value = getattr(record, name, None)
            if isinstance(value, str) and len(value) > MAX_VALUE:
                setattr(record, name, clip(value))
        return True


class RequestContext(logging.Filter):
    """Stamps each record with the current request's id."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = REQUEST_ID.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


#: A URL in a log line: up to the first character that cannot be part of one.
_URL = re.compile(r"\b(?:https?|wss?)://[^\s\"'<>\\]+", re.IGNORECASE)


def _plain(match: re.Match[str]) -> str:
    url = match[0]
    scheme, rest = url.split("://", 1)
    authority, slash, path = rest.partition("/")
    path, query, _ = (slash + path).partition("#")[0].partition("?")
    return f"{scheme}://{authority.rpartition('@')[2]}{path}{'?…' if query else ''}"


def scrub(line: str) -> str:
    """``line`` with every URL in it cut to its scheme, host and path: a query string (a
    presigned URL's signature, a token) and a user or password are left out, whoever logged
    it (httpx logs each request's URL at INFO; an HTTP error's message holds it too)."""
    return _URL.sub(_plain, line) if "://" in line else line


class Scrubbed(logging.Formatter):
    """Formats with ``inner``, then :func:`scrub` s the line (message, exception and all)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return scrub(self.inner.format(record))


def make_handler(json: bool = True, stream: TextIO | None = None) -> logging.Handler:
    """The service's log handler: JSON (or text) lines to ``stream`` (stderr), each with the
    request's id, long values clipped, and the URLs in it without their query (:func:`scrub`)."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        Scrubbed(
            JSONFormatter()
            if json
            else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
    )
    handler.addFilter(RequestContext())
    handler.addFilter(ClipLong())
    return handler


def setup(level: str = "INFO", json: bool = True) -> None:
    handler = make_handler(json)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # pika reports a lost or refused connection at each layer it tears down; the consumer says
    # it once, with what happens next ("retrying in N s", "reconnecting").
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    connection = logging.getLogger("aiormq.connection")
    if not any(isinstance(f, SaidByTheCaller) for f in connection.filters):
        connection.addFilter(SaidByTheCaller())


class SaidByTheCaller(logging.Filter):
    """Drops aiormq's ERROR line for a failed connection attempt. The failure is raised to the
    caller, which says it with what happens next (``listen``'s "retrying in N s", aio-pika's
    "Reconnecting after N seconds"): a broker that is down is one line per retry, not two."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("error when creating transport")


def adopt_uvicorn() -> None:
    """Send uvicorn's own lines (startup, errors) through our handler, so that they are JSON too.

    uvicorn installs plain-text handlers when it starts; this undoes that once the app's
    lifespan begins, when :func:`setup` configured logging (the CLI), and not otherwise
    (tests, embedding).
    """
    root = logging.getLogger()
    if not any(
        isinstance(h.formatter, Scrubbed) and isinstance(h.formatter.inner, JSONFormatter)
        for h in root.handlers
    ):
        return
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


class Throttled:
    """Log the first of a run of alike lines at once, then at most one every ``every`` seconds,
    saying how many were held back: an outage must not write a line per failed request."""

    def __init__(self, logger: logging.Logger, every: float = 10.0) -> None:
        self.logger = logger
        self.every = every
        self._last = -float("inf")
        self._held = 0

    def log(
        self, level: int, message: str, *args: object, extra: Mapping[str, object] | None = None
    ) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like this in the last {now - self._last:.0f} s)"
        self._last, self._held = now, 0
        self.logger.log(level, message, *args, extra=extra)
