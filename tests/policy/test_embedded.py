"""``coalescer serve`` on the embedded store carries out superseding decisions itself: the
enforcer runs in the web process, started and drained by the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY

from coalescer.emulator import endpoints
from coalescer.emulator.app import Call
from coalescer.emulator.harness import QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.ingest.events import EXCHANGE_STATES
from coalescer.policy.embedded import TASK_NAME, start_enforcer
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.store import lineage as records
from coalescer.web.app import create_app
from tests.policy.support import TOKEN, Loop, eventually, rule
from tests.ports import free_port

pytestmark = pytest.mark.integration

POLICY = "rules: [{keys: k, strategy: latest-wins}]\n"
CREDENTIALS = {"TASKCLUSTER_CLIENT_ID": "enforcer", "TASKCLUSTER_ACCESS_TOKEN": "no-secret"}


class Gate:
    """Holds the emulator's ``reportException`` for one task: for ``hold`` seconds, or until
    released."""

    def __init__(self) -> None:
        self.task_id = ""
        self.hold = 3600.0
        self.reached = threading.Event()
        self.released = threading.Event()
        self._real = endpoints.HANDLERS["reportException"]

    async def handler(self, call: Call) -> Any:
        if call.task_id == self.task_id and not self.reached.is_set():
            self.reached.set()
            give_up = time.monotonic() + self.hold
            while not self.released.is_set() and time.monotonic() < give_up:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        return await self._real(call)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setitem(endpoints.HANDLERS, "reportException", g.handler)
    yield g
    g.released.set()


@pytest.fixture
def queue_emulator_options(gate: Gate, queue_emulator_options: EmulatorOptions) -> EmulatorOptions:
    return queue_emulator_options  # the gate is in place before the emulator's app is built


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY)
    return path


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TASKCLUSTER_ROOT_URL", *CREDENTIALS):
        monkeypatch.delenv(name, raising=False)


def settings(policy_file: Path, root_url: str | None) -> Settings:
    env = {"COALESCER_POLICY_FILE": str(policy_file), "COALESCER_INGEST_TOKEN": TOKEN}
    if root_url is not None:
        env["TASKCLUSTER_ROOT_URL"] = root_url
    return Settings.from_environ(env)


class Service:
    """A service fed over HTTP with what the emulator publishes: the app's real lifespan on the
    embedded store (``store`` is its store), or a ``coalescer serve`` process."""

    def __init__(self, em: QueueEmulator, http: httpx.AsyncClient, store: Any = None) -> None:
        self.em = em
        self.http = http
        self.store: Store = store
        # Loop's task helpers (create, last_run, artifact) do not touch its store.
        self.loop = Loop(em, store, rule("k", strategy="latest-wins"))
        self.posted = 0

    async def post_events(self) -> None:
        """``POST /v1/events`` with the task events the emulator published since the last."""
        published = list(self.em.published)[self.posted :]
        self.posted += len(published)
        docs = [d for d in published if d["exchange"].rsplit("/", 1)[-1] in EXCHANGE_STATES]
        response = await self.http.post(
            "/v1/events", json=docs, headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert response.status_code == 200, response.text

    async def state(self, task_id: str) -> str | None:
        """The enforcement state of ``task_id``'s decision, as the service shows it."""
        got = (await self.http.get(f"/v1/tasks/{task_id}")).json()
        by = got.get("supersededBy") or {}
        return by.get("state")


@contextlib.asynccontextmanager
async def serving(em: QueueEmulator, settings: Settings) -> AsyncIterator[Service]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coalescer") as http:
            yield Service(em, http, app.state.store)


def enforcer_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == TASK_NAME]


@pytest.mark.usefixtures("credentials")
async def test_serve_on_the_embedded_store_carries_out_latest_wins(
    queue_emulator: QueueEmulator, policy_file: Path
) -> None:
    labels = {"rule": "rule-1", "result": "superseded"}
    before = REGISTRY.get_sample_value("coalescer_enforcer_actions_total", labels) or 0.0
    async with serving(queue_emulator, settings(policy_file, queue_emulator.root_url)) as svc:
        assert svc.store.embedded and len(enforcer_tasks()) == 1
        older = [svc.loop.create() for _ in range(2)]
        newest = svc.loop.create()
        await svc.post_events()

        for task_id in older:
            await eventually(lambda t=task_id: _is(svc.state(t), "superseded"))
        assert await svc.store.client.xlen("co:{k}:o") == 0  # every entry acknowledged
        # The enforcer's own counters are on the service's /metrics.
        metrics = (await svc.http.get("/metrics")).text
        line = 'coalescer_enforcer_actions_total{result="superseded",rule="rule-1"}'
        assert f"{line} {before + 2}" in metrics
    assert enforcer_tasks() == []  # stopped with the app

    for task_id in older:
        run = svc.loop.last_run(task_id)
        assert (run["state"], run["reasonResolved"]) == ("exception", "superseded")
        assert (run["workerGroup"], run["workerId"]) == ("coalescer", "enforcer")
        assert svc.loop.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": newest,
            "runId": 0,
        }
    assert svc.loop.last_run(newest)["state"] == "pending"


@pytest.mark.usefixtures("no_credentials")
async def test_without_queue_credentials_decisions_are_recorded_not_carried_out(
    queue_emulator: QueueEmulator, policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "coalescer.policy")
    async with serving(queue_emulator, settings(policy_file, None)) as svc:
        assert enforcer_tasks() == []
        older, newest = svc.loop.create(), svc.loop.create()
        await svc.post_events()
        assert await svc.state(older) == "decided"
        assert await svc.store.client.xlen("co:{k}:o") == 1  # waiting for an enforcer
        pending = [t.task_id for t in await svc.store.pending("k", now_ms=svc.loop.now_ms())]
        assert pending == [newest]  # decided at once: no longer offered to workers
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "coalescer.policy" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    assert "recorded but NOT carried out" in warnings[0]
    for name in ("TASKCLUSTER_ROOT_URL", "TASKCLUSTER_CLIENT_ID", "TASKCLUSTER_ACCESS_TOKEN"):
        assert name in warnings[0]
    assert svc.loop.last_run(older)["state"] == "pending"


async def test_shutdown_lets_the_action_in_progress_finish(
    queue_emulator: QueueEmulator, policy_file: Path, gate: Gate, credentials: None
) -> None:
    gate.hold = 0.5
    async with serving(queue_emulator, settings(policy_file, queue_emulator.root_url)) as svc:
        older, newest = svc.loop.create(), svc.loop.create()
        gate.task_id = older
        await svc.post_events()
        assert await asyncio.to_thread(gate.reached.wait, 10)  # claimed, resolving: stop now
    # The lifespan waited for the action and recorded it: nothing was left half done.
    try:
        current = await records.decision(svc.store, "k", older)
        assert current is not None and current.state == "superseded"
        assert await svc.store.client.xlen("co:{k}:o") == 0
    finally:
        await svc.store.close()  # the reads above opened a connection after the lifespan's end
    assert svc.loop.last_run(older)["reasonResolved"] == "superseded"
    assert svc.loop.last_run(newest)["state"] == "pending"
    assert enforcer_tasks() == []


@pytest.mark.usefixtures("credentials")
async def test_a_stop_that_takes_too_long_interrupts_the_round_and_the_next_enforcer_finishes(
    queue_emulator: QueueEmulator,
    policy_file: Path,
    gate: Gate,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = await open_store(None, grace_seconds=3600)
    service = settings(policy_file, queue_emulator.root_url)
    try:
        loop = Loop(queue_emulator, store, rule("k", strategy="latest-wins"))
        older, newest = loop.create(), loop.create()
        gate.task_id = older  # held until released
        await loop.feed()
        enforcer = start_enforcer(service, store, drain_timeout=0.2)
        assert enforcer is not None
        assert await asyncio.to_thread(gate.reached.wait, 10)
        started = time.monotonic()
        await enforcer.stop()
        assert time.monotonic() - started < 5
        assert not enforcer.running and enforcer_tasks() == []
        assert "interrupted" in caplog.text
        # Left as it was: the entry is delivered, unacknowledged, in the outbox's group.
        current = await records.decision(store, "k", older)
        assert current is not None and current.state == "decided"
        assert (await store.client.xpending("co:{k}:o", "enforce"))["pending"] == 1

        gate.released.set()
        again = start_enforcer(service, store)
        assert again is not None
        try:  # takes the pending entry over (XAUTOCLAIM) and finishes it, once
            await eventually(lambda: _is(_state(store, older), "superseded"))
        finally:
            await again.stop()
        assert await store.client.xlen("co:{k}:o") == 0
        assert (await store.client.xpending("co:{k}:o", "enforce"))["pending"] == 0
        assert len(queue_emulator.messages("task-exception", older)) == 1
        assert loop.artifact(older, 0, "public/superseded-by.json")["taskId"] == newest
    finally:
        gate.released.set()  # before the emulator stops: it waits for requests in flight
        await store.close()


async def _state(store: Store, task_id: str) -> str | None:
    current = await records.decision(store, "k", task_id)
    return None if current is None else current.state


@pytest.mark.usefixtures("credentials")
async def test_no_enforcer_without_a_rule_that_decides(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("rules: [{keys: k, strategy: on-claim}]\n")
    store = await open_store(None, grace_seconds=3600)
    try:
        got = start_enforcer(settings(path, "http://queue.invalid"), store)
        assert got is None
        assert start_enforcer(Settings(), store) is None
    finally:
        await store.close()
    assert "NOT carried out" not in caplog.text


@pytest.mark.usefixtures("credentials")
async def test_with_redis_the_web_process_leaves_enforcing_to_coalescer_enforce(
    queue_emulator: QueueEmulator, policy_file: Path, store: Store
) -> None:
    app = create_app(settings(policy_file, queue_emulator.root_url), store)
    async with app.router.lifespan_context(app):
        assert not store.embedded and enforcer_tasks() == []


async def test_the_serve_command_enforces_and_stops_on_sigterm(
    queue_emulator: QueueEmulator, policy_file: Path, tmp_path: Path
) -> None:
    """The whole thing in one real ``coalescer serve`` process."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "PULSE_URL")}
    env |= CREDENTIALS | {
        "TASKCLUSTER_ROOT_URL": queue_emulator.root_url,
        "COALESCER_POLICY_FILE": str(policy_file),
        "COALESCER_INGEST_TOKEN": TOKEN,
        "COALESCER_LOG_FORMAT": "text",
    }
    log = tmp_path / "serve.log"
    proc = spawn(["serve", "--port", str(port)], env, log)
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base) as http:
            await eventually(lambda: _up(http), within=30)
            svc = Service(queue_emulator, http)
            older, newest = svc.loop.create(), svc.loop.create()
            await svc.post_events()
            await eventually(lambda: _is(svc.state(older), "superseded"), within=15)
        assert svc.loop.last_run(older)["reasonResolved"] == "superseded"
        assert svc.loop.artifact(older, 0, "public/superseded-by.json")["taskId"] == newest
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the SIGTERM it handled once shut down.
        assert await asyncio.to_thread(proc.wait, 30) in (0, -signal.SIGTERM), log.read_text()
    finally:
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
    output = log.read_text()
    assert "enforcing superseding decisions in this process" in output
    assert "enforcer stopped" in output


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coalescer.cli", *args], env=env, stdout=out, stderr=out
        )


async def _up(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/__lbheartbeat__")).status_code == 200
    except httpx.TransportError:
        return False


async def _is(got: Any, expected: str) -> bool:
    return await got == expected
