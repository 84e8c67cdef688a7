"""The connection limits of a web process: the cap under the file descriptor limit, which
connection makes room for a new one, how what is closed is counted and logged, and the
protocol's timers (none for a head that comes whole)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY
from uvicorn.server import ServerState

from coalescer.errors import ConfigError
from coalescer.settings import Settings
from coalescer.web import connections
from coalescer.web.connections import (
    DEFAULT_MAX_CONNECTIONS,
    MAX_BACKLOG,
    RESERVED_FILES,
    ConnectionLimits,
    Gate,
    files_needed,
    plan,
)
from coalescer.web.server import Config, HeadLimitedProtocol


def test_the_default_cap_fits_a_roomy_descriptor_limit_unchanged() -> None:
    p = plan(None, soft=65536, hard=65536)
    assert (p.max_connections, p.backlog, p.files) == (DEFAULT_MAX_CONNECTIONS, MAX_BACKLOG, 65536)


def test_the_soft_limit_is_raised_as_far_as_the_cap_needs_when_the_hard_limit_allows() -> None:
    p = plan(None, soft=1024, hard=1 << 20)
    assert p.max_connections == DEFAULT_MAX_CONNECTIONS
    assert p.files == DEFAULT_MAX_CONNECTIONS + MAX_BACKLOG + RESERVED_FILES
    assert plan(None, soft=1024, hard=-1, unlimited=-1).files == p.files
    assert plan(None, soft=-1, hard=-1, unlimited=-1).files == -1  # no limit: left alone


@pytest.mark.parametrize("files", [1024, 4096, 12_000])
def test_under_a_low_hard_limit_the_default_cap_is_the_most_that_fits(files: int) -> None:
    p = plan(None, soft=files, hard=files)
    assert p.files == files
    assert files_needed(p.max_connections) <= files < files_needed(p.max_connections + 1)
    assert p.max_connections + p.backlog + RESERVED_FILES <= files


def test_a_cap_asked_for_that_the_hard_limit_cannot_hold_is_refused_saying_why() -> None:
    with pytest.raises(ConfigError, match=r"COALESCER_MAX_CONNECTIONS=5000 needs 6762 open files"):
        plan(5000, soft=1024, hard=4096)
    assert plan(2000, soft=1024, hard=4096) == connections.Plan(2000, 500, 3012)


def test_a_descriptor_limit_too_low_to_serve_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"may open 256 files \(ulimit -n\): too few"):
        plan(None, soft=256, hard=256)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"COALESCER_HEAD_TIMEOUT": "0"},
            "COALESCER_HEAD_TIMEOUT must be more than 0 and at most 60",
        ),
        ({"COALESCER_HEAD_TIMEOUT": "61"}, "COALESCER_HEAD_TIMEOUT must be more than 0"),
        ({"COALESCER_HEAD_TIMEOUT": "soon"}, "COALESCER_HEAD_TIMEOUT must be a number of seconds"),
        ({"COALESCER_IDLE_TIMEOUT": "0"}, "COALESCER_IDLE_TIMEOUT must be at least 1, not 0"),
        ({"COALESCER_IDLE_TIMEOUT": "1.5"}, "COALESCER_IDLE_TIMEOUT must be a whole number"),
        ({"COALESCER_IDLE_TIMEOUT": "3601"}, "COALESCER_IDLE_TIMEOUT must be at most 3600"),
        ({"COALESCER_MAX_CONNECTIONS": "8"}, "COALESCER_MAX_CONNECTIONS must be at least 16"),
        ({"COALESCER_MAX_CONNECTIONS": "lots"}, "COALESCER_MAX_CONNECTIONS must be a whole"),
    ],
)
def test_bad_connection_settings_say_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_environ(env)


def test_connection_settings_are_read() -> None:
    s = Settings.from_environ({})
    assert (s.head_timeout, s.idle_timeout, s.max_connections) == (10.0, 5, None)
    s = Settings.from_environ(
        {
            "COALESCER_HEAD_TIMEOUT": "2.5",
            "COALESCER_IDLE_TIMEOUT": "75",
            "COALESCER_MAX_CONNECTIONS": "500",
        }
    )
    assert (s.head_timeout, s.idle_timeout, s.max_connections) == (2.5, 75, 500)


class Conn:
    """A connection as the gate sees it."""

    def __init__(self, name: str, waiting: bool = True) -> None:
        self.name = name
        self.is_waiting = waiting
        self.closed = False

    def waiting(self) -> bool:
        return self.is_waiting and not self.closed

    def shed(self) -> str:
        self.closed = True
        return self.name


def shed_count(reason: str) -> float:
    value = REGISTRY.get_sample_value("coalescer_connections_shed_total", {"reason": reason})
    return value or 0.0


async def test_over_the_cap_the_connection_waiting_longest_makes_room() -> None:
    gate = Gate(ConnectionLimits(max_connections=3), asyncio.get_running_loop())
    a, b, c = Conn("a"), Conn("b"), Conn("c")
    for conn in (a, b, c):
        assert gate.admit(conn)
    gate.touch(a)  # a has just begun a request: b has waited longest
    before = shed_count("over_limit")
    d = Conn("d")
    assert gate.admit(d)
    assert (a.closed, b.closed, c.closed, d.closed) == (False, True, False, False)
    assert shed_count("over_limit") == before + 1
    # Not yet forgotten (its loss comes later): the next one closes another.
    e = Conn("e")
    assert gate.admit(e) and c.closed
    gate.forget(b)
    gate.forget(c)
    assert len(gate) == 3


async def test_a_connection_with_a_request_in_flight_is_never_closed_for_a_new_one() -> None:
    gate = Gate(ConnectionLimits(max_connections=2), asyncio.get_running_loop())
    busy, idle = Conn("busy", waiting=False), Conn("idle")
    assert gate.admit(busy) and gate.admit(idle)
    new = Conn("new")
    assert gate.admit(new) and idle.closed and not busy.closed
    gate.forget(idle)
    new.is_waiting = False  # its request has begun
    # Now every other one has a request in flight: the newest is refused (the caller closes it).
    before = shed_count("over_limit")
    assert not gate.admit(Conn("other"))
    assert not busy.closed and not new.closed
    assert shed_count("over_limit") == before


async def test_no_cap_closes_nothing() -> None:
    gate = Gate(ConnectionLimits(max_connections=None), asyncio.get_running_loop())
    conns = [Conn(str(i)) for i in range(100)]
    assert all(gate.admit(c) for c in conns)
    assert not any(c.closed for c in conns)


async def test_the_first_close_is_logged_at_once_then_a_summary_with_the_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = Gate(
        ConnectionLimits(head_timeout=2, idle_timeout=5, max_connections=10, report_seconds=0.05),
        asyncio.get_running_loop(),
    )
    caplog.set_level(logging.INFO, "coalescer.web")
    before = shed_count("slow_head"), shed_count("idle")
    for i in range(5):
        gate.closed("slow_head", f"127.0.0.1:{1000 + i}")
    gate.closed("idle", "127.0.0.1:2000")
    assert [r.getMessage() for r in caplog.records] == [
        "closed a connection from 127.0.0.1:1000: request head not complete 2 s after it "
        "began (COALESCER_HEAD_TIMEOUT)"
    ]
    assert (shed_count("slow_head"), shed_count("idle")) == (before[0] + 5, before[1] + 1)
    deadline = time.monotonic() + 5
    while len(caplog.records) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert caplog.records[1].getMessage() == (
        "closed 5 more connections in the last 0.05 s: 1 idle (COALESCER_IDLE_TIMEOUT=5), "
        "4 slow heads (COALESCER_HEAD_TIMEOUT=2)"
    )
    assert caplog.records[1].levelno == logging.INFO
    # A quiet window ends the reports: the next close is logged at once again.
    while gate._report is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    gate.closed("over_limit", "127.0.0.1:3000")
    assert caplog.records[-1].levelno == logging.WARNING
    assert "(COALESCER_MAX_CONNECTIONS)" in caplog.records[-1].getMessage()


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)


async def nothing(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def connect(limits: ConnectionLimits) -> tuple[HeadLimitedProtocol, Transport, Gate]:
    config = Config(
        nothing, h11_max_incomplete_event_size=8192, lifespan="off", connection_limits=limits
    )
    config.load()
    state = ServerState()
    protocol = HeadLimitedProtocol(config=config, server_state=state, app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, protocol._gate


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


async def test_a_request_head_that_comes_whole_arms_no_timer() -> None:
    protocol, transport, gate = connect(ConnectionLimits(head_timeout=0.05))
    assert protocol.timeout_keep_alive_task is not None  # the idle timer, until a byte comes
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert protocol._head_timer is None and protocol.timeout_keep_alive_task is None
    await until(lambda: bool(transport.writes))
    assert transport.writes[0].startswith(b"HTTP/1.1 204 ")
    assert not transport.closed and len(gate) == 1


async def test_a_request_head_in_pieces_is_answered_408_at_the_head_timeout() -> None:
    protocol, transport, gate = connect(ConnectionLimits(head_timeout=0.2))
    before = shed_count("slow_head")
    started = time.monotonic()
    protocol.data_received(b"GET /x HTTP/1.1\r\n")
    assert protocol._head_timer is not None
    protocol.data_received(b"X-Slow: a")  # bytes keep coming: the deadline stays
    await until(lambda: transport.closed)
    assert time.monotonic() - started >= 0.19
    assert transport.writes[-1].startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert transport.writes[-1].endswith(b"request head not complete within 0.2 s\n")
    assert shed_count("slow_head") == before + 1
    protocol.connection_lost(None)
    assert len(gate) == 0


async def test_a_head_completed_in_time_is_answered_and_its_timer_dropped() -> None:
    protocol, transport, _ = connect(ConnectionLimits(head_timeout=0.2))
    protocol.data_received(b"GET /x HTTP/1.1\r\n")
    timer = protocol._head_timer
    assert timer is not None
    protocol.data_received(b"Host: x\r\n\r\n")
    assert protocol._head_timer is None and timer.cancelled()
    await until(lambda: bool(transport.writes))
    assert transport.writes[0].startswith(b"HTTP/1.1 204 ") and not transport.closed


async def test_a_websocket_upgrade_is_answered_as_an_ordinary_request() -> None:
    protocol, transport, gate = connect(ConnectionLimits())
    assert protocol.ws_protocol_class is None  # no WebSocket library needed
    protocol.data_received(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    await until(lambda: bool(transport.writes))
    assert transport.writes[0].startswith(b"HTTP/1.1 204 ")
    assert len(gate) == 1  # still under the gate's limits
