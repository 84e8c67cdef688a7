"""A queried task the index does not know (event lag) is learned from the queue first
(coalescer.ingest.learn), against the queue emulator (the real API, through the official client)
and the real Redis; whatever goes wrong, the answer is ``[ID]`` alone, as without it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import taskcluster
from prometheus_client import REGISTRY
from starlette.applications import Starlette

from coalescer.emulator import endpoints
from coalescer.emulator.app import Call
from coalescer.emulator.harness import QueueEmulator
from coalescer.emulator.model import QueueError
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.ingest.learn import Learner
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from tests.conftest import make_message
from tests.ports import free_port
from tests.web.conftest import AUTH, post

WORKER = {"workerGroup": "wg", "workerId": "wi"}


class Tap:
    """Between the emulator's ``task`` and ``status`` endpoints and their callers: counts the
    calls, and can hold them, fail them (500) or spoil the status's answer."""

    NAMES = ("task", "status")

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.active = 0  # status calls in progress
        self.most_active = 0
        self.reached = threading.Event()
        self.released = threading.Event()
        self.released.set()  # clear() to hold calls until set() again
        self.fail = False
        self.spoil: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self._real = {name: endpoints.HANDLERS[name] for name in self.NAMES}

    def hold(self) -> None:
        self.reached.clear()
        self.released.clear()

    def handler(self, name: str) -> Callable[[Call], Any]:
        async def handle(call: Call) -> Any:
            self.calls[name] += 1
            if name == "status":
                self.active += 1
                self.most_active = max(self.most_active, self.active)
            try:
                self.reached.set()
                while not self.released.is_set():  # noqa: ASYNC110 (released from the test)
                    await asyncio.sleep(0.01)
                if self.fail:
                    raise QueueError("InternalServerError", "the tap failed this call")
                body = await self._real[name](call)
                return self.spoil(body) if self.spoil and name == "status" else body
            finally:
                if name == "status":
                    self.active -= 1

        return handle


@pytest.fixture
def tap(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tap]:
    t = Tap()
    for name in Tap.NAMES:
        monkeypatch.setitem(endpoints.HANDLERS, name, t.handler(name))
    yield t
    t.released.set()


@pytest.fixture
def queue_emulator_options(tap: Tap, queue_emulator_options: EmulatorOptions) -> EmulatorOptions:
    return queue_emulator_options  # the tap is in place before the emulator's app is built


@pytest.fixture
def learning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="coalescer.ingest.learn")


def learned(outcome: str) -> float:
    return REGISTRY.get_sample_value("coalescer_learn_total", {"outcome": outcome}) or 0.0


def lookups() -> float:
    return REGISTRY.get_sample_value("coalescer_learn_lookups_total") or 0.0


def settings_for(redis_url: str, root_url: str | None, **env: str) -> Settings:
    base = {"REDIS_URL": redis_url, "COALESCER_INGEST_TOKEN": "s3cret"}
    if root_url is not None:
        base["TASKCLUSTER_ROOT_URL"] = root_url
    return Settings.from_environ(base | env)


@contextlib.asynccontextmanager
async def service(
    store: Store, settings: Settings
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The app over ``store``, with the learner its lifespan would make (``None`` when off)."""
    app = create_app(settings, store)
    app.state.learner = Learner.from_settings(settings, store)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://test"
        ) as client:
            yield app, client
    finally:
        if app.state.learner is not None:
            await app.state.learner.close()


@pytest.fixture
async def web(
    store: Store, redis_url: str, queue_emulator: QueueEmulator
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    async with service(store, settings_for(redis_url, queue_emulator.root_url)) as pair:
        yield pair


def create(em: QueueEmulator, key: str = "k") -> str:
    """A pending task under ``key``, a second later than the previous one."""
    task_id = em.create_task(routes=[f"coalesce.v1.{key}"])
    em.clock.advance(1)
    return task_id


def claim(em: QueueEmulator, task_id: str) -> None:
    """A worker claims ``task_id``'s first run: the task is running when its worker asks."""
    em.queue().claimTask(task_id, 0, WORKER)


async def deliver(
    client: httpx.AsyncClient, em: QueueEmulator, kind: str, *tasks: str
) -> list[str]:
    """Pulse's ``kind`` messages of ``tasks``, through the ingest endpoint; their outcomes."""
    results = await post(client, *(em.messages(kind, t)[0] for t in tasks))
    return [r["status"] for r in results]


async def supersedes(client: httpx.AsyncClient, task_id: str, key: str = "k") -> list[str]:
    r = await client.get(f"/{key}?taskId={task_id}")
    assert r.status_code == 200, r.text
    answer: list[str] = r.json()["supersedes"]
    return answer


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    give_up = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < give_up, "gave up waiting"
        await asyncio.sleep(0.01)


def why(caplog: pytest.LogCaptureFixture, task_id: str) -> list[str]:
    """The outcomes the learner logged for ``task_id``."""
    return [
        r.outcome
        for r in caplog.records
        if r.name == "coalescer.ingest.learn" and getattr(r, "task_id", None) == task_id
    ]


async def test_an_undelivered_task_is_placed_by_its_own_order_among_the_pending(
    web: tuple[Starlette, httpx.AsyncClient],
    queue_emulator: QueueEmulator,
    store: Store,
    tap: Tap,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    _, client = web
    em = queue_emulator
    a, b, x, c, d = (create(em) for _ in range(5))
    assert await deliver(client, em, "task-pending", a, b, c, d) == ["applied"] * 4
    claim(em, x)  # neither x's pending nor its running event has arrived
    before = learned("learned")
    assert await supersedes(client, x) == [a, b, x, c, d]
    assert learned("learned") == before + 1 and why(caplog, x) == ["learned"]
    assert tap.calls == {"task": 1, "status": 1}
    record = (await store.known("k", [x]))[x]
    assert (record.state, record.run_id) == ("running", 0)
    # Known now: the next query takes the ordinary path, without asking the queue.
    assert await supersedes(client, x) == [a, b, x, c, d]
    assert tap.calls == {"task": 1, "status": 1}


async def test_the_real_lifespan_opens_and_closes_the_learner(
    store: Store, redis_url: str, queue_emulator: QueueEmulator, tap: Tap
) -> None:
    em = queue_emulator
    a, x = create(em), create(em)
    app = create_app(settings_for(redis_url, em.root_url), store)
    async with app.router.lifespan_context(app):
        learner = app.state.learner
        assert isinstance(learner, Learner)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            await deliver(c, em, "task-pending", a)
            assert await supersedes(c, x) == [a, x]
    assert app.state.learner is None and learner._session is not None and learner._session.closed
    assert tap.calls == {"task": 1, "status": 1}


async def test_a_duplicate_pulse_event_afterwards_changes_nothing(
    web: tuple[Starlette, httpx.AsyncClient], queue_emulator: QueueEmulator, store: Store
) -> None:
    _, client = web
    em = queue_emulator
    a, x, c = (create(em) for _ in range(3))
    await deliver(client, em, "task-pending", a, c)
    claim(em, x)
    assert await supersedes(client, x) == [a, x, c]
    learnt = await store.known("k", [x])
    # Pulse catches up: x's pending and running events arrive late, twice.
    for _ in range(2):
        assert await deliver(client, em, "task-pending", x) == ["stale"]
        assert await deliver(client, em, "task-running", x) == ["stale"]
    assert await store.known("k", [x]) == learnt
    assert await supersedes(client, x) == [a, x, c]
    assert (await client.get("/k")).json()["pending"][0]["taskId"] == a


async def test_a_pulse_event_racing_the_lookup_changes_nothing(
    web: tuple[Starlette, httpx.AsyncClient],
    queue_emulator: QueueEmulator,
    store: Store,
    tap: Tap,
) -> None:
    _, client = web
    em = queue_emulator
    a, x, c = (create(em) for _ in range(3))
    await deliver(client, em, "task-pending", a, c)
    claim(em, x)
    before = learned("learned")
    tap.hold()
    query = asyncio.create_task(supersedes(client, x))
    await until(tap.reached.is_set)
    # Pulse delivers while the queue is being asked: the lookup's event is then stale.
    assert await deliver(client, em, "task-pending", x) == ["applied"]
    assert await deliver(client, em, "task-running", x) == ["applied"]
    delivered = await store.known("k", [x])
    tap.released.set()
    assert await query == [a, x, c]
    assert learned("learned") == before + 1
    assert await store.known("k", [x]) == delivered


async def test_concurrent_queries_for_one_task_share_one_lookup(
    web: tuple[Starlette, httpx.AsyncClient], queue_emulator: QueueEmulator, tap: Tap
) -> None:
    app, client = web
    em = queue_emulator
    a, x, c = (create(em) for _ in range(3))
    await deliver(client, em, "task-pending", a, c)
    claim(em, x)
    before, looked_up = learned("learned"), lookups()
    tap.hold()
    queries = [asyncio.create_task(supersedes(client, x)) for _ in range(5)]
    await until(lambda: app.state.learner.waiting(x) == 5)
    tap.released.set()
    assert await asyncio.gather(*queries) == [[a, x, c]] * 5
    assert tap.calls == {"task": 1, "status": 1}
    assert lookups() == looked_up + 1 and learned("learned") == before + 5
    assert app.state.learner.waiting(x) == 0


async def test_lookups_in_flight_are_bounded(
    store: Store, redis_url: str, queue_emulator: QueueEmulator, tap: Tap
) -> None:
    em = queue_emulator
    settings = settings_for(redis_url, em.root_url, COALESCER_LEARN_TIMEOUT="30")
    async with service(store, settings) as (_, client):
        tasks = {f"k{n}": create(em, key=f"k{n}") for n in range(10)}
        before = learned("learned")
        tap.hold()
        queries = [asyncio.create_task(supersedes(client, t, key)) for key, t in tasks.items()]
        await until(lambda: tap.active == 8)
        assert tap.calls["status"] == 8  # the other two wait for a free slot
        tap.released.set()
        assert await asyncio.gather(*queries) == [[t] for t in tasks.values()]
        assert tap.calls["status"] == 10 and tap.most_active == 8
        assert learned("learned") == before + 10


async def test_a_lookup_cut_short_by_shutdown_answers_the_task_alone(
    store: Store, redis_url: str, queue_emulator: QueueEmulator, tap: Tap
) -> None:
    em = queue_emulator
    a, x = create(em), create(em)
    async with service(store, settings_for(redis_url, em.root_url)) as (app, client):
        await deliver(client, em, "task-pending", a)
        tap.hold()
        queries = [asyncio.create_task(supersedes(client, x)) for _ in range(2)]
        await until(lambda: app.state.learner.waiting(x) == 2)
        queries[0].cancel()  # one client gives up: the other's lookup goes on
        await until(lambda: app.state.learner.waiting(x) == 1)
        await app.state.learner.close()  # the service stops meanwhile
        assert await queries[1] == [x]
        app.state.learner = None
    tap.released.set()  # before the emulator stops: it would wait for the held call


@pytest.mark.parametrize("how", ["unreachable", "failing"])
async def test_a_queue_down_answers_the_task_alone(
    store: Store,
    redis_url: str,
    queue_emulator: QueueEmulator,
    tap: Tap,
    how: str,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    em = queue_emulator
    a, x = create(em), create(em)
    root = em.root_url if how == "failing" else f"http://127.0.0.1:{free_port()}"
    tap.fail = True  # 500 for every call, retried by the client, then given up
    before = learned("failed")
    async with service(store, settings_for(redis_url, root)) as (_, client):
        await deliver(client, em, "task-pending", a)
        assert await supersedes(client, x) == [x]
    assert learned("failed") == before + 1 and why(caplog, x) == ["failed"]
    assert any(r.levelno == logging.WARNING and x in r.getMessage() for r in caplog.records)
    assert tap.calls["status"] == (3 if how == "failing" else 0)  # once and MAX_RETRIES


async def test_a_slow_queue_times_out_and_answers_the_task_alone(
    store: Store,
    redis_url: str,
    queue_emulator: QueueEmulator,
    tap: Tap,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    em = queue_emulator
    a, x, c = (create(em) for _ in range(3))
    claim(em, x)
    before = learned("timeout")
    settings = settings_for(redis_url, em.root_url, COALESCER_LEARN_TIMEOUT="0.3")
    async with service(store, settings) as (app, client):
        await deliver(client, em, "task-pending", a, c)
        tap.hold()
        started = time.monotonic()
        assert await supersedes(client, x) == [x]
        # The 0.3 s learn timeout, not the held queue (it answers only once released); the
        # margin is for a busy machine.
        assert time.monotonic() - started < 5
        assert learned("timeout") == before + 1 and why(caplog, x) == ["timeout"]
        assert app.state.learner.waiting(x) == 0  # nothing left in flight
        # The queue recovers: the next query learns the task.
        tap.released.set()
        assert await supersedes(client, x) == [a, x, c]


async def test_a_task_the_queue_does_not_know_is_answered_alone(
    web: tuple[Starlette, httpx.AsyncClient],
    queue_emulator: QueueEmulator,
    store: Store,
    tap: Tap,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    _, client = web
    a = create(queue_emulator)
    await deliver(client, queue_emulator, "task-pending", a)
    x = taskcluster.slugid.nice()
    before = learned("not-found")
    assert await supersedes(client, x) == [x]
    assert learned("not-found") == before + 1 and why(caplog, x) == ["not-found"]
    assert tap.calls == {"task": 1, "status": 1}
    assert await store.known("k", [x]) == {}


async def test_an_answer_failing_its_schema_is_not_used(
    web: tuple[Starlette, httpx.AsyncClient],
    queue_emulator: QueueEmulator,
    store: Store,
    tap: Tap,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    _, client = web
    em = queue_emulator
    a, x = create(em), create(em)
    await deliver(client, em, "task-pending", a)
    tap.spoil = lambda body: {
        "status": {k: v for k, v in body["status"].items() if k != "deadline"}
    }
    before = learned("invalid")
    assert await supersedes(client, x) == [x]
    assert learned("invalid") == before + 1 and why(caplog, x) == ["invalid"]
    assert any("fails its schema" in r.getMessage() for r in caplog.records)
    assert await store.known("k", [x]) == {}


async def test_a_task_not_under_the_queried_key_is_answered_alone(
    web: tuple[Starlette, httpx.AsyncClient],
    queue_emulator: QueueEmulator,
    tap: Tap,
    caplog: pytest.LogCaptureFixture,
    learning: None,
) -> None:
    _, client = web
    em = queue_emulator
    a, x = create(em), create(em, key="other")
    await deliver(client, em, "task-pending", a)
    claim(em, x)
    before = learned("not-under-key")
    assert await supersedes(client, x) == [x]
    assert learned("not-under-key") == before + 1 and why(caplog, x) == ["not-under-key"]
    # What the queue said was true, though: x is known under its own key from now on.
    assert await supersedes(client, x, key="other") == [x]
    assert tap.calls == {"task": 1, "status": 1}
    # And a task with no coalescing route at all is not under any key.
    y = em.create_task(routes=["index.project.y"])
    assert await supersedes(client, y) == [y]
    assert why(caplog, y) == ["not-under-key"]


async def test_turned_off_the_queue_is_never_asked(
    store: Store, redis_url: str, queue_emulator: QueueEmulator, tap: Tap
) -> None:
    em = queue_emulator
    a, x = create(em), create(em)
    settings = settings_for(redis_url, em.root_url, COALESCER_LEARN_UNKNOWN="false")
    async with service(store, settings) as (app, client):
        assert app.state.learner is None
        await deliver(client, em, "task-pending", a)
        assert await supersedes(client, x) == [x]
    assert tap.calls == {}


async def test_without_a_root_url_nothing_is_learned(
    app: Starlette, client: httpx.AsyncClient
) -> None:
    assert app.state.learner is None
    a, x = taskcluster.slugid.nice(), taskcluster.slugid.nice()
    r = await client.post("/v1/events", json=[make_message(a)], headers=AUTH)
    assert r.status_code == 200
    assert await supersedes(client, x) == [x]


async def test_the_queue_is_asked_with_the_credentials_in_the_environment(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For a queue whose anonymous role cannot read tasks: as the official client reads them."""
    settings = Settings.from_environ({"TASKCLUSTER_ROOT_URL": "http://queue.invalid"})
    monkeypatch.delenv("TASKCLUSTER_CLIENT_ID", raising=False)
    monkeypatch.delenv("TASKCLUSTER_ACCESS_TOKEN", raising=False)
    anonymous = Learner.from_settings(settings, store)
    monkeypatch.setenv("TASKCLUSTER_CLIENT_ID", "coalescer/web")
    monkeypatch.setenv("TASKCLUSTER_ACCESS_TOKEN", "s3cret")
    signed = Learner.from_settings(settings, store)
    try:
        assert anonymous is not None and signed is not None
        assert anonymous.queue.options["credentials"]["clientId"] is None
        assert signed.queue.options["credentials"]["clientId"] in (
            "coalescer/web",
            b"coalescer/web",
        )
    finally:
        for learner in (anonymous, signed):
            if learner is not None:
                await learner.close()
