"""Shared fixtures: a real Redis store (flushed around each test), event builders."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from coalescer.settings import Settings
from coalescer.store import Store, open_store

REDIS_URL = os.environ.get("COALESCER_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
AMQP_URL = os.environ.get("COALESCER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


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
