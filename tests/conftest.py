"""Shared fixtures: a real Redis store (flushed around each test), event builders."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hypothesis
import pytest
import redis.asyncio as aioredis

from coalescer.settings import Settings
from coalescer.store import Store, open_store

REDIS_URL = os.environ.get("COALESCER_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("COALESCER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")

#: Whether the tests may start Redis servers of their own (``scripts/with_services.py`` says so
#: when it started a throwaway one): then each pytest-xdist worker runs on a ``redis-server`` of
#: its own, so that no worker's flush, fill or freeze reaches another's.
OWN_REDIS = "COALESCER_TEST_REDIS_OWN"

hypothesis.settings.register_profile("fixed", derandomize=True)
hypothesis.settings.register_profile("random", derandomize=False)
#: The same examples on every run (``make test`` draws nothing at random); another run's with
#: ``--hypothesis-profile random``.
hypothesis.settings.load_profile("fixed")


#: Tests whose subject is the product's own decisions, not a library's behaviour: the property
#: tests (hypothesis varies our inputs over the library calls the other tests make), the
#: bisection's search, the replay's model, and the end-to-end runs (demo, soak) of what the
#: other tests cover seam by seam. Marked ``newest_only``: ``make test`` runs them in its
#: first pass only, and the lowest-versions pass (``-m "not newest_only"``) runs everything else.
#: A test not listed here runs at both ends.
NEWEST_ONLY = (
    "integration/test_demo.py",
    "integration/test_enforce_bisect.py",
    "integration/test_properties.py",
    "integration/test_replay_honesty.py",
    "integration/test_soak.py",
    "policy/test_bisect.py",
    "policy/test_bisect_gap.py",
    "policy/test_bisect_gap_properties.py",
    "policy/test_bisect_properties.py",
    "policy/test_properties.py",
    "replay/test_failures.py",
    "replay/test_live_runs.py",
    "replay/test_policy_file.py",
    "replay/test_pool.py",
    "replay/test_queue_sources.py",
    "replay/test_recorded.py",
    "replay/test_runs.py",
    "replay/test_superseding.py",
    "replay/test_synthetic.py",
    "unit/test_bisection.py",
    "worker/test_bisect.py",
    "worker/test_bisect_report.py",
)


#: The slowest files (``pytest --durations``), run first, longest first: handed out before the
#: short tests, they end with them instead of after them on a worker of their own. Not the
#: fuzzing (web/test_openapi.py): it stops at a time budget, which it spent in two of its passes
#: among these at the lowest versions.
SLOW_FIRST = (
    "integration/test_soak.py",
    "integration/test_pulse_churn.py",
    "policy/test_bisect.py",
    "integration/test_replay_honesty.py",
    "integration/test_pulse_process.py",
    "integration/test_own_broker.py",
    "integration/test_serve.py",
    "replay/test_live_runs.py",
    "integration/test_listen_index.py",
    "replay/test_failures.py",
    "integration/test_serve_limits.py",
    "integration/test_demo.py",
    "replay/test_cli.py",
    "integration/test_browser.py",
    "integration/test_cluster_failover.py",
    "integration/test_redis_url.py",
    "integration/test_enforce_bisect.py",
    "worker/test_runner.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent

    def where(item: pytest.Item) -> str:
        return item.path.relative_to(here).as_posix()

    for item in items:
        if where(item) in NEWEST_ONLY:
            item.add_marker(pytest.mark.newest_only)
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(where(item), len(rank)))  # stable: in order otherwise


def pytest_configure(config: pytest.Config) -> None:
    global REDIS_URL
    # No current event loop, set on purpose. pytest-asyncio before 1.5 (the lowest pass runs
    # 1.0) saves the current loop around each async test with asyncio.get_event_loop(), which
    # in a process where none was ever set makes one, then restores it as current: a loop
    # nobody closes. The next asyncio.run() (a sync test's) unsets it, and the collector later
    # reports its self-pipe as an unclosed socket in whichever test runs then (pytest-asyncio
    # issue 724). Once a loop was set, even to none, get_event_loop() raises instead, which
    # pytest-asyncio expects; tests/unit/test_event_loops.py fails without this.
    asyncio.set_event_loop(None)
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest-xdist
    if not worker:
        return
    if os.environ.get(OWN_REDIS):
        from tests.redis_server import RedisServer

        for attempt in range(3):  # another worker may have taken the free port meanwhile
            server = RedisServer()
            try:
                server.start()
                break
            except RuntimeError:
                server.stop()
                if attempt == 2:
                    raise
        config.add_cleanup(server.stop)
        REDIS_URL = server.url
    else:  # a database of the given server per worker: 15, 14, ... for gw0, gw1, ...
        parts = urlsplit(REDIS_URL)
        given = int(parts.path.strip("/") or 0)
        database = (given - int(worker.removeprefix("gw"))) % 16
        REDIS_URL = parts._replace(path=f"/{database}").geturl()
    os.environ["COALESCER_TEST_REDIS_URL"] = REDIS_URL


@pytest.fixture(scope="session")
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return AMQP_URL


_checked = False


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client on the test database; refuses a database it did not fill itself."""
    global _checked
    client = aioredis.Redis.from_url(redis_url)
    if not _checked:
        size = await client.dbsize()
        if size:
            await client.aclose()
            pytest.exit(
                f"refusing to run against {redis_url}: it holds {size} keys. Point "
                "COALESCER_TEST_REDIS_URL at an empty database (make test starts one).",
                returncode=3,
            )
        _checked = True
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


@pytest.fixture
async def store(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[Store]:
    s = await open_store(redis_url, grace_seconds=3600)
    yield s
    await s.close()


@pytest.fixture
def settings(redis_url: str) -> Settings:
    return Settings.from_environ({"REDIS_URL": redis_url, "COALESCER_INGEST_TOKEN": "s3cret"})


SCHEDULED = "2030-01-01T00:00:00.000Z"


@pytest.fixture
def message() -> Callable[..., dict[str, Any]]:
    return make_message


def make_message(
    task_id: str,
    state: str = "pending",
    *,
    run_id: int | None = 0,
    routes: tuple[str, ...] = ("coalesce.v1.k",),
    scheduled: str = SCHEDULED,
    deadline: str = "2030-01-02T00:00:00.000Z",
    runs: list[dict[str, Any]] | None = None,
    tags: dict[str, str] | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """A Pulse-shaped message ``{exchange, routingKey, CC, payload}`` valid against the schemas."""
    exchange = {
        "pending": "task-pending",
        "running": "task-running",
        "completed": "task-completed",
        "failed": "task-failed",
        "exception": "task-exception",
    }[state]
    if runs is None:
        runs = []
        if run_id is not None:
            for r in range(run_id + 1):
                run: dict[str, Any] = {
                    "runId": r,
                    "state": state if r == run_id else "exception",
                    "reasonCreated": "scheduled" if r == 0 else "retry",
                    "scheduled": scheduled,
                }
                if r < run_id:
                    run["reasonResolved"] = "worker-shutdown"
                    run["resolved"] = scheduled
                if run["state"] != "pending":
                    run.update(
                        workerGroup="wg", workerId="wi", takenUntil=scheduled, started=scheduled
                    )
                if run["state"] in ("completed", "failed", "exception") and "resolved" not in run:
                    run["resolved"] = scheduled
                    default = "canceled" if run["state"] == "exception" else run["state"]
                    run["reasonResolved"] = reason or default
                runs.append(run)
    payload: dict[str, Any] = {
        "version": 1,
        "status": {
            "taskId": task_id,
            "provisionerId": "proj",
            "workerType": "linux",
            "taskQueueId": "proj/linux",
            "schedulerId": "-",
            "projectId": "none",
            "taskGroupId": task_id,
            "deadline": deadline,
            "expires": "2031-01-01T00:00:00.000Z",
            "retriesLeft": 5,
            "state": runs[-1]["state"]
            if runs
            else ("exception" if state == "exception" else "unscheduled"),
            "runs": runs,
        },
        "task": {"tags": tags or {}},
    }
    if run_id is not None:
        payload["runId"] = run_id
    if state in ("running", "completed", "failed") or (state == "exception" and run_id is not None):
        payload["workerGroup"] = "wg"
        payload["workerId"] = "wi"
    if state == "running":
        payload["takenUntil"] = scheduled
    return {
        "exchange": f"exchange/taskcluster-queue/v1/{exchange}",
        "routingKey": f"primary.{task_id}.{run_id if run_id is not None else '_'}._._.proj.linux.-.{task_id}._",
        "CC": [f"route.{r}" for r in routes],
        "payload": payload,
    }
