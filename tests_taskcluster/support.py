"""Helpers for the real-systems tests: the run's unique names, tasks on the real queue, and the
product's processes (``coalescer listen|serve|worker|enforce|reconcile``) wired to them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import taskcluster
from taskcluster.exceptions import TaskclusterRestFailure

from tests.integration.test_e2e import Processes
from tests_taskcluster.environment import Deployment

RESOLVED = ("completed", "failed", "exception")
#: Every wait is bounded: Pulse delivers in well under a second, the queue's resolvers poll
#: every 5 s.
WITHIN = 60.0


@dataclasses.dataclass(frozen=True)
class Run:
    """Names of one test's own, so that runs (and other users of the deployment) never meet."""

    uid: str
    pulse_user: str

    @classmethod
    def new(cls, pulse_user: str) -> Run:
        return cls(uuid.uuid4().hex[:10], pulse_user)

    @property
    def task_queue_id(self) -> str:
        return f"coalescer-rt/run-{self.uid}"

    @property
    def prefix(self) -> str:
        """The coalescing route prefix: the Pulse queue binds ``route.<prefix>.#`` only."""
        return f"coalesce.rt{self.uid}"

    @property
    def pulse_queue(self) -> str:
        return f"queue/{self.pulse_user}/coalescer-rt-{self.uid}"

    def route(self, key: str) -> str:
        return f"{self.prefix}.{key}"


class RealQueue:
    """The deployment's queue through the official client, remembering the tasks it created
    so that :meth:`clean_up` cancels whatever a test leaves unresolved."""

    def __init__(self, deployment: Deployment, run: Run) -> None:
        self.deployment = deployment
        self.run = run
        options = {"rootUrl": deployment.root_url, "credentials": deployment.credentials}
        self.client = taskcluster.Queue(options | {"maxRetries": 2})
        self.group = taskcluster.slugid.nice()
        self.created: list[str] = []

    def options(self, credentials: dict[str, str] | None = None) -> dict[str, Any]:
        creds = credentials or self.deployment.credentials
        return {"rootUrl": self.deployment.root_url, "credentials": creds, "maxRetries": 2}

    def aio_queue(self, credentials: dict[str, str] | None = None) -> Any:
        """A ``taskcluster.aio.Queue`` (for :class:`tests.worker.support.DockerWorkerRules`)."""
        import taskcluster.aio

        return taskcluster.aio.Queue(self.options(credentials))

    def create(
        self,
        key: str,
        *,
        superseder: str | None = None,
        command: str = "true",
        max_run_time: int = 60,
        **task: Any,
    ) -> str:
        """A task of the run's task queue under ``key``; with ``superseder``, its
        ``supersederUrl``. Returns its taskId."""
        task_id: str = taskcluster.slugid.nice()
        payload: dict[str, Any] = {"command": ["sh", "-c", command], "maxRunTime": max_run_time}
        if superseder is not None:
            payload["supersederUrl"] = superseder
        definition = {
            "taskQueueId": self.run.task_queue_id,
            "schedulerId": "-",
            "taskGroupId": self.group,
            "created": taskcluster.stringDate(taskcluster.fromNow("0 seconds")),
            "deadline": taskcluster.stringDate(taskcluster.fromNow("30 minutes")),
            "expires": taskcluster.stringDate(taskcluster.fromNow("1 day")),
            "routes": [self.run.route(key)],
            "payload": payload,
            "metadata": {
                "name": f"coalescer real-systems test {key}",
                "description": "created by coalescer's tests_taskcluster; safe to cancel",
                "owner": "coalescer@example.com",
                "source": "https://github.com/coalescer/tests_taskcluster",
            },
        } | task
        self.client.createTask(task_id, definition)
        self.created.append(task_id)
        return task_id

    def status(self, task_id: str) -> dict[str, Any]:
        return dict(self.client.status(task_id)["status"])

    def state(self, task_id: str) -> str:
        return str(self.status(task_id)["state"])

    def last_run(self, task_id: str) -> dict[str, Any]:
        return dict(self.status(task_id)["runs"][-1])

    def claim(self, task_id: str, run_id: int = 0) -> Any:
        """Claim ``task_id``'s run as a test worker; returns a client with the claim's
        credentials."""
        claimed = self.client.claimTask(
            task_id, run_id, {"workerGroup": "coalescer-rt", "workerId": "tester"}
        )
        return taskcluster.Queue(self.options(claimed["credentials"]))

    def artifact(self, task_id: str, run_id: int, name: str) -> Any:
        """An artifact's content as the queue serves it (following its redirect to the object
        store), signed with the run's credentials; ``None`` when there is no such artifact."""
        url = self.client.buildSignedUrl("getArtifact", task_id, run_id, name)
        response = httpx.get(url, follow_redirects=True, timeout=30)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return orjson.loads(response.content) if name.endswith(".json") else response.text

    def clean_up(self) -> list[str]:
        """Cancel every created task that is not resolved yet; returns their ids."""
        canceled = []
        for task_id in self.created:
            try:
                if self.state(task_id) not in RESOLVED:
                    self.client.cancelTask(task_id)
                    canceled.append(task_id)
            except TaskclusterRestFailure as exc:
                if exc.status_code != 409:  # resolved meanwhile
                    raise
        return canceled


class Loop:
    """The product's processes against the deployment, each logging to a file."""

    def __init__(
        self, deployment: Deployment, run: Run, redis_url: str, logs: Path, **env: str
    ) -> None:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_", "REDIS_"))
        }
        base.update(
            REDIS_URL=redis_url,
            PULSE_URL=deployment.pulse_url,
            PULSE_QUEUE=run.pulse_queue,
            COALESCER_ROUTE_PREFIX=run.prefix,
            COALESCER_LOG_FORMAT="text",
            TASKCLUSTER_ROOT_URL=deployment.root_url,
            TASKCLUSTER_CLIENT_ID=deployment.client_id,
            TASKCLUSTER_ACCESS_TOKEN=deployment.access_token,
            **env,
        )
        self.env = base
        self.logs = logs
        self.procs = Processes(base, logs)
        self.service = ""
        self.listened = False

    async def start_service(self, *, listen: bool = True) -> str:
        """``coalescer listen`` (bound before any task is created) and ``coalescer serve``;
        returns the service's URL once both are ready."""
        from tests.ports import free_port

        port = free_port()
        if listen:
            self.procs.start("listen", "listen")
            self.listened = True
        self.procs.start("serve", "serve", "--port", str(port))
        self.service = f"http://127.0.0.1:{port}"
        await self.eventually(self._serving, "coalescer serve to answer")
        if listen:
            await self.eventually(
                lambda: _now("consuming queue/" in self.procs.output("listen")),
                "coalescer listen to consume",
            )
        return self.service

    async def _serving(self) -> bool:
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(f"{self.service}/__lbheartbeat__")).status_code == 200
        except httpx.TransportError:
            return False

    async def pending(self, key: str) -> list[str]:
        """The service's pending tasks of ``key``, oldest first (its JSON for API clients)."""
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(
                f"{self.service}/{key.replace('.', '/')}", headers={"accept": "application/json"}
            )
        response.raise_for_status()
        return [t["taskId"] for t in response.json()["pending"]]

    async def supersedes(self, key: str, task_id: str) -> list[str]:
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(
                f"{self.service}/{key.replace('.', '/')}", params={"taskId": task_id}
            )
        response.raise_for_status()
        return list(response.json()["supersedes"])

    async def eventually(
        self, check: Callable[[], Awaitable[bool]], what: str, within: float = WITHIN
    ) -> None:
        give_up = time.monotonic() + within
        while not await check():
            self.procs.check_alive()
            if time.monotonic() > give_up:
                raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
            await asyncio.sleep(0.2)

    def stop_process(self, name: str) -> None:
        """Stop one process (SIGTERM) and forget it; it must end cleanly."""
        proc = self.procs.procs.pop(name)
        proc.terminate()
        code = proc.wait(30)
        assert code == 0, f"{name} exited {code}:\n{self.procs.output(name)[-3000:]}"

    def command(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``coalescer <args>`` to its end."""
        return subprocess.run(
            [sys.executable, "-m", "coalescer.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self) -> Iterator[str]:
        """Stop every process; yields a line for each that ended badly, with its log's tail."""
        for name, code in self.procs.stop().items():
            # uvicorn re-raises the SIGTERM it handled once shut down.
            if code != 0 and not (name == "serve" and code == -15):
                yield f"{name} exited {code}:\n{self.procs.output(name)[-3000:]}"


async def _now(value: bool) -> bool:
    return value


async def in_thread(check: Callable[[], bool]) -> bool:
    return await asyncio.to_thread(check)
