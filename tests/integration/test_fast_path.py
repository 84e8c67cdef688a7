"""The server's fast path for superseding queries (web/server.py), on a real ``coalescer serve``
and a Redis of the test's own: its answers are the ordinary path's to the byte, requests
pipelined on one connection are answered in order whichever path each takes, and whatever the
fast path cannot answer (bad input, a frozen or emptied Redis, a client gone) is answered as
the ordinary path answers it. And a plain query does take it, under the installed uvicorn."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import taskcluster
import uvicorn

from coalescer.settings import Settings
from coalescer.web import server
from coalescer.web.app import create_app
from coalescer.web.connections import ConnectionLimits
from coalescer.web.fastpath import Answering
from tests.conftest import make_message
from tests.redis_server import RedisServer, redis_server
from tests.serving import serving

TOKEN = "fast-path-token"
TASKS = [taskcluster.slugId() for _ in range(5)]  # oldest first


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def service(redis: RedisServer, tmp_path: Path) -> Iterator[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_")) and k != "REDIS_URL"
    }
    env.update(REDIS_URL=redis.url, COALESCER_INGEST_TOKEN=TOKEN, COALESCER_QUERY_TIMEOUT="0.5")
    with serving(env, tmp_path / "serve.log") as (base, _):
        _post(
            base,
            [make_message(t, scheduled=f"2030-01-01T00:00:0{i}.000Z") for i, t in enumerate(TASKS)],
        )
        yield base


def _post(base: str, messages: list[dict[str, object]]) -> None:
    r = httpx.post(
        f"{base}/v1/events",
        content=orjson.dumps(messages),
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _exchange(base: str, raw: bytes, responses: int, timeout: float = 10) -> list[bytes]:
    """Send ``raw`` on one connection; the ``responses`` responses read back, each whole."""
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=timeout) as sock:
        sock.sendall(raw)
        data = b""
        out: list[bytes] = []
        while len(out) < responses:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                assert chunk, f"connection closed after {out!r} and {data!r}"
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(rest) < length:
                chunk = sock.recv(65536)
                assert chunk
                rest += chunk
            out.append(head + b"\r\n\r\n" + rest[:length])
            data = rest[length:]
        return out


def _get(path: str, *, version: str = "1.1", extra: str = "") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def _parts(response: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines)
    return status, headers, body


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_fast_answer_is_the_ordinary_one_to_the_byte(service: str) -> None:
    path = f"/k?taskId={TASKS[2]}"
    (fast,) = _exchange(service, _get(path), 1)
    # HTTP/1.0 and a body-less POST-like oddity never take the fast path: HTTP/1.0 is ordinary.
    (ordinary,) = _exchange(service, _get(path, version="1.0"), 1)
    f_status, f_headers, f_body = _parts(fast)
    o_status, o_headers, o_body = _parts(ordinary)
    assert f_status == o_status == b"HTTP/1.1 200 OK"
    assert f_body == o_body
    assert orjson.loads(f_body) == {"supersedes": TASKS}
    # The ordinary path closes an HTTP/1.0 connection (uvicorn 0.53 and later also say so).
    o_headers.pop(b"connection", None)
    f_headers.pop(b"date"), o_headers.pop(b"date")
    assert list(f_headers.items()) == list(o_headers.items())


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_age_and_size_thresholds_hold_on_the_fast_path_as_on_the_ordinary_one(
    service: str,
) -> None:
    # Pending since 2020 (waited years) under "old"; the fixture's "k" tasks since 2030 (not yet).
    waited = [taskcluster.slugId() for _ in range(3)]
    _post(
        service,
        [
            make_message(t, routes=("coalesce.v1.old",), scheduled=f"2020-01-01T00:00:0{i}.000Z")
            for i, t in enumerate(waited)
        ],
    )
    expected = {
        f"/old?taskId={waited[2]}": waited,  # no threshold
        f"/old?taskId={waited[2]}&age=60": waited,  # the oldest has waited more than a minute
        f"/k?taskId={TASKS[4]}&age=60": [TASKS[4]],  # ... and here not at all
        f"/old?taskId={waited[2]}&size=3": [waited[2]],  # not more than 3 pending
        f"/old?taskId={waited[2]}&age=60&size=2": waited,
    }
    for path, answer in expected.items():
        (fast,) = _exchange(service, _get(path), 1)
        (ordinary,) = _exchange(service, _get(path, version="1.0"), 1)
        assert _parts(fast)[2] == _parts(ordinary)[2], path
        assert orjson.loads(_parts(fast)[2]) == {"supersedes": answer}, path


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_pipelined_requests_are_answered_in_order_whatever_path_each_takes(
    service: str,
) -> None:
    requests = [
        _get(f"/k?taskId={TASKS[0]}"),
        _get("/__lbheartbeat__"),
        _get(f"/k?taskId={TASKS[4]}&size=100"),  # a threshold unmet: the task alone
        _get("/k?taskId=not*a*task"),  # bad input: the ordinary path's 400
        _get("/k", extra="Accept: application/json\r\n"),  # the key's listing
        _get(f"/k?taskId={TASKS[3]}"),
    ]
    answers = _exchange(service, b"".join(requests), len(requests))
    statuses = [_parts(a)[0] for a in answers]
    assert (
        statuses
        == [b"HTTP/1.1 200 OK"] * 3 + [b"HTTP/1.1 400 Bad Request"] + [b"HTTP/1.1 200 OK"] * 2
    )
    bodies = [orjson.loads(_parts(a)[2]) for a in answers]
    assert bodies[0] == {"supersedes": TASKS}
    assert bodies[2] == {"supersedes": [TASKS[4]]}
    assert "taskId" in bodies[3]["error"]
    assert [t["taskId"] for t in bodies[4]["pending"]] == TASKS
    assert bodies[5] == {"supersedes": TASKS}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_frozen_redis_is_the_ordinary_503_and_a_thawed_one_answers_again(
    service: str, redis: RedisServer
) -> None:
    path = f"/k?taskId={TASKS[1]}"
    redis.freeze()
    try:
        (json_answer, page) = (
            _exchange(service, _get(path), 1)[0],
            _exchange(service, _get(path, extra="Accept: text/html\r\n"), 1)[0],
        )
    finally:
        redis.thaw()
    status, headers, body = _parts(json_answer)
    assert status == b"HTTP/1.1 503 Service Unavailable"
    assert headers[b"retry-after"] == b"2"
    assert "unavailable" in orjson.loads(body)["error"]
    status, headers, body = _parts(page)
    assert status == b"HTTP/1.1 503 Service Unavailable"
    assert headers[b"content-type"].startswith(b"text/html")
    deadline = time.monotonic() + 10
    while True:  # the lean connection was dropped by its watchdog: it reconnects on demand
        status, _, body = _parts(_exchange(service, _get(path), 1)[0])
        if status == b"HTTP/1.1 200 OK" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert orjson.loads(body) == {"supersedes": TASKS}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_an_emptied_redis_is_answered_by_the_ordinary_path(
    service: str, redis: RedisServer
) -> None:
    redis.client.flushall()  # the scripts go too: the fast read answers NOSCRIPT
    r = httpx.get(f"{service}/k", params={"taskId": TASKS[1]}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"supersedes": [TASKS[1]]}  # unknown now: answered alone
    r = httpx.get(f"{service}/k", params={"taskId": TASKS[1]}, timeout=10)
    assert r.json() == {"supersedes": [TASKS[1]]}


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_client_gone_before_its_answer_leaves_the_server_serving(
    service: str, redis: RedisServer
) -> None:
    redis.freeze()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", _port(service)), timeout=5) as sock:
                sock.sendall(_get(f"/k?taskId={TASKS[0]}"))
            # closed at once, its query still waiting for Redis
    finally:
        redis.thaw()
    deadline = time.monotonic() + 10
    while True:  # the abandoned queries answered (or timed out): a new client is served
        status, _, _ = _parts(_exchange(service, _get(f"/k?taskId={TASKS[0]}"), 1)[0])
        if status == b"HTTP/1.1 200 OK":
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    with httpx.Client(base_url=service, timeout=10) as client:  # keep-alive: one connection
        for task in TASKS:
            r = client.get("/k", params={"taskId": task})
            assert r.status_code == 200 and r.json() == {"supersedes": TASKS}


class _Recorder:
    """The service's app, recording the path of every HTTP request that reaches it through ASGI
    (uvicorn's ordinary request cycle); the fast path finds the app beneath (``.app``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_query_takes_the_fast_path_under_the_installed_uvicorn(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve`` as the CLI runs it, in a thread: a plain query is answered without reaching the
    ASGI app. The fast path subclasses uvicorn's private ``HttpToolsProtocol`` (pyproject.toml
    bounds uvicorn above for it): a uvicorn whose protocol no longer calls the subclass's hooks,
    or whose app wrapping hides the app, answers the query the ordinary way, and fails this."""
    settings = Settings.from_environ({"REDIS_URL": redis.url, "COALESCER_INGEST_TOKEN": TOKEN})
    app = create_app(settings)
    started: list[bool] = []
    fast_path = app.fast_path  # type: ignore[attr-defined]
    start = fast_path.start

    def spy(path: str, query_string: bytes) -> Answering | None:
        answering = start(path, query_string)
        started.append(answering is not None)
        return answering

    fast_path.start = spy
    recorder = _Recorder(app)
    servers: list[uvicorn.Server] = []

    class Server(server._Server):
        def __init__(self, config: uvicorn.Config) -> None:
            super().__init__(config)
            servers.append(self)

    monkeypatch.setattr(server, "_Server", Server)
    sock = server.bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    limits = ConnectionLimits(max_connections=100)
    thread = threading.Thread(
        target=server.serve,
        args=(recorder,),
        kwargs={"sock": sock, "max_header_bytes": settings.max_header_bytes, "limits": limits},
        daemon=True,
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not (servers and servers[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.02)
        _post(
            base,
            [make_message(t, scheduled=f"2030-01-01T00:00:0{i}.000Z") for i, t in enumerate(TASKS)],
        )
        recorder.paths.clear()
        (answer,) = _exchange(base, _get(f"/k?taskId={TASKS[1]}"), 1)
        assert orjson.loads(_parts(answer)[2]) == {"supersedes": TASKS}
        assert started == [True], "the query did not start on the fast path"
        assert recorder.paths == [], "the query went through uvicorn's ordinary request cycle"
        _exchange(base, _get("/k?taskId=not-a-slug"), 1)  # bad input: the ordinary path
        assert recorder.paths == ["/k"], "the ordinary path is not what the recorder sees"
    finally:
        for running in servers:
            running.should_exit = True
        thread.join(timeout=20)
        sock.close()
    assert not thread.is_alive()
