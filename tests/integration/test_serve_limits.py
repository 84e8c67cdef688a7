"""A real ``coalescer serve`` process under idle and slow clients: connections that send no
request, or their request head a byte at a time, are closed after their timeouts; more
connections than its file descriptors allow do not keep new clients out; what it closes is
logged and counted in ``/metrics``. Every client is on loopback, their number and time bounded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import taskcluster

from tests.ports import free_port

BIN = Path(sys.executable).parent
#: Idle connections opened against a process that may open fewer files than that.
FLOOD = 10_000
SERVER_FILES = 4096
SLOW_HEADS = 1000

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _limit_files(files: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))


class Service:
    """``coalescer serve`` on a free loopback port (at most ``files`` open files when given),
    answering its heartbeat; killed on the way out."""

    def __init__(self, log: Path, env: dict[str, str], files: int | None = None) -> None:
        self.log = log
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        environ = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("COALESCER_", "PULSE_", "PROMETHEUS_"))
            and k not in ("REDIS_URL", "PORT", "WEB_CONCURRENCY", "TASKCLUSTER_ROOT_URL")
        }
        environ.update(COALESCER_LOG_FORMAT="text", PYTHONUNBUFFERED="1", **env)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "coalescer"), "serve", "--port", str(self.port)],
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=None if files is None else (lambda: _limit_files(files)),
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.base}/__lbheartbeat__", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"not answering:\n{self.text()}"
            time.sleep(0.05)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        r = httpx.get(f"{self.base}/metrics", timeout=5)
        assert r.status_code == 200, r.text
        return r.text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=20)


@pytest.fixture
def services() -> Iterator[list[Service]]:
    started: list[Service] = []
    yield started
    for s in started:
        s.close()


def metric(text: str, sample: str) -> float:
    """The value of one sample (``name{labels}``) of a ``/metrics`` body; 0 when absent."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def shed(text: str, reason: str) -> float:
    return metric(text, f'coalescer_connections_shed_total{{reason="{reason}"}}')


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """A client that opens a connection of its own for each request, as a new client does."""
    with httpx.Client(timeout=5, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        yield c


def new_client_query(client: httpx.Client, base: str) -> float:
    """Seconds a new client (a connection of its own) takes to get a superseding answer."""
    task = taskcluster.slugid.nice()
    started = time.monotonic()
    r = client.get(f"{base}/k?taskId={task}")
    took = time.monotonic() - started
    assert r.status_code == 200 and r.json() == {"supersedes": [task]}, r.text
    return took


def logged_closes(text: str) -> int:
    """Connections the log says were closed: a first line, then summaries with a count."""
    first = text.count("closed a connection from ")
    more = sum(int(n) for n in re.findall(r"closed (\d+) more connections? in the last", text))
    return first + more


class Herd:
    """Many non-blocking client sockets to one port, and when the server closed each."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: dict[int, socket.socket] = {}
        self.opened: dict[int, float] = {}
        self.closed: dict[int, float] = {}
        self.answers: dict[int, bytes] = {}
        self.failed = 0
        self._poll = select.poll()

    def open(self, count: int, deadline: float) -> None:
        """Open ``count`` connections, ``batch`` at a time, each batch established (or
        refused) before the next."""
        batch = 500
        for start in range(0, count, batch):
            # When the batch began: no later than the server took any of its connections (a
            # busy test process may notice a connection made well after it was).
            began = time.monotonic()
            pending: dict[int, socket.socket] = {}
            for _ in range(min(batch, count - start)):
                s = socket.socket()
                s.setblocking(False)
                err = s.connect_ex(("127.0.0.1", self.port))
                assert err in (0, errno.EINPROGRESS), os.strerror(err)
                pending[s.fileno()] = s
            poll = select.poll()
            for fd in pending:
                poll.register(fd, select.POLLOUT)
            while pending:
                assert time.monotonic() < deadline, f"{len(pending)} connections not made"
                for fd, _ in poll.poll(100):
                    s = pending.pop(fd)
                    poll.unregister(fd)
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        self.failed += 1
                        s.close()
                        continue
                    self.socks[fd] = s
                    self.opened[fd] = began
                    self._poll.register(fd, select.POLLIN)

    def send(self, data: bytes) -> None:
        """Send ``data`` on every connection still open (one write each, small)."""
        for fd, s in self.socks.items():
            if fd not in self.closed:
                with contextlib.suppress(OSError):
                    s.send(data)

    def watch(self, seconds: float) -> None:
        """Note, for ``seconds``, each connection the server closes (and what it sent)."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0 and len(self.closed) < len(self.socks):
            for fd, _ in self._poll.poll(max(1, int(left * 1000))):
                now = time.monotonic()
                try:
                    data = self.socks[fd].recv(65536)
                except ConnectionResetError:
                    data = b""
                except BlockingIOError:
                    continue
                if data:
                    self.answers[fd] = self.answers.get(fd, b"") + data
                    continue
                self.closed.setdefault(fd, now)
                self._poll.unregister(fd)

    def still_open(self) -> int:
        return len(self.socks) - len(self.closed)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()


@contextlib.contextmanager
def herd(port: int) -> Iterator[Herd]:
    h = Herd(port)
    try:
        yield h
    finally:
        h.close()


def _room_for(files: int) -> None:
    """This test process may open ``files`` files (raising its soft limit as far as allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < files:
        assert hard == resource.RLIM_INFINITY or hard >= files, (
            f"this test opens {files} connections: raise the hard limit of open files "
            f"(ulimit -Hn {hard})"
        )
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))


def test_idle_connections_past_the_descriptor_limit_do_not_keep_new_clients_out(
    services: list[Service],
    client: httpx.Client,
    tmp_path: Path,
    redis_client: Any,
    redis_url: str,
) -> None:
    _room_for(FLOOD + 1000)
    # The idle timeout is long: the cap alone must make room for the new clients.
    s = Service(
        tmp_path / "serve.log",
        {"REDIS_URL": redis_url, "COALESCER_IDLE_TIMEOUT": "120"},
        files=SERVER_FILES,
    )
    services.append(s)
    with herd(s.port) as idle:
        idle.open(FLOOD, deadline=time.monotonic() + 60)
        idle.watch(0.5)
        # New clients, each on a connection of its own, are answered at once: not after the
        # 120 s idle timeout (the bound leaves room for a busy machine).
        took = [new_client_query(client, s.base) for _ in range(20)]
        assert max(took) < 3.0, took
        body = s.metrics()
        limit = metric(body, "coalescer_connections_limit")
        assert 0 < limit < SERVER_FILES
        held = metric(body, "coalescer_connections_open")
        print(
            f"\n{FLOOD} idle connections opened ({idle.failed} refused); the server held "
            f"{held:.0f} (limit {limit:.0f}, {SERVER_FILES} files); new clients answered in "
            f"{min(took) * 1000:.1f}-{max(took) * 1000:.1f} ms"
        )
        assert held <= limit
        assert shed(body, "over_limit") >= FLOOD - limit
        # The oldest idle connections made room: the newest are still open.
        idle.watch(0.5)
        assert idle.still_open() >= limit // 2
    assert "(COALESCER_MAX_CONNECTIONS)" in s.text()


def test_slow_request_heads_are_closed_after_the_head_timeout(
    services: list[Service],
    client: httpx.Client,
    tmp_path: Path,
    redis_client: Any,
    redis_url: str,
) -> None:
    timeout = 3.0
    env = {
        "REDIS_URL": redis_url,
        "COALESCER_HEAD_TIMEOUT": str(timeout),
        "COALESCER_CONNECTION_REPORT_SECONDS": "1",
    }
    s = Service(tmp_path / "serve.log", env)
    services.append(s)
    with herd(s.port) as slow:
        slow.open(SLOW_HEADS, deadline=time.monotonic() + 30)
        assert slow.failed == 0
        began = time.monotonic()
        slow.send(b"GET /k?taskId=" + taskcluster.slugid.nice().encode() + b" HTTP/1.1\r\n")
        slow.send(b"X-Slow: ")
        # A byte a second, every connection, until the server has closed them all.
        # Answered while they trickle: before the head timeout closes any of them.
        assert new_client_query(client, s.base) < timeout
        while slow.still_open() and time.monotonic() - began < timeout + 10:
            slow.send(b"a")
            slow.watch(1.0)
        assert slow.still_open() == 0, f"{slow.still_open()} slow heads still open"
        after = sorted(slow.closed[fd] - began for fd in slow.socks)
        print(
            f"\n{SLOW_HEADS} slow heads closed {after[0]:.2f}-{after[-1]:.2f} s after they "
            f"began (COALESCER_HEAD_TIMEOUT={timeout:g})"
        )
        assert after[0] >= timeout - 0.2, after[:5]
        assert after[-1] <= timeout + 5, after[-5:]  # room for a busy machine
        assert len(slow.answers) == SLOW_HEADS
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in slow.answers.values())
    assert new_client_query(client, s.base) < timeout
    assert shed(s.metrics(), "slow_head") == SLOW_HEADS
    # The first is logged at once, the rest in summaries a second apart (the setting).
    deadline = time.monotonic() + 20
    while logged_closes(s.text()) < SLOW_HEADS:
        assert time.monotonic() < deadline, s.text()[-3000:]
        time.sleep(0.2)
    assert logged_closes(s.text()) == SLOW_HEADS
    assert "(COALESCER_HEAD_TIMEOUT)" in s.text()


def test_connections_are_closed_when_no_request_comes_within_the_idle_timeout(
    services: list[Service], tmp_path: Path, redis_client: Any, redis_url: str
) -> None:
    timeout, count = 1, 500
    s = Service(
        tmp_path / "serve.log", {"REDIS_URL": redis_url, "COALESCER_IDLE_TIMEOUT": str(timeout)}
    )
    services.append(s)
    with herd(s.port) as idle:
        # One connection that asked a question first: kept as long, and not counted.
        idle.open(1, deadline=time.monotonic() + 10)
        idle.send(b"GET /v1/ping HTTP/1.1\r\nHost: x\r\n\r\n")
        idle.open(count, deadline=time.monotonic() + 30)
        began = time.monotonic()
        idle.watch(timeout + 5)
        assert idle.still_open() == 0, f"{idle.still_open()} idle connections still open"
        after = sorted(idle.closed[fd] - idle.opened[fd] for fd in idle.socks)
        print(f"\n{count + 1} idle connections closed {after[0]:.2f}-{after[-1]:.2f} s in")
        assert after[0] >= timeout - 0.2, after[:5]
        assert max(idle.closed.values()) - began <= timeout + 4  # room for a busy machine
        (asked,) = idle.answers.values()
        assert asked.startswith(b"HTTP/1.1 200 "), asked
    body = s.metrics()
    assert shed(body, "idle") == count
    assert "(COALESCER_IDLE_TIMEOUT)" in s.text()


@pytest.mark.parametrize(
    ("env", "said"),
    [
        (
            {"COALESCER_MAX_CONNECTIONS": "5000"},
            "COALESCER_MAX_CONNECTIONS=5000 needs ",
        ),
        ({"COALESCER_HEAD_TIMEOUT": "0"}, "COALESCER_HEAD_TIMEOUT must be more than 0"),
        ({"COALESCER_IDLE_TIMEOUT": "soon"}, "COALESCER_IDLE_TIMEOUT must be a whole number"),
    ],
)
def test_limits_that_cannot_hold_stop_serve_with_one_line(
    tmp_path: Path, env: dict[str, str], said: str
) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("COALESCER_")}
    done = subprocess.run(
        [str(BIN / "coalescer"), "serve", "--port", "0"],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: _limit_files(1024),
    )
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
