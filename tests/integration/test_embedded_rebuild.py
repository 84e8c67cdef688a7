"""``coalescer serve`` on the embedded store rebuilds its index from the queue at start.

Real processes: the service, and the queue emulator it lists (no Pulse, no event POSTed: what
the service knows, it learned from the listings). The failure paths run the same background
task in process, against a port nothing listens on and a server without the listings.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.health import Health, Supervisor
from coalescer.ingest.startup import NAME, start_rebuild
from coalescer.settings import Settings
from coalescer.store import open_store
from tests.ports import free_port
from tests.serving import serving

pytestmark = pytest.mark.integration

HTML = {"Accept": "text/html,application/xhtml+xml"}
WORKER = {"workerGroup": "wg", "workerId": "wi"}
BANNER = "Superseding is incomplete"


def environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "TASKCLUSTER_", "PULSE_", "REDIS_"))
    }
    return {**env, "COALESCER_LOG_FORMAT": "text", **extra}


async def eventually(check: Callable[[], Awaitable[bool]], what: str, within: float = 30) -> None:
    give_up = time.monotonic() + within
    while not await check():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_serve_on_the_embedded_store_indexes_the_queues_pending_tasks_at_start(
    queue_emulator: QueueEmulator, tmp_path: Path
) -> None:
    em = queue_emulator
    created = []
    for n in range(4):  # across two task queues, in creation order
        queue_id = "emulator-test/worker" if n % 2 else "emulator-test/other"
        created.append(em.create_task(routes=["coalesce.v1.boot.k"], taskQueueId=queue_id))
        em.clock.advance(1)
    em.queue().claimTask(created[1], 0, WORKER)  # running: not pending
    em.create_task(routes=["index.not-coalescing"])
    pending = [created[0], created[2], created[3]]

    log = tmp_path / "serve.log"
    env = environment(TASKCLUSTER_ROOT_URL=em.root_url)
    with serving(env, log) as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:

            async def rebuilt() -> bool:
                body = (await http.get("/__heartbeat__")).json()
                return bool(body["checks"]["index"] == "ok")

            await eventually(rebuilt, "checks.index to turn ok")
            heartbeat = (await http.get("/__heartbeat__")).json()
            assert "index" not in heartbeat["details"]
            assert heartbeat["details"]["background"][NAME]["status"] == "ok"
            listed = (await http.get("/boot/k")).json()
            assert [t["taskId"] for t in listed["pending"]] == pending
            answer = (await http.get("/boot/k", params={"taskId": created[3]})).json()
            assert answer == {"supersedes": pending}
            for page in ("/", "/boot/k"):
                got = await http.get(page, headers=HTML)
                assert got.status_code == 200 and BANNER not in got.text, page
    text = log.read_text()
    assert f"rebuilding the embedded store's index from the queue at {em.root_url}" in text
    # The running task is indexed too (as running), so that a late pending event is ignored.
    assert "rebuilt 4 tasks under 1 keys (5 listed)" in text and "4 indexed" in text, text


async def test_without_a_queue_the_message_names_both_ways_to_a_complete_index(
    tmp_path: Path,
) -> None:
    with serving(environment(), tmp_path / "serve.log") as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=10) as http:

            async def known() -> bool:
                body = (await http.get("/__heartbeat__")).json()
                return bool(body["checks"]["index"] != "unknown")

            await eventually(known, "the index marker to be read")
            heartbeat = (await http.get("/__heartbeat__")).json()
            assert heartbeat["checks"]["index"] == "warning"
            assert NAME not in heartbeat["details"]["background"]
            message = heartbeat["details"]["index"]
            assert "embedded store started empty" in message
            assert "set TASKCLUSTER_ROOT_URL" in message
            assert "REDIS_URL" in message and "coalescer reconcile --rebuild" in message
            page = (await http.get("/", headers=HTML)).text
            assert BANNER in page and "set TASKCLUSTER_ROOT_URL" in page


@contextlib.contextmanager
def no_listings() -> Iterator[str]:
    """A server answering 404 to everything, as a queue without the task queue listings; its
    root URL."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"code": "ResourceNotFound", "message": "no such endpoint"}'
            self.send_response(404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def rebuild_in_process(root_url: str, until: Callable[[Health], bool]) -> Health:
    store = await open_store(None, grace_seconds=3600)
    supervisor = Supervisor(Health(embedded=True))
    try:
        settings = Settings.from_environ({"TASKCLUSTER_ROOT_URL": root_url})
        assert start_rebuild(settings, store, supervisor)

        async def done() -> bool:
            return until(supervisor.health)

        await eventually(done, "the rebuild to fail", within=60)
        supervisor.health.index = await store.index_state(int(time.time() * 1000))
        return supervisor.health
    finally:
        await supervisor.stop()
        await store.close()


async def test_an_unreachable_queue_keeps_the_warning_and_is_tried_again() -> None:
    health = await rebuild_in_process(
        f"http://127.0.0.1:{free_port()}", lambda h: h.loop(NAME).restarts >= 1
    )
    loop = health.loop(NAME)
    assert loop.stopped is None and "listTaskQueues failed" in (loop.last_error or "")
    assert health.index is not None and health.index.state != "ok"
    assert "which it is doing now" in health.index_message()


async def test_a_queue_without_the_listings_stops_the_rebuild_with_the_reason() -> None:
    with no_listings() as root_url:
        health = await rebuild_in_process(root_url, lambda h: h.loop(NAME).stopped is not None)
    loop = health.loop(NAME)
    assert "no listTaskQueues endpoint" in (loop.stopped or ""), loop.stopped
    assert health.report()["checks"]["background"] == "error"
    assert health.index is not None and health.index.state != "ok"


def test_reconcile_without_redis_says_that_serve_rebuilds_the_embedded_store_itself() -> None:
    env = environment(TASKCLUSTER_ROOT_URL="http://127.0.0.1:9")
    run = subprocess.run(
        [sys.executable, "-m", "coalescer.cli", "reconcile", "--rebuild"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "REDIS_URL is not set" in run.stderr
    assert "`coalescer serve` rebuilds the index from the queue at start" in run.stderr
