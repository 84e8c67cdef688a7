"""The HTTP protocol's fast path (web/server.py) against a stand-in app: which requests take it,
what it writes and when, and how it hands a request to uvicorn's ordinary request cycle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from coalescer.errors import StoreUnavailable
from coalescer.web.api import FAILED
from coalescer.web.fastpath import Answering
from coalescer.web.server import HeadLimitedProtocol

QUERY = b"GET /k/x?taskId=abc HTTP/1.1\r\nHost: x\r\n\r\n"


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

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(name, default)


class StandIn:
    """An app with a fast path: each query's reply is a future the test resolves; ``finish``
    returns the reply's bytes, or ``None`` (the ordinary path) when the reply is ``None``."""

    def __init__(self) -> None:
        self.started: list[tuple[str, bytes, asyncio.Future[Any]]] = []
        self.ordinary: list[dict[str, Any]] = []
        self.fast_path = self

    def start(self, path: str, query_string: bytes) -> Answering | None:
        if b"taskId=" not in query_string:
            return None
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.started.append((path, query_string, reply))
        return Answering(reply, lambda done: done.result())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.ordinary.append(scope)
        if scope["type"] != "http":
            return
        body = f"ordinary {scope['path']}?{scope['query_string'].decode()}".encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def connect(app: StandIn) -> tuple[HeadLimitedProtocol, Transport]:
    config = uvicorn.Config(app, h11_max_incomplete_event_size=8192, lifespan="off")
    config.load()
    state = ServerState()
    state.default_headers = [(b"server", b"uvicorn")]
    protocol = HeadLimitedProtocol(config=config, server_state=state, app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_query_is_answered_in_one_write_when_its_reply_comes() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(QUERY)
    assert [(p, q) for p, q, _ in app.started] == [("/k/x", b"taskId=abc")]
    await settle()
    assert transport.writes == []
    app.started[0][2].set_result(b'{"supersedes":["abc"]}')
    await settle()
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: application/json\r\n"
        b"content-length: 22\r\nx-content-type-options: nosniff\r\n\r\n"
        b'{"supersedes":["abc"]}'
    ]
    assert not transport.closed and app.ordinary == []
    protocol.data_received(QUERY)  # the connection is kept for the next one
    assert len(app.started) == 2


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /k/x?taskId=abc HTTP/1.0\r\nHost: x\r\n\r\n",
        b"HEAD /k/x?taskId=abc HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /k/x?taskId=abc HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /k/%78?taskId=abc HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /k/x HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
    ids=["http/1.0", "head", "connection-close", "escaped-path", "no-taskId"],
)
async def test_other_requests_take_the_ordinary_path(request_bytes: bytes) -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(request_bytes)
    await settle()
    assert app.started == []
    assert len(app.ordinary) == 1 and transport.writes


async def test_a_store_failure_goes_to_the_ordinary_path_in_the_scope() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(QUERY)
    failure = StoreUnavailable("frozen", reason="timeout")
    app.started[0][2].set_result(failure)  # finish gives the failure: the app's handlers answer
    await settle()
    assert len(app.ordinary) == 1 and app.ordinary[0][FAILED] is failure
    assert transport.writes[-1].endswith(b"ordinary /k/x?taskId=abc")


async def test_a_reply_the_app_cannot_finish_goes_to_the_ordinary_path() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(QUERY)
    app.started[0][2].set_result(None)  # finish gives None: the full stack must answer
    await settle()
    assert [s["path"] for s in app.ordinary] == ["/k/x"]
    assert app.ordinary[0]["method"] == "GET"
    assert app.ordinary[0]["query_string"] == b"taskId=abc"
    assert transport.writes[-1].endswith(b"ordinary /k/x?taskId=abc")
    assert not transport.closed


async def test_pipelined_requests_wait_for_the_query_in_flight_and_keep_their_order() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    second = b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n"
    protocol.data_received(QUERY + second + QUERY)
    assert len(app.started) == 1  # the others wait their turn
    await settle()
    assert transport.writes == [] and app.ordinary == []
    app.started[0][2].set_result(b"first")
    await settle()
    assert transport.writes[0].endswith(b"first")
    assert transport.writes[1].endswith(b"ordinary /other?")
    # the third, queued behind the second, went the ordinary way too
    assert transport.writes[2].endswith(b"ordinary /k/x?taskId=abc")


async def test_a_connection_lost_before_the_reply_writes_nothing() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(QUERY)
    protocol.connection_lost(None)
    app.started[0][2].set_result(b"late")
    await settle()
    assert transport.writes == []


async def test_a_shutdown_lets_the_answer_in_flight_leave_then_closes() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    protocol.data_received(QUERY)
    protocol.shutdown()
    assert not transport.closed
    app.started[0][2].set_result(b"last")
    await settle()
    assert transport.writes[-1].endswith(b"last") and transport.closed


async def test_a_query_with_a_body_is_answered_and_its_body_dropped() -> None:
    app = StandIn()
    protocol, transport = connect(app)
    body = b"x" * 10
    chunked = b"GET /k/x?taskId=abc HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    protocol.data_received(
        b"GET /k/x?taskId=abc HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + body[:4]
    )
    app.started[0][2].set_result(b"one")  # answered before its body is all in
    await settle()
    protocol.data_received(body[4:] + chunked + b"3\r\nabc\r\n0\r\n\r\n" + QUERY)
    app.started[1][2].set_result(b"two")
    await settle()
    assert [w[-5:] for w in transport.writes[:2]] == [b"\r\none", b"\r\ntwo"]
    # the third came behind the second while it was in flight: the ordinary path, in turn
    assert transport.writes[2].endswith(b"ordinary /k/x?taskId=abc")
    assert len(app.started) == 2 and not transport.closed
