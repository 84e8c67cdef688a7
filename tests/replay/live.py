"""Recording a run end to end with superseding on, for the replay to be compared with it.

Pushes of a build (its test depends on it) and a mac task land on the queue emulator, whose
clock stands still between the steps the run takes (so every recorded time is exact). The
service's index hears the queue's messages as ``coalescer listen`` would apply them (with the
policy, when one is given) and answers over HTTP; real worker shims (:class:`coalescer.worker.
Shim`) claim, ask, hold and resolve as they do on a real queue, and, under a policy, the real
enforcer (``coalescer enforce``'s :class:`~coalescer.policy.enforcer.Enforcer` and queue
actions) carries out its decisions on the emulator, as the identity ``coalescer/enforcer``.

Each step happens at one instant of the queue's clock, in the replay's order: the pushes due
and the dependents their builds' completions scheduled arrive; the index hears them and the
enforcer acts; a worker whose task was canceled stops (at once: the model's assumption, where
a real worker learns at its next reclaim); then every idle worker gets a task from
``claimWork``, all at once, as workers waiting in a long poll do; only then does each, in turn,
ask the service and claim what it lists. The clock then moves to the next push or the next end
of a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import httpx
import orjson
import uvicorn

from coalescer.emulator.harness import QueueEmulator
from coalescer.ingest.events import EXCHANGE_STATES, Message, to_event
from coalescer.policy.actions import Actions
from coalescer.policy.enforcer import Enforcer
from coalescer.policy.rules import Policy
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from coalescer.worker import Claim, Options, Outcome, Shim, Superseded
from coalescer.worker.claims import Connection
from coalescer.worker.protocol import COMPLETED, SupersedeAs

PREFIX = "coalesce.v1"
CREDENTIALS = {"clientId": "worker", "accessToken": "no-secret"}


@dataclasses.dataclass(frozen=True)
class Push:
    """One push, ``at`` seconds into the run: a build, the test that depends on it, a mac
    task, each running for the seconds given."""

    at: int
    build: int
    test: int
    mac: int


@contextlib.asynccontextmanager
async def served(store: Store, policy: Policy | None = None) -> AsyncIterator[str]:
    """The coalescer web app on a free port, on this event loop (where ``store`` is)."""
    settings = Settings(policy=policy, policy_file="policy.yaml" if policy else None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        create_app(settings, store), log_level="warning", lifespan="on", ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
        sock.close()


@dataclasses.dataclass
class _Worker:
    queue: str
    shim: Shim
    #: The run it executes: when it ends, and what ends it.
    end: int = 0
    task_id: str = ""
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    started: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    job: asyncio.Task[Any] | None = None


class LiveRun:
    """Pushes run end to end on ``em`` with ``workers`` per task queue (``proj/build``,
    ``proj/test``, ``proj/mac``). Tasks of the keys in ``asking`` name the service as their
    ``supersederUrl`` (their workers ask on claim); ``policy``, if any, decides on arrival and
    the enforcer carries it out. Secondaries and victims are resolved ``supersede_as``."""

    def __init__(
        self,
        em: QueueEmulator,
        store: Store,
        service: str,
        *,
        workers: dict[str, int],
        asking: Sequence[str] = ("build", "test", "mac"),
        policy: Policy | None = None,
        supersede_as: SupersedeAs = SupersedeAs.AUTO,
    ) -> None:
        self.em, self.store, self.service = em, store, service
        self.pools, self.asking, self.policy = workers, tuple(asking), policy
        self.supersede_as = supersede_as
        self.group = ""
        self.task_ids: list[str] = []
        self._fed = 0
        self._workers: list[_Worker] = []

    def now_ms(self) -> int:
        return int(self.em.clock.now().timestamp() * 1000)

    async def run(self, pushes: Sequence[Push]) -> str:
        """Run every push to its end; the task group's id."""
        import taskcluster

        self.group = taskcluster.slugid.nice()
        async with contextlib.AsyncExitStack() as stack:
            for queue, count in self.pools.items():
                for n in range(count):
                    name = f"{queue.split('/')[1]}-{n}"
                    shim = Shim(
                        root_url=self.em.root_url,
                        credentials=CREDENTIALS,
                        worker_group="live",
                        worker_id=name,
                        options=Options(
                            allow=(self.service,), tick=0.02, supersede_as=self.supersede_as
                        ),
                        clock=self.em.clock.now,
                        max_retries=0,
                    )
                    self._workers.append(_Worker(queue, await stack.enter_async_context(shim)))
            enforcer = None
            if self.policy is not None and self.policy.decides:
                enforcer = await stack.enter_async_context(self._enforcer())
            start = self.now_ms()
            due = sorted(pushes, key=lambda p: p.at)
            for _ in range(10_000):
                while due and start + due[0].at * 1000 <= self.now_ms():
                    self._push(len(pushes) - len(due), due.pop(0))
                self.em.clock.advance(0)  # the queue schedules the dependents of completed tasks
                await self._feed(enforcer)
                await self._stop_canceled()
                await self._claim()
                ends = [w.end for w in self._workers if w.job is not None]
                if due:
                    ends.append(start + due[0].at * 1000)
                if not ends:
                    return self.group
                self.em.clock.advance(max(0, min(ends) - self.now_ms()) / 1000)
                for worker in self._workers:
                    if worker.job is not None and worker.end <= self.now_ms():
                        await self._finish(worker)
        raise AssertionError("the run did not end in 10,000 steps")

    def _push(self, n: int, push: Push) -> None:
        build = self._create("build", "proj/build", n, push.build)
        self._create("test", "proj/test", n, push.test, dependencies=[build])
        self._create("mac", "proj/mac", n, push.mac)

    def _create(self, key: str, queue: str, n: int, seconds: int, **extra: Any) -> str:
        payload: dict[str, Any] = {"command": ["sleep", str(seconds)], "maxRunTime": 3600}
        if key in self.asking:
            payload["supersederUrl"] = f"{self.service}/{key}"
        task_id = self.em.create_task(
            taskQueueId=queue,
            taskGroupId=self.group,
            routes=[f"{PREFIX}.{key}"],
            tags={"push": str(n)},
            payload=payload,
            **extra,
        )
        self.task_ids.append(task_id)
        return task_id

    async def _feed(self, enforcer: Enforcer | None) -> None:
        """The index hears what the queue published; the enforcer carries out what it decided
        (which publishes more), until nothing is left."""
        while True:
            messages = list(self.em.published)[self._fed :]
            self._fed += len(messages)
            events = []
            for doc in messages:
                if doc["exchange"].rsplit("/", 1)[-1] in EXCHANGE_STATES:
                    event = to_event(Message.from_json(doc), prefix=PREFIX)
                    if event is not None:
                        events.append(event)
            if events:
                await self.store.apply(events, now_ms=self.now_ms(), policy=self.policy)
            if enforcer is None or not await enforcer.round():
                if len(self.em.published) == self._fed:
                    return

    async def _stop_canceled(self) -> None:
        """A worker whose task was canceled stops now."""
        for worker in self._workers:
            if worker.job is not None:
                status = (await worker.shim.queue.status(worker.task_id))["status"]
                if status["runs"][-1]["state"] != "running":
                    await self._finish(worker)

    async def _claim(self) -> None:
        claimed = []
        for worker in self._workers:
            if worker.job is None:
                answer = await worker.shim.queue.claimWork(
                    worker.queue,
                    {"tasks": 1, "workerGroup": "live", "workerId": worker.shim.worker_id},
                )
                claimed += [(worker, work) for work in answer["tasks"]]
        for worker, work in claimed:
            await self._feed(None)  # the service has heard of every claim before anyone asks
            worker.started.clear()
            worker.done.clear()
            worker.job = asyncio.create_task(worker.shim.run(work, self._execute(worker)))
            started = asyncio.create_task(worker.started.wait())
            async with asyncio.timeout(30):
                await asyncio.wait([worker.job, started], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            if worker.job.done():
                worker.job.result()
                worker.job = None
        await self._feed(None)

    def _execute(self, worker: _Worker) -> Any:
        async def execute(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
            worker.task_id = claim.task_id
            worker.end = self.now_ms() + int(claim.task["payload"]["command"][1]) * 1000
            worker.started.set()
            await worker.done.wait()
            return COMPLETED

        return execute

    async def _finish(self, worker: _Worker) -> None:
        assert worker.job is not None
        worker.done.set()
        async with asyncio.timeout(30):
            await worker.job
        worker.job = None

    @contextlib.asynccontextmanager
    async def _enforcer(self) -> AsyncIterator[Enforcer]:
        async with aiohttp.ClientSession() as session, httpx.AsyncClient() as http:
            conn = Connection(self.em.root_url, session, max_retries=0)
            actions = Actions(
                self.em.aio_queue(session=session),
                conn,
                http,
                supersede_as=self.supersede_as,
                clock=self.em.clock.now,
            )
            yield Enforcer(
                self.store,
                actions,
                policy=self.policy,
                consumer="live",
                clock=self.em.clock.now,
                lease_ms=5000,
                poll=0.02,
                tick=3600.0,
            )

    # -- what really happened ------------------------------------------------------------------
    def outcome(self) -> dict[str, str]:
        """Each task: ``ran``, ``never scheduled`` (or canceled before it was), or ``superseded
        by <taskId>`` (from its ``public/superseded-by.json``)."""
        queue = self.em.queue()
        found = {}
        for task_id in self.task_ids:
            runs = queue.status(task_id)["status"]["runs"]
            if not any("started" in run for run in runs):  # a cascade cancels it unscheduled
                found[task_id] = "never scheduled"
                continue
            url = f"{self.em.root_url}/emulator/v1/blobs/{task_id}/{runs[-1]['runId']}"
            link = httpx.get(f"{url}/public/superseded-by.json")
            if link.status_code == 200:
                found[task_id] = "superseded by " + orjson.loads(link.content)["taskId"]
            elif runs[-1]["state"] == "completed":
                found[task_id] = "ran"
            else:
                found[task_id] = runs[-1]["state"] + "/" + runs[-1]["reasonResolved"]
        return found
