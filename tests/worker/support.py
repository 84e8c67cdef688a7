"""Helpers for the worker tests: served apps, a scriptable superseder, task builders."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import httpx
import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from taskcluster.exceptions import TaskclusterFailure, TaskclusterRestFailure

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Options, Shim
from coalescer.worker.livelog import LiveLogServer
from coalescer.worker.runner import Worker

QUEUE = "emulator-test/worker"
ROUTE = "coalesce.v1.{key}"
WORKER_CREDENTIALS = {"clientId": "worker", "accessToken": "no-secret"}


class Served:
    """An ASGI app served by uvicorn on a free loopback port from a background thread."""

    def __init__(self, app: Any) -> None:
        self._socket = socket.socket()
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", ws="none", http="h11"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: self._server.run(sockets=[self._socket]), daemon=True
        )

    def __enter__(self) -> Served:
        self._thread.start()
        give_up = time.monotonic() + 10
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < give_up, "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()


Answer = Callable[[str, str], Awaitable[Response]]


class Superseder:
    """``GET /<key>?taskId=`` answers ``lists[key]`` (default: just the taskId), or whatever
    ``answer`` returns when set. ``asked`` records ``(key, taskId)``. ``GET
    /v1/bisections/gap?key=`` answers ``between[key]`` as the tasks between (default: none;
    None: 503, the service cannot say), known since ``known_since``; ``gaps`` records the
    queries."""

    def __init__(self) -> None:
        self.lists: dict[str, list[str]] = {}
        self.answer: Answer | None = None
        self.asked: list[tuple[str, str]] = []
        self.between: dict[str, list[dict[str, Any]] | None] = {}
        #: The gap's ``knownSince``: when the index began to know every task.
        self.known_since = "2000-01-01T00:00:00.000Z"
        self.gaps: list[dict[str, str]] = []
        self.url = ""

    async def gap(self, request: Request) -> Response:
        params = dict(request.query_params)
        self.gaps.append(params)
        tasks = self.between.get(params["key"], [])
        if tasks is None:
            return Response(b'{"error": "Redis is unreachable"}', status_code=503)
        body = {"key": params["key"], "tasks": tasks, "knownSince": self.known_since}
        return Response(orjson.dumps(body), media_type="application/json")

    async def endpoint(self, request: Request) -> Response:
        key = request.path_params["key"]
        task_id = request.query_params.get("taskId", "")
        self.asked.append((key, task_id))
        if self.answer is not None:
            return await self.answer(key, task_id)
        body = {"supersedes": self.lists.get(key, [task_id])}
        return Response(orjson.dumps(body), media_type="application/json")

    def url_for(self, key: str) -> str:
        return f"{self.url}/{key}"


def make_shim(emulator: QueueEmulator, options: Options, worker_id: str = "w1") -> Shim:
    return Shim(
        root_url=emulator.root_url,
        credentials=WORKER_CREDENTIALS,
        worker_group="wg",
        worker_id=worker_id,
        options=options,
        clock=emulator.clock.now,
        max_retries=0,
    )


@dataclasses.dataclass
class Tasks:
    """Creates tasks that coalesce under a key and name the test superseder."""

    emulator: QueueEmulator
    superseder: Superseder

    def create(
        self, key: str = "k", *, url: str | None = None, queue: str = QUEUE, **extra: Any
    ) -> str:
        payload: dict[str, Any] = {"command": ["true"], "maxRunTime": 30}
        payload["supersederUrl"] = self.superseder.url_for(key) if url is None else url
        if url == "":
            del payload["supersederUrl"]
        payload.update(extra.pop("payload", {}))
        routes = extra.pop("routes", [ROUTE.format(key=key)])
        return self.emulator.create_task(taskQueueId=queue, routes=routes, payload=payload, **extra)

    def status(self, task_id: str) -> dict[str, Any]:
        return dict(self.emulator.queue().status(task_id)["status"])

    def last_run(self, task_id: str) -> dict[str, Any]:
        return dict(self.status(task_id)["runs"][-1])

    def artifact(self, task_id: str, run_id: int, name: str) -> Any:
        url = f"{self.emulator.root_url}/emulator/v1/blobs/{task_id}/{run_id}/{name}"
        response = httpx.get(url)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return orjson.loads(response.content) if name.endswith(".json") else response.text


async def claim_work(shim: Shim, count: int = 1) -> list[dict[str, Any]]:
    """What ``claimWork`` hands this shim's worker (the oldest pending tasks first)."""
    answer = await shim.queue.claimWork(
        QUEUE, {"tasks": count, "workerGroup": shim.worker_group, "workerId": shim.worker_id}
    )
    return list(answer["tasks"])


class NoCancelScope:
    """A queue client as with credentials that lack ``queue:cancel-task:...``: its
    ``cancelTask`` answers 403 (the emulator does not check scopes); the rest is the client's."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    async def cancelTask(self, task_id: str) -> None:
        self.refused.append(task_id)
        raise TaskclusterRestFailure("InsufficientScopes", None, status_code=403)


class AioQueues(Protocol):
    """Where :class:`DockerWorkerRules` gets its queue clients: the emulator, or a real queue."""

    def aio_queue(self, credentials: dict[str, str] | None = None) -> Any: ...


@dataclasses.dataclass
class DockerWorkerRules:
    """docker-worker's superseding, unmodified (the only worker that ever shipped it): the URL
    by string concatenation, 5 s timeout, any error or a list without its own task → alone;
    claims every other listed task's run 0 in parallel, keeps the list order of the claims that
    succeeded, runs ``claims[0]``; then, before reporting it completed, resolves the others in
    parallel, each by ``reportException`` with ``superseded`` and, once that succeeded, uploading
    ``public/superseded-by.json``, and uploads the primary's ``public/supersedes.json`` listing
    them. Returns ``(primary, secondaries)`` taskIds. A queue that refuses ``superseded``
    (Taskcluster v40 and later) leaves the secondary claimed and without the artifact:
    ``refused`` maps it to the queue's HTTP status. (docker-worker only logs a failed upload;
    here it fails the test.)"""

    queues: AioQueues
    worker_group: str = "dw"
    worker_id: str = "docker-worker"
    task_queue_id: str = QUEUE
    credentials: dict[str, str] = dataclasses.field(default_factory=lambda: WORKER_CREDENTIALS)
    refused: dict[str, int] = dataclasses.field(default_factory=dict)

    async def claim_work(self) -> dict[str, Any]:
        """One task from ``claimWork`` on the task queue."""
        me = {"workerGroup": self.worker_group, "workerId": self.worker_id}
        answer = await self.queues.aio_queue(self.credentials).claimWork(
            self.task_queue_id, {"tasks": 1, **me}
        )
        [claim] = answer["tasks"]
        return dict(claim)

    async def run(self, claim: dict[str, Any]) -> tuple[str, list[str]]:
        claims = await self._superseding(claim)
        primary = claims[0]
        by = {"taskId": primary["status"]["taskId"], "runId": primary["runId"]}
        async with httpx.AsyncClient() as http:
            resolved = await asyncio.gather(*(self._supersede(http, c, by) for c in claims[1:]))
            superseded = [r for r in resolved if r is not None]
            queue = self.queues.aio_queue(primary["credentials"])
            if superseded:
                await self._upload(http, queue, primary, "public/supersedes.json", superseded)
        await queue.reportCompleted(primary["status"]["taskId"], str(primary["runId"]))
        return primary["status"]["taskId"], [c["status"]["taskId"] for c in claims[1:]]

    async def _supersede(
        self, http: httpx.AsyncClient, secondary: dict[str, Any], by: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Report first, then upload, as docker-worker's ``resolveSuperseded`` does."""
        queue = self.queues.aio_queue(secondary["credentials"])
        task_id, run_id = secondary["status"]["taskId"], secondary["runId"]
        try:
            await queue.reportException(task_id, str(run_id), {"reason": "superseded"})
        except TaskclusterRestFailure as exc:
            self.refused[task_id] = exc.status_code or 0
            return None
        await self._upload(http, queue, secondary, "public/superseded-by.json", by)
        return {"taskId": task_id, "runId": run_id}

    @staticmethod
    async def _upload(
        http: httpx.AsyncClient, queue: Any, claim: dict[str, Any], name: str, content: Any
    ) -> None:
        task_id, run_id = claim["status"]["taskId"], str(claim["runId"])
        request = {
            "storageType": "s3",
            "expires": claim["task"]["expires"],
            "contentType": "application/json",
        }
        created = await queue.createArtifact(task_id, run_id, name, request)
        (await http.put(created["putUrl"], json=content)).raise_for_status()

    async def _superseding(self, claim: dict[str, Any]) -> list[dict[str, Any]]:
        task_id = claim["status"]["taskId"]
        url = claim["task"]["payload"]["supersederUrl"] + "?taskId=" + task_id
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                listed = (await http.get(url)).raise_for_status().json()["supersedes"]
        except Exception:  # any error: run alone, as docker-worker did
            return [claim]
        if task_id not in listed:
            return [claim]
        queue = self.queues.aio_queue(self.credentials)
        body = {"workerGroup": self.worker_group, "workerId": self.worker_id}

        async def claim_one(other: str) -> dict[str, Any] | None:
            if other == task_id:
                return claim
            try:
                return dict(await queue.claimTask(other, "0", body))
            except TaskclusterFailure:
                return None

        claims = await asyncio.gather(*map(claim_one, listed))
        return [c for c in claims if c is not None]


async def poll(check: Callable[[], Any], within: float = 10.0, what: str = "condition") -> Any:
    """Wait until ``check()`` is truthy (in a thread: it may call the sync queue client)."""
    give_up = time.monotonic() + within
    while True:
        result = await asyncio.to_thread(check)
        if result:
            return result
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(
    *shims: Shim, capacity: int = 1, livelog: LiveLogServer | None = None
) -> AsyncIterator[list[Worker]]:
    """Reference workers claiming from the test queue until the block ends."""
    stop = asyncio.Event()
    workers = [Worker(shim, QUEUE, capacity, livelog) for shim in shims]
    loops = [asyncio.create_task(w.run(stop)) for w in workers]
    try:
        yield workers
    finally:
        stop.set()
        async with asyncio.timeout(15):
            await asyncio.gather(*loops)


def resolved(tasks: Tasks, *ids: str) -> Callable[[], bool]:
    return lambda: all(
        tasks.status(t)["state"] in ("completed", "failed", "exception") for t in ids
    )
