"""The Procfile, as a PaaS runs it: ``honcho start`` with ``REDIS_URL``, ``PULSE_URL`` and
``PORT`` set. The ``web`` process serves on ``PORT`` and the ``worker`` process feeds it from
Pulse: a message published to the queue's exchange shows up in the web process's answers. An
interrupt stops both cleanly."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
import taskcluster

from coalescer.emulator.harness import QueueEmulator
from tests.conftest import make_message
from tests.integration.test_pulse import Broker, broker, prefix  # noqa: F401  (fixtures)
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PROCFILE = ROOT / "Procfile"
BIN = Path(sys.executable).parent


def _create(path: Path) -> BinaryIO:
    return path.open("wb")


async def eventually(check: Callable[[], Awaitable[Any]], *, within: float, what: str) -> Any:
    give_up = time.monotonic() + within
    while True:
        try:
            if found := await check():
                return found
        except httpx.HTTPError:
            pass
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_the_procfile_serves_and_consumes_and_stops_cleanly(
    redis_client: Any,
    redis_url: str,
    amqp_url: str,
    broker: Broker,
    prefix: str,
    queue_emulator: QueueEmulator,
    tmp_path: Path,
) -> None:
    port = free_port()
    names = [line.split(":", 1)[0] for line in PROCFILE.read_text().splitlines() if ":" in line]
    assert {"web", "worker"} <= set(names)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        REDIS_URL=redis_url,
        PULSE_URL=amqp_url,
        PULSE_QUEUE=broker.queue,
        PORT=str(port),
        TASKCLUSTER_ROOT_URL=queue_emulator.root_url,
        TASKCLUSTER_CLIENT_ID="procfile-test",
        TASKCLUSTER_ACCESS_TOKEN="anything",
        COALESCER_ROUTE_PREFIX=prefix,
        PYTHONUNBUFFERED="1",
    )
    log = tmp_path / "honcho.log"
    with _create(log) as out:
        honcho = await asyncio.create_subprocess_exec(
            str(BIN / "honcho"),
            "start",
            "-f",
            str(PROCFILE),
            "-d",
            str(ROOT),
            "--no-colour",
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,  # our own process group, so that nothing outlives the test
        )
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as client:

            async def healthy() -> bool:
                assert honcho.returncode is None, log.read_text()
                r = await client.get("/__heartbeat__")
                return r.status_code == 200 and r.json()["store"] == "redis"

            await eventually(healthy, within=40, what="the web process")

            task_id = taskcluster.slugid.nice()
            message = make_message(task_id, routes=(f"{prefix}.procfile",))

            async def indexed() -> bool:
                assert honcho.returncode is None, log.read_text()
                # Published until consumed: the worker's queue exists once it is bound.
                await broker.publish(message)
                r = await client.get("/procfile")
                return r.status_code == 200 and any(
                    t["taskId"] == task_id for t in r.json()["pending"]
                )

            await eventually(indexed, within=40, what="the worker to index a Pulse message")
            r = await client.get(f"/procfile?taskId={task_id}")
            assert r.json() == {"supersedes": [task_id]}
        running = log.read_text()
        for name in names:  # every process started, and none gave up
            assert f"{name}.1 started" in running and f"{name}.1 stopped" not in running, running
    finally:
        if honcho.returncode is None:
            honcho.send_signal(signal.SIGINT)  # as Ctrl-C: honcho passes SIGTERM on
        try:
            await asyncio.wait_for(honcho.wait(), 30)
        except TimeoutError:
            os.killpg(honcho.pid, signal.SIGKILL)
            await honcho.wait()
            raise AssertionError("honcho did not stop within 30 s:\n" + log.read_text()) from None
    output = log.read_text()
    assert "consuming " + broker.queue in output
    assert "stopped consuming" in output, output  # the worker drained and closed
    with socket.socket() as s:  # the web process let go of its port
        assert s.connect_ex(("127.0.0.1", port)) != 0
