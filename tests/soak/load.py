"""The soak's load: a steady stream of pushes on many keys (some with a dependent), ingest
bursts, injected regressions and flaky keys, and a prober that times the superseder query.

Every task's command leaves a mark, ``<marks>/ran/<taskId>.<runId>``, as it starts: the soak's
own record of which runs ran their command, whatever the queue says of them. A task's *fate*
decides how its command ends: ``pass``; ``broken`` (exit 1: a regression on its key, from the
push where it began on); ``flaky`` (exit 1 the first time the task's command runs, 0 on any
later run: an intermittent failure that never comes back)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import httpx
import taskcluster

#: the worker pools' task queues: the pushes' tasks on the first, their dependents on the second
BUILD_QUEUE, TEST_QUEUE = "soak/build", "soak/test"
#: a task queue no worker serves: the soak claims its tasks itself, at chosen moments
MANUAL_QUEUE = "soak/manual"
#: Every pushed task's priority.
PRIORITY = "low"


@dataclasses.dataclass(frozen=True)
class Pushed:
    """A task the soak created: its key, its rank (the ``push`` tag: creation order) and what
    it depends on."""

    task_id: str
    key: str
    rank: int
    created: float
    dependencies: tuple[str, ...] = ()
    fate: str = "pass"  # pass | broken | flaky


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What the stream does beyond passing tasks. ``regressions``: keys broken from one push on
    (:meth:`Pusher.regression`); ``flaky``: keys whose tasks fail their first run with
    probability ``flaky_share``; ``slow``: key prefixes whose tasks run for seconds, so that
    newer pushes arrive while they run; ``paired``: keys pushed twice in every burst."""

    marks: Path
    regressions: tuple[str, ...] = ()
    flaky: tuple[str, ...] = ()
    flaky_share: float = 0.3
    slow: tuple[str, ...] = ()
    #: keys pushed twice at once in every burst: an older task claimed by a worker while the
    #: newer one's events overtake its own, as they do under load
    paired: tuple[str, ...] = ()

    def command(self, fate: str, seconds: float) -> list[str]:
        ran = f': > "{self.marks}/ran/$TASK_ID.$RUN_ID"; sleep {seconds:g}'
        if fate == "broken":
            return ["sh", "-c", f"{ran}; exit 1"]
        if fate == "flaky":
            once = f"{self.marks}/flaky/$TASK_ID"
            return ["sh", "-c", f'{ran}; test -e "{once}" && exit 0; : > "{once}"; exit 1']
        return ["sh", "-c", ran]

    def ran(self) -> set[tuple[str, int]]:
        """The runs whose command started: ``(taskId, runId)``."""
        found = set()
        for mark in (self.marks / "ran").iterdir():
            task_id, _, run_id = mark.name.rpartition(".")
            found.add((task_id, int(run_id)))
        return found


class Pusher:
    def __init__(
        self,
        root_url: str,
        service: str,
        prefix: str,
        keys: list[str],
        rng: random.Random,
        scenario: Scenario,
        *,
        dependent_share: float = 0.2,
    ) -> None:
        self.root_url = root_url
        self.service = service
        self.prefix = prefix
        self.keys = keys
        self.rng = rng
        self.dependent_share = dependent_share
        self.scenario = scenario
        self.broken: set[str] = set()  # keys whose regression has begun
        self.tasks: dict[str, Pushed] = {}
        self.failed = 0
        self._rank = 0

    def fate(self, key: str) -> str:
        if key in self.broken:
            return "broken"
        if key in self.scenario.flaky and self.rng.random() < self.scenario.flaky_share:
            return "flaky"
        return "pass"

    def definition(
        self, key: str, queue: str, rank: int, deps: tuple[str, ...], fate: str = "pass"
    ) -> dict[str, Any]:
        slow = key.startswith(self.scenario.slow) if self.scenario.slow else False
        seconds = self.rng.choice((3.0, 6.0, 10.0) if slow else (0.2, 0.4, 0.8, 1.5))
        body: dict[str, Any] = {
            "taskQueueId": queue,
            "created": taskcluster.fromNowJSON("0 seconds"),
            "deadline": taskcluster.fromNowJSON("2 hours"),
            "routes": [f"{self.prefix}.{key}"],
            # An integration branch's priority, above the queue's default: victims held with
            # hold-by: priority wait at the lowest, behind every other task.
            "priority": PRIORITY,
            "tags": {"push": str(rank)},
            "payload": {
                "command": self.scenario.command(fate, seconds),
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

    async def create(
        self, http: httpx.AsyncClient, key: str, queue: str, deps: tuple[str, ...] = ()
    ) -> str | None:
        self._rank += 1
        rank, task_id = self._rank, str(taskcluster.slugid.nice())
        fate = self.fate(key)
        body = self.definition(key, queue, rank, deps, fate)
        for _ in range(3):
            try:
                r = await http.put(f"{self.root_url}/api/queue/v1/task/{task_id}", json=body)
                r.raise_for_status()
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
                continue
            self.tasks[task_id] = Pushed(task_id, key, rank, time.time(), deps, fate)
            return task_id
        self.failed += 1
        return None

    async def push(self, http: httpx.AsyncClient) -> None:
        """One push: a task on a random key, and with some probability a dependent of it on the
        second task queue (``requires: all-completed``), on the key's ``dep.`` twin."""
        key = self.rng.choice(self.keys)
        task_id = await self.create(http, key, BUILD_QUEUE)
        if task_id and self.rng.random() < self.dependent_share:
            await self.create(http, f"dep.{key.replace('.', '-')}", TEST_QUEUE, (task_id,))

    async def stream(self, stop: asyncio.Event, rate: float) -> None:
        """About ``rate`` pushes a second until ``stop``."""
        async with httpx.AsyncClient(timeout=10) as http:
            while not stop.is_set():
                await self.push(http)
                try:
                    await asyncio.wait_for(stop.wait(), self.rng.expovariate(rate))
                except TimeoutError:
                    pass

    async def regression(self, key: str, good: int = 3, bad: int = 3) -> None:
        """A series pushed at once on ``key``: ``good`` passing pushes, then the regression
        begins: this series' next ``bad`` pushes and every later push of the key fail."""
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(good):
                await self.create(http, key, BUILD_QUEUE)
            self.broken.add(key)
            for _ in range(bad):
                await self.create(http, key, BUILD_QUEUE)

    async def burst(self, n: int) -> None:
        """``n`` pushes at once, and two on each paired key."""
        pairs = [key for key in self.scenario.paired for _ in range(2)]
        async with httpx.AsyncClient(timeout=10) as http:
            await asyncio.gather(
                *(self.push(http) for _ in range(n)),
                *(self.create(http, key, BUILD_QUEUE) for key in pairs),
            )

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
