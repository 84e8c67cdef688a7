"""``coalescer serve`` as a real process: its port checked and named, a line when a signal stops
it, and ``--workers N`` processes sharing one port with their metrics added up."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import taskcluster

from tests.conftest import make_message

BIN = Path(sys.executable).parent
SERVING = re.compile(r"serving on http://127\.0\.0\.1:(\d+) ")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "PROMETHEUS_"))
        and k not in ("REDIS_URL", "PORT", "WEB_CONCURRENCY")
    }
    env.update(COALESCER_LOG_FORMAT="text", PYTHONUNBUFFERED="1", **extra)
    return env


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "coalescer"), "serve", *args],
        env=environment(**env),
        capture_output=True,
        text=True,
        timeout=30,
    )


class Serving:
    """A ``coalescer serve`` process started with ``--port 0``, and the port it named."""

    def __init__(self, log: Path, *args: str, **env: str) -> None:
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "coalescer"), "serve", "--port", "0", *args],
                env=environment(**env),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            self._answering(time.monotonic() + 30)
        except BaseException:
            # Not yet in the test's list: stopped here, or it would outlive the test.
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise

    def _answering(self, deadline: float) -> None:
        while not (found := SERVING.search(self.text())):
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no 'serving on' line:\n{self.text()}"
            time.sleep(0.05)
        self.port = int(found.group(1))
        self.base = f"http://127.0.0.1:{self.port}"
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

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def workers(self) -> list[int]:
        """The worker processes (multiprocessing's resource tracker, a child too, is not)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [
            int(pid)
            for pid in path.read_text().split()
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[list[Serving]]:
    started: list[Serving] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--port", "99999"], {}, "--port must be from 1 to 65535 (0: any free port), not 99999"),
        (["--port", "-5"], {}, "--port must be from 1 to 65535 (0: any free port), not -5"),
        ([], {"PORT": "70000"}, "PORT must be from 1 to 65535 (0: any free port), not 70000"),
        (["--workers", "0"], {}, "--workers must be a whole number from 1 to 256, not '0'"),
        ([], {"WEB_CONCURRENCY": "two"}, "WEB_CONCURRENCY must be a whole number from 1 to 256"),
        (
            ["--workers", "2"],
            {},
            "2 worker processes need REDIS_URL: the embedded store lives in one process",
        ),
        (
            [],
            {"WEB_CONCURRENCY": "3"},
            "3 worker processes need REDIS_URL: the embedded store lives in one process",
        ),
    ],
)
def test_bad_serve_settings_exit_2_with_one_line(
    args: list[str], env: dict[str, str], said: str
) -> None:
    done = run(*args, **env)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr


def test_a_port_in_use_is_one_line_and_exit_1(serving: list[Serving], tmp_path: Path) -> None:
    serving.append(first := Serving(tmp_path / "first.log"))
    done = run("--port", str(first.port))
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{first.port}" in done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_port_0_names_the_port_bound_and_a_signal_logs_the_shutdown(
    serving: list[Serving], tmp_path: Path, sig: signal.Signals
) -> None:
    serving.append(s := Serving(tmp_path / "serve.log"))
    assert s.port != 0
    r = httpx.get(f"{s.base}/k?taskId={taskcluster.slugid.nice()}", timeout=5)
    assert r.status_code == 200 and len(r.json()["supersedes"]) == 1
    s.stop(sig)
    lines = s.text().splitlines()
    shutting = [i for i, line in enumerate(lines) if f"received {sig.name}: shutting down" in line]
    stopped = [i for i, line in enumerate(lines) if line.endswith("coalescer.web: stopped")]
    assert shutting and stopped and shutting[0] < stopped[0], lines


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def ask_many(base: str, queries: int, pending: list[str]) -> None:
    async def ask(task: str) -> None:
        # A client per query: a new connection each, which either process may accept.
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"{base}/mp.k?taskId={task}")
            assert r.status_code == 200, r.text
            assert sorted(r.json()["supersedes"]) == sorted(pending)

    await asyncio.gather(*(ask(pending[i % len(pending)]) for i in range(queries)))


def test_workers_share_the_port_and_metrics_add_up_over_every_process(
    serving: list[Serving], tmp_path: Path, redis_client: Any, redis_url: str
) -> None:
    serving.append(
        s := Serving(
            tmp_path / "serve.log",
            "--workers",
            "2",
            REDIS_URL=redis_url,
            COALESCER_INGEST_TOKEN="s3cret",
        )
    )
    assert "2 worker processes" in s.text()
    children = s.workers()
    assert len(children) == 2, children
    environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
    (metrics_dir,) = [
        Path(v.split(b"=", 1)[1].decode())
        for v in environ
        if v.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
    ]
    pending = [taskcluster.slugid.nice() for _ in range(3)]
    r = httpx.post(
        f"{s.base}/v1/events",
        json=[make_message(t, routes=("coalesce.v1.mp.k",)) for t in pending],
        headers={"authorization": "Bearer s3cret"},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    queries = 60
    asyncio.run(ask_many(s.base, queries, pending))
    # Each process counts its own answers at its next flush (about a second).
    deadline = time.monotonic() + 20
    while True:
        body = httpx.get(f"{s.base}/metrics", timeout=5).text
        if metric(body, "coalescer_queries_total") == queries:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    # Every process wrote its own counters there: both answered.
    writers = {p.name.rsplit("_", 1)[1] for p in metrics_dir.glob("counter_*.db")}
    assert {str(c) for c in children} <= {w.removesuffix(".db") for w in writers}, writers
    # Scraped again (either process may answer): the same total.
    for _ in range(5):
        body = httpx.get(f"{s.base}/metrics", timeout=5).text
        assert metric(body, "coalescer_queries_total") == queries
    assert s.stop(signal.SIGTERM) == 0
    assert "received SIGTERM: shutting down the worker processes" in s.text()
    assert not metrics_dir.exists()


def test_workers_stop_when_serve_is_killed_outright_and_the_next_serve_tidies_up(
    serving: list[Serving], tmp_path: Path, redis_client: Any, redis_url: str
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"REDIS_URL": redis_url, "TMPDIR": str(scratch)}
    serving.append(s := Serving(tmp_path / "serve.log", "--workers", "2", **env))
    workers = s.workers()
    assert len(workers) == 2
    (left,) = scratch.glob("coalescer-metrics-*")
    s.stop(signal.SIGKILL)
    deadline = time.monotonic() + 20
    while alive := [pid for pid in workers if Path(f"/proc/{pid}").exists() and not zombie(pid)]:
        assert time.monotonic() < deadline, f"workers {alive} outlived serve"
        time.sleep(0.1)
    assert left.is_dir()  # nothing could remove it: its owner was killed outright
    serving.append(again := Serving(tmp_path / "again.log", "--workers", "2", **env))
    assert not left.exists()
    (now,) = scratch.iterdir()
    assert now.name.startswith(f"coalescer-metrics-{again.proc.pid}@")


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return False
