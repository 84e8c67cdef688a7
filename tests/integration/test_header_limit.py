"""A real ``coalescer serve`` process refuses a huge request head without buffering it, and
keeps answering queries on other connections; ordinary heads and large bodies pass."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import taskcluster

from tests.conftest import make_message
from tests.serving import serving

LIMIT = 16 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def service(redis_client: Any, redis_url: str, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``(base URL, pid)`` of a ``coalescer serve`` process with the default head limit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(REDIS_URL=redis_url, COALESCER_INGEST_TOKEN="s3cret")
    with serving(env, tmp_path / "serve.log") as (base, proc):
        yield base, proc.pid


def query(base: str, task: str) -> Any:
    r = httpx.get(f"{base}/k?taskId={task}", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_huge_header_is_refused_unread_while_queries_are_answered(
    service: tuple[str, int],
) -> None:
    base, pid = service
    task = taskcluster.slugid.nice()
    r = httpx.post(
        f"{base}/v1/events",
        json=make_message(task),
        headers={"Authorization": "Bearer s3cret"},
        timeout=5,
    )
    assert r.json()["results"][0]["status"] == "applied"
    assert query(base, task) == {"supersedes": [task]}
    rss_before = rss_bytes(pid)

    flood = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10)
    try:
        flood.sendall(b"GET /k?taskId=" + task.encode() + b" HTTP/1.1\r\nHost: x\r\nX-Big: ")
        flood.sendall(b"a" * (LIMIT // 2))  # a head still growing, under the limit
        assert query(base, task) == {"supersedes": [task]}  # another connection is served
        sent, total, chunk = LIMIT // 2, 64 << 20, b"a" * (64 << 10)
        try:
            while sent < total:
                flood.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = flood.recv(4096)
        except ConnectionResetError:
            answer = b""  # closed with our bytes unread: the kernel resets instead
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer
    finally:
        flood.close()
    # The server stopped reading: what got through is what the sockets' buffers hold.
    assert sent < total // 2, f"the server took {sent} bytes of one head"
    assert rss_bytes(pid) - rss_before < 16 << 20
    assert query(base, task) == {"supersedes": [task]}
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    assert 'coalescer_http_errors_total{status="431"} 1.0' in metrics


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_ordinary_heads_and_large_bodies_pass(service: tuple[str, int]) -> None:
    base, _ = service
    task = taskcluster.slugid.nice()
    r = httpx.get(f"{base}/k?taskId={task}", headers={"cookie": "c" * (LIMIT // 2)}, timeout=5)
    assert r.json() == {"supersedes": [task]}
    r = httpx.get(f"{base}/k?taskId={task}", headers={"x-big": "b" * LIMIT}, timeout=5)
    assert r.status_code == 431
    # One write of a small head and a body far larger than the head limit.
    tasks = [taskcluster.slugid.nice() for _ in range(400)]
    body = orjson.dumps([make_message(t) for t in tasks])
    assert len(body) > 10 * LIMIT
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    results = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])["results"]
    assert [r["status"] for r in results] == ["applied"] * len(tasks)
