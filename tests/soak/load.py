"""The soak's load: a steady stream of pushes on many keys (some with a dependent), ingest
bursts, and a prober that times the superseder query."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

import httpx
import taskcluster

#: the worker pools' task queues: the pushes' tasks on the first, their dependents on the second
BUILD_QUEUE, TEST_QUEUE = "soak/build", "soak/test"


@dataclasses.dataclass(frozen=True)
class Pushed:
    """A task the soak created: its key, its rank (the ``push`` tag: creation order) and what
    it depends on."""

    task_id: str
    key: str
    rank: int
    created: float
    dependencies: tuple[str, ...] = ()


class Pusher:
    def __init__(
        self,
        root_url: str,
        service: str,
        prefix: str,
        keys: list[str],
        rng: random.Random,
        *,
        dependent_share: float = 0.2,
    ) -> None:
        self.root_url = root_url
        self.service = service
        self.prefix = prefix
        self.keys = keys
        self.rng = rng
        self.dependent_share = dependent_share
        self.tasks: dict[str, Pushed] = {}
        self.failed = 0
        self._rank = 0

    def definition(self, key: str, queue: str, rank: int, deps: tuple[str, ...]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "taskQueueId": queue,
            "created": taskcluster.fromNowJSON("0 seconds"),
            "deadline": taskcluster.fromNowJSON("2 hours"),
            "routes": [f"{self.prefix}.{key}"],
            "tags": {"push": str(rank)},
            "payload": {
                "command": ["sleep", f"{self.rng.choice((0.2, 0.4, 0.8, 1.5)):g}"],
                "maxRunTime": 120,
                "supersederUrl": f"{self.service}/{key.replace('.', '/')}",
            },
            "metadata": {
                "name": f"soak {key}",
                "description": "chaos soak task",
                "owner": "soak@example.com",
                "source": "https://example.com/soak",
            },
        }
        if deps:
            body["dependencies"] = list(deps)
            body["requires"] = "all-completed"
        return body

    async def _create(
        self, http: httpx.AsyncClient, key: str, queue: str, deps: tuple[str, ...] = ()
    ) -> str | None:
        self._rank += 1
        rank, task_id = self._rank, str(taskcluster.slugid.nice())
        body = self.definition(key, queue, rank, deps)
        for _ in range(3):
            try:
                r = await http.put(f"{self.root_url}/api/queue/v1/task/{task_id}", json=body)
                r.raise_for_status()
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            self.tasks[task_id] = Pushed(task_id, key, rank, time.time(), deps)
            return task_id
        self.failed += 1
        return None

    async def push(self, http: httpx.AsyncClient) -> None:
        """One push: a task on a random key, and with some probability a dependent of it on the
        second task queue (``requires: all-completed``), on the key's ``dep.`` twin."""
        key = self.rng.choice(self.keys)
        task_id = await self._create(http, key, BUILD_QUEUE)
        if task_id and self.rng.random() < self.dependent_share:
            await self._create(http, f"dep.{key.replace('.', '-')}", TEST_QUEUE, (task_id,))

    async def stream(self, stop: asyncio.Event, rate: float) -> None:
        """About ``rate`` pushes a second until ``stop``."""
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                await self.push(http)
                try:
                    await asyncio.wait_for(stop.wait(), self.rng.expovariate(rate))
                except TimeoutError:
                    pass

    async def burst(self, n: int) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(*(self.push(http) for _ in range(n)))

    def recent(self, key: str) -> str | None:
        for pushed in reversed(list(self.tasks.values())[-200:]):
            if pushed.key == key:
                return pushed.task_id
        return None


@dataclasses.dataclass
class Probe:
    at: float
    seconds: float
    status: int  # 0: no answer


class Prober:
    """Asks the service's query endpoint for a recent task every ``interval`` seconds."""

    def __init__(self, service: str, pusher: Pusher, rng: random.Random) -> None:
        self.service = service
        self.pusher = pusher
        self.rng = rng
        self.probes: list[Probe] = []

    async def run(self, stop: asyncio.Event, interval: float = 0.05) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                key = self.rng.choice(self.pusher.keys)
                task_id = self.pusher.recent(key) or taskcluster.slugid.nice()
                started = time.perf_counter()
                status = 0
                try:
                    r = await http.get(
                        f"{self.service}/{key.replace('.', '/')}", params={"taskId": task_id}
                    )
                    status = r.status_code
                except httpx.HTTPError:
                    pass
                self.probes.append(Probe(time.time(), time.perf_counter() - started, status))
                await asyncio.sleep(interval)
