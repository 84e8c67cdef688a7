"""How ``coalescer serve`` runs uvicorn: its fast HTTP parser, with a limit on request heads.

uvicorn's httptools protocol (llhttp) buffers a request line and headers of any size before it
hands them over, so one client sending a 100 MB header holds the process, and every query it
serves, for seconds. :class:`HeadLimitedProtocol` counts the bytes of each request's head as
they arrive and, past ``COALESCER_MAX_HEADER_BYTES``, answers ``431 Request Header Fields Too
Large`` and closes the connection without reading further. The limit is passed as uvicorn's
``h11_max_incomplete_event_size``, which h11 enforces the same way (with a 400).

The same protocol sends each ``200`` response's head and body in one write (:class:`OneWrite`),
where uvicorn makes two: one system call less per query (bench/query.py).

A superseding query (``GET /<key>?taskId=``, the service's hot path) is answered by the protocol
itself when it can be (:meth:`HeadLimitedProtocol._answer_soon`): the app's fast path starts the
store's read (:meth:`coalescer.web.fastpath.FastPath.start`) and the protocol writes the answer
when the reply comes, without the request cycle, task and ASGI messages uvicorn spends on every
request. Any other request, and any query that needs more (bad input, a store failure, a task
to learn from the queue), takes uvicorn's ordinary path to the same app, which answers it as
always.

The protocol also reports each connection to its process's :class:`~coalescer.web.connections.Gate`,
which bounds what uvicorn does not: how long a connection may wait for a request, or take to send
its head, and how many are open (read that module). The timers cost a query nothing: the idle
timer is uvicorn's keep-alive timer, armed once when a connection is made, and the head timer is
armed only when a read ends inside a request head.

The CLI binds the listening socket itself (:func:`bind`), so that it can name the port it got
when asked for any (port 0), and so that several worker processes can share it.

This module subclasses uvicorn's httptools protocol and reads its attributes (``cycle``,
``pipeline``, ``parser``, ``timeout_keep_alive_task``...): uvicorn's version is bounded above in
pyproject.toml, to one whose protocol the tests have run against.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
import weakref
from collections.abc import Iterator
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import httptools
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState
from uvicorn.supervisors.multiprocess import Multiprocess

from coalescer.errors import CoalescerError, ConfigError
from coalescer.observe import HTTP_ERRORS
from coalescer.web.api import FAILED
from coalescer.web.connections import IDLE, REFUSED, SLOW_HEAD, ConnectionLimits, Gate, plan

if sys.platform != "win32":
    import resource

if TYPE_CHECKING:
    from coalescer.web.fastpath import Answering, FastPath

log = logging.getLogger("coalescer.web")

_TOO_LARGE = 431
_TIMEOUT = 408
#: The gate of each server (one per process), created by its first connection.
_gates: weakref.WeakKeyDictionary[ServerState, Gate] = weakref.WeakKeyDictionary()


class BindError(CoalescerError):
    """The address to serve on cannot be bound (in use, or not this machine's)."""


class OneWrite:
    """A connection's transport that sends a ``200`` response's head and its body in one write.

    uvicorn writes them apart: two system calls, and two TCP segments for the client to take.
    The head is held until the body's write, which follows at once (the same event-loop
    iteration for every response of this service), and at most until that iteration ends.
    Everything else goes straight through to the transport.
    """

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif data[:13] == b"HTTP/1.1 200 " and bytes(data[-4:]) == b"\r\n\r\n":
            self._held = bytes(data)
            self._loop.call_soon(self._release)
            return
        self._transport.write(data)

    def _release(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held)

    def close(self) -> None:
        self._release()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _NoEvent:
    def set(self) -> None:
        pass


class _FastCycle:
    """What uvicorn's protocol reads and sets of a request's cycle, for a query in flight on
    the fast path."""

    __slots__ = ("body", "disconnected", "keep_alive", "more_body", "response_complete")

    message_event = _NoEvent()

    def __init__(self) -> None:
        self.body = b""
        self.more_body = False
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = True


def _fast_path(app: Any) -> FastPath | None:
    """The fast path of the service's app under uvicorn's middleware, when it has one."""
    for _ in range(8):
        if (fast := getattr(app, "fast_path", None)) is not None:
            return cast("FastPath", fast)
        app = getattr(app, "app", None)
    return None


class Config(uvicorn.Config):
    """uvicorn's configuration, with the limits of :mod:`coalescer.web.connections` (pickled
    with it to each worker process). Without WebSockets (the app has no WebSocket route): a
    request to upgrade is an ordinary request, which the app answers."""

    def __init__(self, *args: Any, connection_limits: ConnectionLimits, **kwargs: Any) -> None:
        kwargs.setdefault("ws", "none")
        super().__init__(*args, **kwargs)
        self.connection_limits = connection_limits


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request whose head (request line and headers)
    is larger than ``config.h11_max_incomplete_event_size`` bytes, and reporting to its
    process's :class:`~coalescer.web.connections.Gate`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        assert limit is not None, "run uvicorn with h11_max_incomplete_event_size set"
        self._limit: int = limit
        self._in_head = True  # between requests, or reading one's head
        self._head_bytes = 0  # counted while in a head; body bytes are not
        self._heads_done = 0
        self._head_timer: asyncio.TimerHandle | None = None
        gate = _gates.get(self.server_state)
        if gate is None:
            limits = getattr(self.config, "connection_limits", None) or ConnectionLimits()
            gate = _gates[self.server_state] = Gate(limits, self.loop)
        self._gate = gate

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = cast(asyncio.Transport, OneWrite(transport))
        self._fast = _fast_path(self.app) if self.limit_concurrency is None else None
        self._defaults: tuple[object, bytes] = (None, b"")
        if not self._gate.admit(self):
            self.transport.close()
            self._gate.closed(REFUSED, self._peer())
            return
        # No request yet: uvicorn's keep-alive timer, which any byte received cancels.
        self.timeout_keep_alive_task = self.loop.call_later(
            self._gate.limits.idle_timeout, self._idle
        )

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._gate.forget(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self.timeout_keep_alive_task is not None:  # left by uvicorn after an error
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def waiting(self) -> bool:
        """Open, and waiting for its client: idle, or reading a request head (for the gate)."""
        cycle = self.cycle
        return (
            self._in_head
            and (cycle is None or cycle.response_complete)
            and not self.pipeline
            and not self.transport.is_closing()
        )

    def shed(self) -> str:
        """Close the connection for the gate; its client's address."""
        self.transport.close()
        return self._peer()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"

    def _idle(self) -> None:
        """No request came within the idle timeout of the connection being made."""
        self.timeout_keep_alive_task = None
        if not self.transport.is_closing():
            self.transport.close()
            self._gate.closed(IDLE, self._peer())

    def _slow_head(self) -> None:
        """The request head begun is not complete within the head timeout."""
        self._head_timer = None
        if self.transport.is_closing() or not self.waiting():
            return
        message = f"request head not complete within {self._gate.limits.head_timeout:g} s\n"
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(message)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + message.encode()
        )
        self.transport.close()
        HTTP_ERRORS.labels(str(_TIMEOUT)).inc()
        self._gate.closed(SLOW_HEAD, self._peer())

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads_done += 1
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._gate.touch(self)
        if self._fast is not None and self._answer_soon(self._fast):
            return
        super().on_headers_complete()

    def _answer_soon(self, fast: FastPath) -> bool:
        """Take a plain superseding query on the fast path: a keep-alive ``GET`` with nothing
        else in flight on the connection, which the app can start answering. (A body, which a
        query has no use for, is read and dropped as uvicorn drops it after a response.)"""
        if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
            return False
        parser = self.parser
        if (
            parser.get_method() != b"GET"
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or parser.should_upgrade()
        ):
            return False
        url = httptools.parse_url(self.url)
        raw_path = url.path
        if b"%" in raw_path:
            return False
        path = raw_path.decode("ascii")
        query_string = url.query or b""
        answering = fast.start(path, query_string)
        if answering is None:
            return False
        scope = self.scope  # for the ordinary path, should the answer need it
        scope["method"] = "GET"
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = query_string
        cycle = _FastCycle()
        self.cycle = cast(RequestResponseCycle, cycle)
        answering.reply.add_done_callback(partial(self._answered, cycle, answering, scope))
        return True

    def _answered(
        self, cycle: _FastCycle, answering: Answering, scope: Any, reply: asyncio.Future[Any]
    ) -> None:
        if cycle.disconnected or self.transport.is_closing():
            cycle.response_complete = True
            return
        try:
            result = answering.finish(reply)
        except Exception:  # answered (and logged) by the ordinary path
            result = None
        if not isinstance(result, bytes):
            if result is not None:  # the store failed: the app's handlers answer it
                scope[FAILED] = result
            self._ordinary(cycle, scope)
            return
        self.transport.write(self._head(len(result)) + result)
        cycle.response_complete = True
        if not cycle.keep_alive:  # the server is shutting down
            self.transport.close()
        self.on_response_complete()

    def _head(self, length: int) -> bytes:
        """The head uvicorn writes for :func:`~coalescer.web.api.send_json`'s response."""
        defaults = self.server_state.default_headers  # replaced every second (its date)
        if defaults is not self._defaults[0]:
            self._defaults = (
                defaults,
                b"HTTP/1.1 200 OK\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in defaults),
            )
        return self._defaults[1] + (
            b"content-type: application/json\r\ncontent-length: %d\r\n"
            b"x-content-type-options: nosniff\r\n\r\n" % length
        )

    def _ordinary(self, cycle: _FastCycle, scope: Any) -> None:
        """Hand a query taken on the fast path to uvicorn's request cycle and the app."""
        ordinary = RequestResponseCycle(
            scope=scope,
            transport=self.transport,
            flow=self.flow,
            logger=self.logger,
            access_logger=self.access_logger,
            access_log=self.access_log,
            default_headers=self.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=cycle.keep_alive,
            on_response=self.on_response_complete,
        )
        ordinary.more_body = False
        cycle.response_complete = True
        if self.cycle is cast(RequestResponseCycle, cycle):
            self.cycle = ordinary
        self._start_asgi_task(ordinary, self.app)

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes = True, 0
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        # Bytes that arrive after a body are counted from the next read on (pipelining): at
        # most one read's worth of a head goes uncounted, and its timer starts with the next.
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > self._limit:
                self._over_limit(data)
                return
        super().data_received(data)
        if self._in_head and self._head_bytes and self._head_timer is None and self.waiting():
            # A read ended inside a head (a head that comes whole never gets here).
            self._head_timer = self.loop.call_later(self._gate.limits.head_timeout, self._slow_head)

    def _over_limit(self, data: bytes) -> None:
        """Refuse, unless the head ends within what fits and the rest is a body."""
        if self.transport.is_closing():  # refused already: read nothing more
            return
        room = max(0, self._limit - (self._head_bytes - len(data)))
        done = self._heads_done
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._heads_done == done:
            self._refuse()
        else:
            super().data_received(data[room:])

    def _refuse(self) -> None:
        message = f"request head larger than {self._limit} bytes\n".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(message)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + message
        )
        self.transport.close()
        HTTP_ERRORS.labels(str(_TOO_LARGE)).inc()
        log.info(
            "refused a request head larger than %d bytes from %s",
            self._limit,
            self.client[0] if self.client else "?",
            extra={"status": _TOO_LARGE},
        )


class _Server(uvicorn.Server):
    """uvicorn's server, saying when a signal stops it."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("received %s: shutting down", signal.Signals(sig).name)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn raises the signal again once shut down (SIGTERM then ends the process): say
        # that it stopped before.
        with super().capture_signals():
            yield
            log.info("stopped")


class _Supervisor(Multiprocess):
    """uvicorn's worker supervisor, saying when a signal stops it (uvicorn logs it at INFO on
    its own logger, which ``serve`` keeps at WARNING)."""

    def handle_int(self) -> None:
        log.info("received SIGINT: shutting down the worker processes")
        self.should_exit.set()

    def handle_term(self) -> None:
        log.info("received SIGTERM: shutting down the worker processes")
        self.should_exit.set()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket's address bound, as uvicorn binds it (``port`` 0: any free port);
    raises :class:`ConfigError` for a host that does not resolve, :class:`BindError` for an
    address that cannot be bound (in use, not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ConfigError(f"cannot bind {host!r}: {exc.strerror}") from exc
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def hold(limits: ConnectionLimits) -> ConnectionLimits:
    """``limits`` with the cap on connections (``max_connections`` ``None``: as many as the
    process's file descriptor limit allows, up to a default) and the accept backlog of
    :func:`~coalescer.web.connections.plan`, whose :class:`ConfigError` this raises; the soft
    limit of open files is raised when the cap needs it and the hard limit allows."""
    if sys.platform == "win32":  # no limit of open files to keep under
        soft = hard = unlimited = -1
    else:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        unlimited = resource.RLIM_INFINITY
    held = plan(limits.max_connections, soft, hard, unlimited=unlimited)
    if held.files != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (held.files, hard))
    return dataclasses.replace(limits, max_connections=held.max_connections, backlog=held.backlog)


def serve(
    app: ASGIApp | str,
    *,
    sock: socket.socket,
    max_header_bytes: int,
    workers: int = 1,
    limits: ConnectionLimits | None = None,
) -> None:
    """Serve ``app`` on ``sock`` until a signal stops it: in this process, or with ``workers``
    > 1 in that many worker processes (``app`` then names a factory, ``module:function``, that
    each process calls), which share the socket, restarted by uvicorn if one dies. Each process
    keeps to ``limits`` (:func:`hold` unless their cap is set)."""
    if limits is None or limits.max_connections is None:
        limits = hold(limits or ConnectionLimits())
    log.info(
        "at most %d connections per process; each closed after %d s without a request, or "
        "%g s into a request head not yet complete",
        limits.max_connections,
        limits.idle_timeout,
        limits.head_timeout,
    )
    config = Config(
        app,
        http=HeadLimitedProtocol,
        h11_max_incomplete_event_size=max_header_bytes,
        timeout_keep_alive=limits.idle_timeout,
        backlog=limits.backlog,
        connection_limits=limits,
        log_level="warning",
        access_log=False,
        proxy_headers=True,
        lifespan="on",
        log_config=None,  # keep coalescer's JSON logging for uvicorn's own lines too
        workers=workers,
        factory=isinstance(app, str),
    )
    if workers > 1:
        _Supervisor(config, sockets=[sock]).run()
        log.info("stopped")
    else:
        _Server(config).run(sockets=[sock])
