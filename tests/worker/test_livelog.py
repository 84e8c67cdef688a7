"""The reference worker's live log: followed through the queue while the command runs, then
kept as ``live_backing.log``; tokens, disconnecting readers, a port in use, and no option."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Shim
from coalescer.worker import livelog as livelog_module
from coalescer.worker.livelog import LiveLogServer, TaskLog
from tests.ports import free_port
from tests.worker.support import QUEUE, Superseder, Tasks, poll, resolved, running

LOG = "public/logs/live.log"
BACKING = "public/logs/live_backing.log"
CLAIM_TIMEOUT = 1200

#: Prints three lines, slowly, then waits for the file $GO before its last line.
SLOW = """\
import os, time
for i in range(3):
    print(f"line {i}", flush=True)
    time.sleep(0.05)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.02)
print("the end", flush=True)
"""


def slow_payload(go: Path) -> dict[str, Any]:
    return {"command": [sys.executable, "-c", SLOW], "env": {"GO": str(go)}}


async def read_until(chunks: AsyncIterator[bytes], body: bytearray, text: bytes) -> None:
    async with asyncio.timeout(10):
        while text not in body:
            body += await anext(chunks)


def artifacts(tasks: Tasks, task_id: str) -> dict[str, str]:
    """The latest run's artifacts: name -> storage type."""
    listed = tasks.emulator.queue().listLatestArtifacts(task_id)["artifacts"]
    return {a["name"]: a["storageType"] for a in listed}


def worker_env(emulator: QueueEmulator) -> dict[str, str]:
    return {
        **os.environ,
        "TASKCLUSTER_ROOT_URL": emulator.root_url,
        "TASKCLUSTER_CLIENT_ID": "worker",
        "TASKCLUSTER_ACCESS_TOKEN": "no-secret",
        "COALESCER_LOG_FORMAT": "text",
    }


def worker_argv(*extra: str) -> list[str]:
    argv = [sys.executable, "-m", "coalescer.cli", "worker", "--task-queue-id", QUEUE]
    return [*argv, "--worker-group", "wg", "--worker-id", "cli", *extra]


async def test_the_live_log_is_followed_through_the_queue_then_refers_to_its_backing_copy(
    queue_emulator: QueueEmulator, tasks: Tasks, superseder: Superseder, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    old = tasks.create(payload={"command": ["true"]})
    new = tasks.create(payload=slow_payload(go))
    superseder.lists["k"] = [old, new]
    queue = queue_emulator.queue()
    port = free_port()
    argv = worker_argv("--superseder-allow", superseder.url, "--livelog-port", str(port))
    proc = await asyncio.create_subprocess_exec(
        *argv, env=worker_env(queue_emulator), stderr=subprocess.PIPE
    )
    try:
        await poll(lambda: LOG in artifacts(tasks, new), within=15, what="the live log artifact")
        live = queue.latestArtifact(new, LOG)
        assert live["storageType"] == "reference"
        assert live["url"].startswith(f"http://127.0.0.1:{port}/log/")
        through_queue = queue.buildUrl("getLatestArtifact", new, LOG)
        async with httpx.AsyncClient(follow_redirects=True, timeout=10) as http:
            async with http.stream("GET", through_queue) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/plain")
                chunks, body = response.aiter_raw(), bytearray()
                await read_until(chunks, body, b"line 2\n")
                assert tasks.status(new)["state"] == "running"  # it waits for us
                assert b"\nthe end\n" not in body
                # Another reader goes away mid-stream: nothing else notices.
                async with http.stream("GET", live["url"]) as other:
                    assert (await anext(other.aiter_raw())).startswith(b"[coalescer-worker]")
                go.touch()
                async with asyncio.timeout(10):
                    async for chunk in chunks:  # ends when the run's log does
                        body += chunk
            assert b"line 0\nline 1\nline 2\nthe end\n" in body
            assert b"exit code 0" in body

            await poll(resolved(tasks, new, old))
            assert tasks.last_run(new)["state"] == "completed"
            after = queue.latestArtifact(new, LOG)
            assert after == {
                "storageType": "reference",
                "url": queue.buildUrl("getArtifact", new, "0", BACKING),
            }
            assert artifacts(tasks, new)[BACKING] == "s3"
            kept = await http.get(through_queue)
            assert kept.status_code == 200 and kept.content == body

            # The live URL is gone with the run; another token never existed.
            assert (await http.get(live["url"])).status_code == 404
            guessed = live["url"].rsplit("/", 1)[0] + "/" + secrets.token_urlsafe(32)
            assert (await http.get(guessed)).status_code == 404
        # The superseded task never ran: no live log, only a backing log that says so.
        assert artifacts(tasks, old) == {"public/superseded-by.json": "s3", BACKING: "s3"}
        assert f"task {new} run 0 superseded it" in tasks.artifact(old, 0, BACKING)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            _, stderr = await proc.communicate()
        assert proc.returncode == 0, stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()  # its error output read to the end: the pipe closes


@pytest.fixture
async def server() -> AsyncIterator[LiveLogServer]:
    async with LiveLogServer("127.0.0.1", 0) as s:
        yield s


async def test_a_reader_gets_the_log_from_its_start_and_a_wrong_token_gets_404(
    server: LiveLogServer,
) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        with TaskLog() as tlog, server.publish(tlog) as url:
            tlog.write(b"one\n")
            async with http.stream("GET", url) as early:
                chunks, body = early.aiter_raw(), bytearray()
                await read_until(chunks, body, b"one\n")
                tlog.write(b"two\n")
                await read_until(chunks, body, b"two\n")
                late = await http.get(url.rsplit("/", 1)[0] + "/" + secrets.token_urlsafe(32))
                assert late.status_code == 404
                tlog.finish()
                tlog.write(b"ignored\n")
                async with asyncio.timeout(10):
                    async for chunk in chunks:
                        body += chunk
            assert body == b"one\ntwo\n"
            assert (await http.get(url)).content == b"one\ntwo\n"  # from the start, finished
            assert url.startswith(server.base_url + "/log/") and len(url.rsplit("/")[-1]) >= 43
        assert (await http.get(url)).status_code == 404


async def test_a_reader_that_disconnects_mid_stream_leaves_the_log_and_server_working(
    server: LiveLogServer,
) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        with TaskLog() as tlog, server.publish(tlog) as url:
            tlog.write(b"a" * 100_000)
            async with http.stream("GET", url) as gone:
                await anext(gone.aiter_raw())
            for _ in range(100):  # enough to fill the dropped connection's buffers
                tlog.write(b"b" * 10_000)
            tlog.finish()
            whole = await http.get(url)
            assert whole.content == b"a" * 100_000 + b"b" * 1_000_000 == tlog.contents()


def test_the_log_is_capped_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(livelog_module, "MAX_LOG_BYTES", 10)
    with TaskLog() as tlog:
        tlog.write(b"12345678")
        tlog.write(b"abcdef")
        tlog.write(b"more")
        assert tlog.contents() == b"12345678ab\n[coalescer-worker] log truncated\n"


async def test_a_task_stopped_before_its_end_still_gets_its_backing_log(
    shim: Shim, tasks: Tasks, queue_emulator: QueueEmulator, server: LiveLogServer, tmp_path: Path
) -> None:
    task_id = tasks.create(url="", payload=slow_payload(tmp_path / "never"))
    queue = queue_emulator.queue()
    async with running(shim, livelog=server), httpx.AsyncClient(timeout=10) as http:
        await poll(lambda: LOG in artifacts(tasks, task_id), what="the live log artifact")
        live = queue.latestArtifact(task_id, LOG)["url"]
        async with http.stream("GET", live) as response:
            chunks, body = response.aiter_raw(), bytearray()
            await read_until(chunks, body, b"line 2\n")
            await asyncio.to_thread(queue.cancelTask, task_id)
            # Time to reclaim, which answers 409: the shim stops the command.
            await asyncio.to_thread(queue_emulator.clock.advance, CLAIM_TIMEOUT / 2)
            async with asyncio.timeout(20):
                async for chunk in chunks:
                    body += chunk
        backing = queue.buildUrl("getArtifact", task_id, "0", BACKING)
        await poll(lambda: queue.latestArtifact(task_id, LOG)["url"] == backing)
        through_queue = queue.buildUrl("getLatestArtifact", task_id, LOG)
        kept = await http.get(through_queue, follow_redirects=True)
    assert b"canceled: SIGTERM" in body
    assert kept.content == body
    assert tasks.last_run(task_id)["reasonResolved"] == "canceled"


async def test_without_livelog_the_log_is_uploaded_at_the_end_as_before(
    shim: Shim, tasks: Tasks
) -> None:
    task_id = tasks.create(url="", payload={"command": ["echo", "hello"]})
    async with running(shim):
        await poll(resolved(tasks, task_id))
    assert artifacts(tasks, task_id) == {LOG: "s3"}
    assert "hello\n" in tasks.artifact(task_id, 0, LOG)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


async def test_a_port_in_use_is_a_one_line_error_and_exit_code_2(taken_port: int) -> None:
    env = {
        **os.environ,
        "TASKCLUSTER_ROOT_URL": "http://127.0.0.1:9",
        "COALESCER_LOG_FORMAT": "text",
    }
    argv = worker_argv(
        "--superseder-allow", "http://127.0.0.1:9/", "--livelog-port", str(taken_port)
    )
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stderr=subprocess.PIPE)
    async with asyncio.timeout(15):
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    lines = stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"coalescer: --livelog-port {taken_port}: ")
    assert "in use" in lines[0]
