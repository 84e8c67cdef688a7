"""The shim against the real superseder service, fed by the emulator's Pulse messages."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
import uvicorn

from coalescer.emulator.harness import QueueEmulator
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.store.keys import INDEX_STATE
from coalescer.web.app import create_app
from coalescer.worker import Claim, Options, Outcome, Superseded
from coalescer.worker.protocol import COMPLETED
from coalescer.worker.shim import KEEP_IDLE_SECONDS
from tests.policy.support import eventually
from tests.worker.support import DockerWorkerRules, Tasks, claim_work, make_shim

pytestmark = pytest.mark.integration


@pytest.fixture
async def service(settings: Settings, store: Store) -> AsyncIterator[str]:
    """The coalescer web app on a free port, on this test's event loop (where ``store`` is)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        create_app(settings, store), log_level="warning", lifespan="on", ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
            await asyncio.sleep(0.01)
    # Its first look at the store marks when the index began to know every task: the tasks a
    # test then creates are all known to it.
    await eventually(lambda: store.client.exists(INDEX_STATE))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await serving
    sock.close()


async def feed(service: str, emulator: QueueEmulator, settings: Settings) -> None:
    """Post every message the emulator published to the service's ingest endpoint."""
    assert settings.ingest_token is not None
    headers = {"authorization": f"Bearer {settings.ingest_token.reveal()}"}
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{service}/v1/events", json=list(emulator.published), headers=headers
        )
    response.raise_for_status()


async def test_the_service_answers_and_the_newest_task_runs(
    service: str,
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
) -> None:
    url = f"{service}/build/linux"
    ids = [tasks.create("build.linux", url=url) for _ in range(3)]
    await feed(service, queue_emulator, settings)
    ran: list[str] = []

    async def execute(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        ran.append(claim.task_id)
        return COMPLETED

    async with make_shim(queue_emulator, Options(allow=(service,), tick=0.02)) as shim:
        [work] = await claim_work(shim)
        report = await shim.run(work, execute)

    assert ran == [ids[-1]]
    assert report.superseded == [(ids[0], 0), (ids[1], 0)]
    for task_id in ids[:-1]:
        assert tasks.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": ids[-1],
            "runId": 0,
        }
    # Once the resolutions reach it, the service offers none of these tasks again.
    await feed(service, queue_emulator, settings)
    async with httpx.AsyncClient() as client:
        answer = (await client.get(url, params={"taskId": ids[0]})).json()
    assert answer["supersedes"] == [ids[0]]


async def test_an_unmodified_docker_worker_runs_the_newest_task(
    service: str,
    settings: Settings,
    queue_emulator: QueueEmulator,
    tasks: Tasks,
) -> None:
    url = f"{service}/v1/docker-worker/build.linux"
    ids = [tasks.create("build.linux", url=url) for _ in range(5)]
    docker_worker = DockerWorkerRules(queue_emulator)
    claim = await docker_worker.claim_work()
    assert claim["status"]["taskId"] == ids[0]
    # The service has seen the claimed task start: it is running, no longer pending.
    queue_emulator.wait_for_message("task-running", ids[0])
    await feed(service, queue_emulator, settings)

    primary, secondaries = await docker_worker.run(claim)

    assert primary == ids[-1]
    assert secondaries == ids[-2::-1]
    assert tasks.status(ids[-1])["state"] == "completed"
    for task_id in ids[:-1]:
        assert tasks.last_run(task_id)["reasonResolved"] == "superseded"
        assert tasks.artifact(task_id, 0, "public/superseded-by.json") == {
            "taskId": ids[-1],
            "runId": 0,
        }


def test_the_shim_lets_an_idle_connection_go_before_the_service_would() -> None:
    # Equal keep-alives race: the shim could send its query as the service closes the
    # connection. uvicorn's own default is the service's default too (5 s).
    assert KEEP_IDLE_SECONDS < Settings.from_environ({}).idle_timeout
    assert KEEP_IDLE_SECONDS < uvicorn.Config(app=None).timeout_keep_alive
