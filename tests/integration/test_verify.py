"""A run's state captured before it ended, applied after Redis was emptied: checked against
the queue (``coalescer.ingest.verify``), it does not outlive the check.

A real redis-server started by the test, restarted empty; the queue emulator as the queue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import httpx
import pytest
import taskcluster.aio

from coalescer.emulator.harness import QueueEmulator
from coalescer.errors import StoreUnavailable
from coalescer.ingest.events import Message, to_event
from coalescer.ingest.reconcile import queue_fetcher
from coalescer.ingest.verify import Verifier
from coalescer.model import TaskEvent
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.web.app import create_app
from tests.policy.support import eventually
from tests.redis_server import RedisServer
from tests.redis_server import redis_server as started_redis
from tests.web.conftest import AUTH

pytestmark = pytest.mark.integration

KEY = "verify.k"
_T = TypeVar("_T")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with started_redis() as server:
        yield server


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[Store]:
    s = await open_store(redis_server.url, grace_seconds=3600)
    yield s
    await s.close()


class Counted:
    """The emulator's statuses, counting the tasks asked about."""

    def __init__(self, queue_emulator: QueueEmulator, session: Any) -> None:
        queue = taskcluster.aio.Queue({"rootUrl": queue_emulator.root_url}, session=session)
        self.inner = queue_fetcher(queue)
        self.asked: list[str] = []

    async def __call__(self, task_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        self.asked += task_ids
        return await self.inner(task_ids)


def event(queue_emulator: QueueEmulator, kind: str, task_id: str) -> TaskEvent:
    [message] = queue_emulator.messages(kind, task_id)
    found = to_event(Message.from_json(message), prefix="coalesce.v1")
    assert found is not None
    return found


def failed_task(em: QueueEmulator) -> str:
    """A task of ``KEY`` whose first run ran and failed."""
    task_id = em.create_task(routes=[f"coalesce.v1.{KEY}"])
    em.queue().claimTask(task_id, 0, {"workerGroup": "wg", "workerId": "wi"})
    em.queue().reportFailed(task_id, 0)
    return task_id


async def once_up(call: Callable[[], Awaitable[_T]]) -> _T:
    """``call()``, polled with a deadline until the store takes it: the first call after a
    restart finds the old connection closed, as ingest finds it and retries."""

    async def attempt() -> tuple[_T] | None:
        try:
            return (await call(),)
        except StoreUnavailable:
            return None

    found: tuple[_T] = await eventually(attempt)
    return found[0]


async def apply(store: Store, events: list[TaskEvent]) -> None:
    """``store.apply``, once the store takes it (:func:`once_up`)."""
    await once_up(lambda: store.apply(events))


async def state(store: Store, task_id: str) -> tuple[int, str]:
    record = (await store.known(KEY, [task_id]))[task_id]
    return record.run_id, record.state


async def test_a_running_state_applied_after_an_emptying_is_corrected_from_the_queue(
    queue_emulator: QueueEmulator, redis_server: RedisServer, store: Store
) -> None:
    em = queue_emulator
    ended = failed_task(em)
    running = event(em, "task-running", ended)
    await store.apply([event(em, "task-pending", ended), running, event(em, "task-failed", ended)])
    assert await state(store, ended) == (0, "failed")

    # Emptied. One consumer held the run's running message while the store was down; another
    # had applied its end to the lost index. The running message comes now.
    redis_server.restart_empty()
    await apply(store, [running])
    assert await state(store, ended) == (0, "running")  # what versions alone leave

    async with taskcluster.aio.createSession() as session:
        fetch = Counted(em, session)
        verifier = Verifier(store, fetch)
        assert await verifier.check([running]) == 1
        assert await state(store, ended) == (0, "failed")
        assert fetch.asked == [ended]

        # A task scheduled since the emptying was seen whole: it costs no question.
        em.clock.advance(1)
        fresh = em.create_task(routes=[f"coalesce.v1.{KEY}"])
        pending = event(em, "task-pending", fresh)
        await store.apply([pending])
        assert await verifier.check([pending]) == 0
        assert fetch.asked == [ended]
        # Checked again, the corrected task changes nothing.
        assert await verifier.check([running]) == 0
        assert await state(store, ended) == (0, "failed")


async def test_without_the_queue_the_events_stay_as_they_came_and_checks_pause(
    queue_emulator: QueueEmulator, redis_server: RedisServer, store: Store
) -> None:
    em = queue_emulator
    task_id = em.create_task(routes=[f"coalesce.v1.{KEY}"])
    pending = event(em, "task-pending", task_id)
    redis_server.restart_empty()
    em.clock.advance(1)
    await apply(store, [pending])
    await store.index_state(10**13)  # the emptying found later than the task's run

    async def down(task_ids: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
        calls.append(list(task_ids))
        raise TimeoutError

    calls: list[list[str]] = []
    verifier = Verifier(store, down)
    assert await verifier.check([pending]) == 0
    assert await state(store, task_id) == (0, "pending")
    assert await verifier.check([pending]) == 0  # paused: the queue is not asked again
    assert calls == [[task_id]]


async def test_the_ingest_endpoint_checks_what_it_applied(
    queue_emulator: QueueEmulator, redis_server: RedisServer, store: Store
) -> None:
    em = queue_emulator
    task_id = failed_task(em)
    redis_server.restart_empty()
    settings = Settings.from_environ(
        {
            "REDIS_URL": redis_server.url,
            "COALESCER_INGEST_TOKEN": "s3cret",
            "TASKCLUSTER_ROOT_URL": em.root_url,
        }
    )
    app = create_app(settings, store)
    app.state.verifier = Verifier.from_settings(settings, store)  # as the lifespan makes it
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://test"
        ) as client:
            # The run's running message, delivered only now (the first try after the restart
            # finds the old connection closed: 503, and a publisher tries again).
            async def delivered() -> httpx.Response | None:
                r = await client.post(
                    "/v1/events", json=em.messages("task-running", task_id), headers=AUTH
                )
                return None if r.status_code == 503 else r

            r = await eventually(delivered)
            assert r.status_code == 200, r.text
            assert [x["status"] for x in r.json()["results"]] == ["applied"]
        assert await state(store, task_id) == (0, "failed")
    finally:
        await app.state.verifier.close()


async def test_a_store_that_cannot_be_read_is_the_callers_to_wait_for(
    queue_emulator: QueueEmulator, redis_server: RedisServer, store: Store
) -> None:
    em = queue_emulator
    task_id = em.create_task(routes=[f"coalesce.v1.{KEY}"])
    pending = event(em, "task-pending", task_id)
    redis_server.restart_empty()
    await apply(store, [pending])

    async with taskcluster.aio.createSession() as session:
        fetch = Counted(em, session)
        verifier = Verifier(store, fetch)
        redis_server.kill()
        with pytest.raises(StoreUnavailable):
            await verifier.check([pending])
        redis_server.start()
        # Not paused: the caller's retry checks the events (ingest holds them meanwhile).
        assert await once_up(lambda: verifier.check([pending])) == 0  # pending there too
        assert fetch.asked == [task_id]
