"""The menu of faults, each injected for a few seconds and undone; drawn with a seeded RNG and
spaced over the run. Every injection is logged with its start, end and what it did."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import httpx
import orjson
import taskcluster

from tests.conftest import make_message
from tests.ports import free_port
from tests.soak.cast import Cast
from tests.tcp_proxy import TcpProxy


class Store(Protocol):
    """The soak's Redis (one server or a cluster): what the faults do to it."""

    def freeze(self) -> str: ...
    def thaw(self) -> None: ...
    def fill(self) -> str: ...
    def unfill(self) -> None: ...
    def read_only(self, dead_port: int) -> str: ...
    def writable(self) -> None: ...
    def restart_empty(self) -> str: ...


@dataclasses.dataclass
class Injected:
    kind: str
    start: float
    end: float = 0.0
    detail: str = ""


@dataclasses.dataclass
class Sent:
    """Input the faults sent that the product must refuse or hold to its limits."""

    bad_requests: int = 0
    bad_answers: dict[int, int] = dataclasses.field(default_factory=dict)  # status → count
    bad_pulse: int = 0  # malformed Pulse messages published: the dead-letter queue's only due
    flood_tasks: set[str] = dataclasses.field(default_factory=set)


class Faults:
    def __init__(
        self,
        *,
        cast: Cast,
        store: Store,
        proxies: list[TcpProxy],
        killable: list[str],
        service: str,
        token: str,
        prefix: str,
        rng: random.Random,
        rebuild: Callable[[], Awaitable[str]],
        publish_raw: Callable[[str, bytes], Awaitable[None]],
    ) -> None:
        self.cast = cast
        self.store = store
        self.proxies = proxies
        self.killable = killable
        self.service = service
        self.auth = {"Authorization": f"Bearer {token}"}
        self.prefix = prefix
        self.rng = rng
        self.rebuild = rebuild
        self.publish_raw = publish_raw
        self.log: list[Injected] = []
        self.sent = Sent()
        self.killed: set[str] = set()  # names being restarted: not an unexpected exit
        self.menu: dict[str, Callable[[], Awaitable[str]]] = {
            "redis-sigstop": self.redis_sigstop,
            "redis-oom": self.redis_oom,
            "redis-readonly": self.redis_readonly,
            "redis-restart-empty": self.redis_restart_empty,
            "broker-cut": self.broker_cut,
            "sigkill": self.sigkill,
            "bad-input": self.bad_input,
            "slow-clients": self.slow_clients,
            "key-flood": self.key_flood,
        }
        #: how often each is drawn, relative to the others
        self.weights = {"sigkill": 3, "broker-cut": 2, "redis-sigstop": 2}

    async def inject(self, kind: str) -> Injected:
        entry = Injected(kind, time.time())
        self.log.append(entry)
        try:
            entry.detail = await self.menu[kind]()
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            entry.detail = f"injection failed: {exc!r}"
        entry.end = time.time()
        return entry

    def draw(self) -> str:
        kinds = list(self.menu)
        return self.rng.choices(kinds, [self.weights.get(k, 1) for k in kinds])[0]

    async def run(
        self, until: float, gap: tuple[float, float] = (2.0, 6.0), at_least: int = 0
    ) -> None:
        """Inject one fault after another, ``gap`` seconds apart, until the time ``until`` and
        at least ``at_least`` of them (the same faults of a seed, however slow the machine)."""
        while True:
            await asyncio.sleep(self.rng.uniform(*gap))
            if time.time() >= until and len(self.log) >= at_least:
                return
            await self.inject(self.draw())

    # The store.

    async def redis_sigstop(self) -> str:
        seconds = self.rng.uniform(2, 6)
        what = await asyncio.to_thread(self.store.freeze)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(self.store.thaw)
        return f"{what} frozen {seconds:.1f} s"

    async def redis_oom(self) -> str:
        seconds = self.rng.uniform(3, 6)
        what = await asyncio.to_thread(self.store.fill)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(self.store.unfill)
        return f"{what}, full for {seconds:.1f} s"

    async def redis_readonly(self) -> str:
        seconds = self.rng.uniform(2, 5)
        what = await asyncio.to_thread(self.store.read_only, free_port())
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(self.store.writable)
        return f"{what} read-only {seconds:.1f} s"

    async def redis_restart_empty(self) -> str:
        what = await asyncio.to_thread(self.store.restart_empty)
        await asyncio.sleep(self.rng.uniform(0.5, 2))
        summary = await self.rebuild()
        return f"{what}; rebuild: {summary}"

    # The broker.

    async def broker_cut(self) -> str:
        cuts = 0
        times = self.rng.randint(1, 4)
        for _ in range(times):  # sometimes again and again, a fraction of a second apart
            cuts += sum(proxy.cut() for proxy in self.proxies)
            await asyncio.sleep(self.rng.uniform(0.2, 0.5))
        return f"{cuts} broker connections cut ({times} rounds)"

    # The processes.

    async def sigkill(self) -> str:
        name = self.rng.choice(self.killable)
        self.killed.add(name)
        try:
            await asyncio.to_thread(self.cast.kill, name)
            down = self.rng.uniform(0.5, 3)
            await asyncio.sleep(down)
            await asyncio.to_thread(self.cast.restart, name)
        finally:
            self.killed.discard(name)
        return f"{name} killed, restarted after {down:.1f} s"

    # Abuse.

    async def bad_input(self) -> str:
        bodies = [
            b"not json",
            b"{",
            b'{"not": "a list"}',
            b"[{}]",
            orjson.dumps([{"exchange": "exchange/taskcluster-queue/v1/task-pending"}]),
            orjson.dumps([make_message("not-a-slug", routes=(f"{self.prefix}.bad",))]),
            b"[" + b"1," * 2000 + b"1]",
        ]
        queries = [
            "/k0?taskId=!!!",
            "/k0?taskId=" + "A" * 3000,
            "/%ff%fe?taskId=x",
            "/k0?taskId=abc&taskId=def",
            "/" + "k/" * 300 + "?taskId=x",
            "/v1/events",
        ]
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(3):
                for body in bodies:
                    await self._bad(
                        http.post(
                            f"{self.service}/v1/events",
                            content=body,
                            headers={**self.auth, "content-type": "application/json"},
                        )
                    )
                for query in queries:
                    await self._bad(http.get(f"{self.service}{query}"))
        n = self.rng.randint(1, 3)
        for i in range(n):
            await self.publish_raw(f"route.{self.prefix}.bad.k{i}", b"{soak: invalid " + bytes(i))
        self.sent.bad_pulse += n
        return f"{len(bodies) * 3} bad POSTs, {len(queries) * 3} bad queries, {n} bad Pulse"

    async def _bad(self, request: Awaitable[httpx.Response]) -> None:
        self.sent.bad_requests += 1
        try:
            status = (await request).status_code
        except httpx.HTTPError:
            status = 0
        self.sent.bad_answers[status] = self.sent.bad_answers.get(status, 0) + 1

    async def slow_clients(self) -> str:
        host, port = self.service.removeprefix("http://").split(":")
        n, seconds = self.rng.randint(200, 400), self.rng.uniform(5, 10)
        writers: list[asyncio.StreamWriter] = []
        try:
            for i in range(n):
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection(host, int(port))
                    if i % 2:  # half send a head that never ends, half nothing at all
                        writer.write(b"GET /k0?taskId=x HTTP/1.1\r\nHost: soak\r\n")
                    writers.append(writer)
            await asyncio.sleep(seconds)
        finally:
            for writer in writers:
                writer.transport.abort()
        return f"{len(writers)} idle or slow connections held {seconds:.1f} s"

    async def key_flood(self) -> str:
        n = self.rng.randint(500, 2000)
        start = len(self.sent.flood_tasks)
        messages: list[dict[str, Any]] = []
        for i in range(n):
            task_id = taskcluster.slugid.nice()
            self.sent.flood_tasks.add(task_id)
            messages.append(make_message(task_id, routes=(f"{self.prefix}.flood.{start + i}",)))
        statuses: dict[int, int] = {}
        async with httpx.AsyncClient(timeout=30) as http:
            for at in range(0, n, 500):
                try:
                    r = await http.post(
                        f"{self.service}/v1/events", json=messages[at : at + 500], headers=self.auth
                    )
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                except httpx.HTTPError:
                    statuses[0] = statuses.get(0, 0) + 1
        return f"{n} new keys posted, answers {statuses}"
