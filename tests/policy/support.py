"""The superseding-policy loop in one test process: the queue emulator publishes, :class:`Loop`
feeds its messages to the index (with the policy, at the emulator's time), and enforcers carry
out the outbox against the emulator."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx
import orjson

from coalescer.emulator.harness import QueueEmulator
from coalescer.ingest.events import EXCHANGE_STATES, Message, to_event
from coalescer.policy.actions import Actions
from coalescer.policy.enforcer import Enforcer
from coalescer.policy.rules import Policy, loads
from coalescer.settings import Secret, Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from coalescer.worker.claims import Connection
from coalescer.worker.protocol import SupersedeAs

QUEUE = "emulator-test/worker"
WORKER = {"workerGroup": "wg", "workerId": "w1"}
TOKEN = "s3cret"


def policy(text: str) -> Policy:
    return loads(text, "test-policy.yaml", toml=False)


def rule(key: str = "k", **fields: Any) -> Policy:
    """A one-rule policy for ``key`` (YAML field names with ``_`` for ``-``)."""
    body = {"keys": key} | {k.replace("_", "-"): v for k, v in fields.items()}
    return policy(orjson.dumps({"rules": [body]}).decode())


class Loop:
    def __init__(
        self,
        emulator: QueueEmulator,
        store: Store,
        policy: Policy,
        rank_tag: str | None = None,
    ) -> None:
        self.em = emulator
        self.store = store
        self.policy = policy
        #: The task tag that orders a key's tasks (COALESCER_RANK_TAG), for the index and
        #: the enforcer alike; None: the first run's scheduled time.
        self.rank_tag = rank_tag
        self.fed = 0
        #: When the index began to know every task: this loop's start, marked at its first
        #: feed as a service marks a new store when it starts (the searches trust that mark).
        self.born_ms = self.now_ms()
        self.marked = False

    def now_ms(self) -> int:
        return int(self.em.clock.now().timestamp() * 1000)

    def create(self, key: str = "k", **overrides: Any) -> str:
        """A task under ``key``, a second after the previous one: creation order is the index's
        order (tasks scheduled in the same millisecond would be ordered by taskId)."""
        self.em.clock.advance(1)
        routes = overrides.pop("routes", [f"coalesce.v1.{key}"])
        return self.em.create_task(routes=routes, **overrides)

    async def feed(self) -> list[str]:
        """Apply every message published since the last feed, as the Pulse consumer would."""
        if not self.marked:
            await self.store.index_state(self.born_ms)
            self.marked = True
        messages = list(self.em.published)[self.fed :]
        self.fed += len(messages)
        events = []
        for doc in messages:
            if doc["exchange"].rsplit("/", 1)[-1] not in EXCHANGE_STATES:
                continue  # the consumer binds the task state exchanges only
            event = to_event(Message.from_json(doc), prefix="coalesce.v1", rank_tag=self.rank_tag)
            if event is not None:
                events.append(event)
        if not events:
            return []
        return list(await self.store.apply(events, now_ms=self.now_ms(), policy=self.policy))

    def status(self, task_id: str) -> dict[str, Any]:
        return dict(self.em.queue().status(task_id)["status"])

    def last_run(self, task_id: str) -> dict[str, Any]:
        return dict(self.status(task_id)["runs"][-1])

    def artifact(self, task_id: str, run_id: int, name: str) -> Any:
        url = f"{self.em.root_url}/emulator/v1/blobs/{task_id}/{run_id}/{name}"
        response = httpx.get(url)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return orjson.loads(response.content) if name.endswith(".json") else response.text

    def claim(self, task_id: str) -> dict[str, Any]:
        """A worker claims ``task_id``'s pending run (as claimWork would hand it out)."""
        run_id = self.last_run(task_id)["runId"]
        return dict(self.em.queue().claimTask(task_id, str(run_id), WORKER))

    def resolve(self, claim: dict[str, Any], how: str = "completed") -> None:
        queue = self.em.queue(claim["credentials"])
        task_id, run_id = claim["status"]["taskId"], str(claim["runId"])
        if how == "completed":
            queue.reportCompleted(task_id, run_id)
        elif how == "failed":
            queue.reportFailed(task_id, run_id)
        else:
            queue.reportException(task_id, run_id, {"reason": how})

    @contextlib.asynccontextmanager
    async def enforcer(self, consumer: str = "e1", **options: Any) -> AsyncIterator[Enforcer]:
        mode = options.pop("supersede_as", SupersedeAs.AUTO)
        async with aiohttp.ClientSession() as session, httpx.AsyncClient() as http:
            conn = Connection(self.em.root_url, session, max_retries=0)
            queue = self.em.aio_queue(session=session)
            actions = Actions(
                queue,
                conn,
                http,
                supersede_as=mode,
                clock=self.em.clock.now,
                rank_tag=self.rank_tag,
            )
            options = {"lease_ms": 5000, "poll": 0.02, "tick": 3600.0} | options
            yield Enforcer(
                self.store,
                actions,
                policy=self.policy,
                consumer=consumer,
                clock=self.em.clock.now,
                **options,
            )

    @contextlib.asynccontextmanager
    async def service(self) -> AsyncIterator[httpx.AsyncClient]:
        """The web app (with this policy) on this loop's store, as an HTTP client."""
        settings = Settings(
            policy=self.policy, policy_file="test-policy.yaml", ingest_token=Secret(TOKEN)
        )
        app = create_app(settings, self.store)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://coalescer") as client:
            yield client

    async def enforce(self, *, within: float = 10.0) -> int:
        """Feed, then run enforcer rounds until a round finds nothing to do."""
        total = 0
        async with self.enforcer() as enforcer:
            give_up = time.monotonic() + within
            while True:
                await self.feed()
                done = await enforcer.round()
                total += done
                if not done:
                    await self.feed()
                    return total
                assert time.monotonic() < give_up, "the outbox did not drain in time"


async def eventually(check: Callable[[], Awaitable[Any]], within: float = 10.0) -> Any:
    """Poll ``check()`` until it is truthy, with a deadline."""
    give_up = time.monotonic() + within
    while not (result := await check()):
        assert time.monotonic() < give_up, "condition not met in time"
        await asyncio.sleep(0.02)
    return result
